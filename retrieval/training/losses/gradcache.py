"""GradCache: a contrastive batch far larger than memory, with exactly the uncached gradients.

Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup".  The contrastive loss couples every embedding of the batch, so
it cannot be split into independent micro-batches; but the *encoder* part can:

1. embed every chunk without building a graph (no_grad), remembering the RNG state;
2. compute the loss on the detached embeddings and backpropagate to them only,
   which gives dL/de for each embedding e (the "cache");
3. re-embed each chunk with a graph, replaying its RNG state so dropout draws the
   same masks, and backpropagate the surrogate sum(e * dL/de).

By the chain rule step 3 accumulates exactly dL/dtheta, while memory holds one
chunk's activations at a time.  The price is a second forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Inputs = dict[str, torch.Tensor]


class RngState:
    """The CPU and CUDA generator states at one point, to replay a forward pass's dropout exactly.

    device: where the forward pass computes (the model's device), not where its inputs are: the encoders
    take CPU batches and move them, so the inputs would leave out the CUDA generator that draws dropout.
    """

    def __init__(self, device: torch.device | str) -> None:
        device = torch.device(device)
        self.cpu = torch.get_rng_state()
        self.cuda_devices = ([torch.cuda.current_device() if device.index is None else device.index]
                             if device.type == "cuda" else [])
        self.cuda = [torch.cuda.get_rng_state(i) for i in self.cuda_devices]

    def replay(self):
        """A context in which the generators start from this state; the outer state is restored after."""
        fork = torch.random.fork_rng(devices=self.cuda_devices)

        class _Ctx:
            def __enter__(ctx):
                fork.__enter__()
                torch.set_rng_state(self.cpu)
                for i, state in zip(self.cuda_devices, self.cuda):
                    torch.cuda.set_rng_state(state, i)

            def __exit__(ctx, *exc):
                return fork.__exit__(*exc)

        return _Ctx()


def split_inputs(inputs: Inputs, chunk_size: int) -> list[Inputs]:
    """Row chunks of a dict of (N, ...) tensors."""
    n = next(iter(inputs.values())).shape[0]
    return [{k: v[i:i + chunk_size] for k, v in inputs.items()} for i in range(0, n, chunk_size)]


def cached_step(
    towers: Sequence[tuple[Callable[[Inputs], torch.Tensor], Inputs]],
    loss_fn: Callable[[list[torch.Tensor]], torch.Tensor],
    chunk_size: int,
    device: torch.device | str,
) -> torch.Tensor:
    """Backpropagate `loss_fn` over the embeddings of several input groups, chunk by chunk.

    Args:
        towers: (encode, inputs) per group, e.g. [(query_tower, query_inputs), (doc_tower, doc_inputs)];
            ``encode(chunk) -> (n, H)`` embeds a row chunk of ``inputs`` (dict of (N, T) tensors).
        loss_fn: maps the list of full (N_g, H) embedding matrices, one per group, to a scalar.
            Parameters it owns (a learned temperature) get their gradient directly.
        chunk_size: rows embedded at once; memory scales with it, the result does not.
        device: where the encoders compute, whose generator is replayed (`RngState`).
    Returns:
        the loss value (detached). Gradients are accumulated into ``.grad`` as ``loss.backward()`` would.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    # 1. graph-free embeddings, with the RNG state each chunk started from.
    cache: list[list[tuple[Inputs, RngState]]] = []
    reps: list[torch.Tensor] = []
    for encode, inputs in towers:
        chunks, outs = [], []
        for chunk in split_inputs(inputs, chunk_size):
            state = RngState(device)
            with torch.no_grad():
                outs.append(encode(chunk))
            chunks.append((chunk, state))
        cache.append(chunks)
        reps.append(torch.cat(outs).detach().requires_grad_(True))  # (N_g, H)
    # 2. loss on the detached embeddings -> dL/de.
    loss = loss_fn(reps)
    loss.backward()
    # 3. re-embed with a graph, same dropout masks, and push dL/de through the encoder.
    for (encode, _), chunks, rep in zip(towers, cache, reps):
        grads = rep.grad.split([next(iter(c.values())).shape[0] for c, _ in chunks])
        for (chunk, state), grad in zip(chunks, grads):
            with state.replay():
                out = encode(chunk)  # (n, H)
            out.backward(grad.to(out.dtype))
    return loss.detach()
