"""Mean cross-entropy and accuracy over gathered MLM logits in few passes over memory.

The sparse MLM head's (N, V) logits are the largest tensor of a small model's step (N ~ 1,200
targets x 16k vocabulary = 20M values).  The plain route, `F.cross_entropy(logits.float(), t)`,
walks that array six or seven times: the fp32 copy, log-softmax, the zero-filled gradient of the
NLL, log-softmax's backward, the cast of the gradient back to bf16, an argmax for the accuracy,
each into a freshly allocated 40-80 MB buffer whose first touch (page faults) costs more than the
arithmetic done in it.  For one `mini` step's logits (1216 x 16000 bf16) this route takes about half
the time of that one, forward and backward, on a 2-core CPU (`benchmarks/cpu_train_kernels.py`).  Here the forward pass computes log-softmax once (in
fp32, whatever the logits' dtype), reads the loss and the argmax from it, and, when a gradient is
needed, turns the same buffer into softmax - one_hot and stores it in the logits' dtype, scaled by
1/N; the backward pass only multiplies by the incoming scalar.

The values equal `F.cross_entropy(logits.float(), targets)` and its gradient (up to fp32 rounding
order); tests/encoder/test_fused_cross_entropy.py checks both.
"""

from __future__ import annotations

import threading

import torch

_scratch = threading.local()


def _workspace(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """An fp32 scratch array of `shape`, reused across calls in this thread.

    A fresh 80 MB array per step costs more in page faults (first touch) than the arithmetic done
    in it.  The scratch is only used inside one forward call, so reuse is safe.
    """
    n = shape[0] * shape[1]
    store = getattr(_scratch, "buffers", None)
    if store is None:
        store = _scratch.buffers = {}
    buf = store.get(device)
    if buf is None or buf.numel() < n:
        buf = store[device] = torch.empty(int(n * 1.25), dtype=torch.float32, device=device)
    return buf[:n].view(shape)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor):  # type: ignore[override]
        # logits (N, V) any float dtype; targets (N,) long, all valid class ids
        n = logits.shape[0]
        # fp32 logits with a gradient to come: log-softmax straight into a fresh array that then becomes
        # the saved gradient (one read of the logits, no scratch copy in and none out).
        own = logits.dtype == torch.float32 and ctx.needs_input_grad[0]
        if own:
            lsm = torch.log_softmax(logits, dim=-1)  # (N, V) fp32
        else:
            lsm = _workspace(logits.shape, logits.device).copy_(logits)  # (N, V) fp32
            torch.log_softmax(lsm, dim=-1, out=lsm)
        picked = lsm.gather(1, targets[:, None]).squeeze(1)  # (N,)
        loss = -picked.sum() / n
        correct = (lsm.argmax(-1) == targets).sum()
        if ctx.needs_input_grad[0]:
            lsm.exp_()  # softmax
            lsm[torch.arange(n, device=lsm.device), targets] -= 1.0
            lsm.mul_(1.0 / n)
            # d loss / d logits; from the scratch always a copy: the next call's forward overwrites it
            ctx.save_for_backward(lsm if own else lsm.to(logits.dtype, copy=True))
        ctx.mark_non_differentiable(correct)
        return loss, correct

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_correct: torch.Tensor | None):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        if grad_loss.device.type == "cpu" and float(grad_loss) == 1.0:  # the usual case: nothing to scale
            return grad, None
        return (grad.float() * grad_loss).to(grad.dtype), None  # scale in fp32 (e.g. 1 / accumulation)


def cross_entropy_with_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, number of rows whose argmax is the target) for (N, V) logits, (N,) targets.

    Every target must be a class id (gather the rows first; there is no ignore index here).
    The argmax is taken over the fp32 log-softmax; ties resolve to the lowest index, as `argmax` does.
    """
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"expected logits (N, V) and targets (N,), got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if logits.shape[0] == 0:
        raise ValueError("cross-entropy over zero targets is undefined")
    return _CrossEntropy.apply(logits, targets)
