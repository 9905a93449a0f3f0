"""Negatives from every rank: a differentiable all_gather for contrastive losses under torchrun.

With data parallelism each rank holds B queries; gathering the documents of all
ranks lets every query see world_size * N negatives for the price of one
all_gather.  The gather must be *differentiable* (`_GatherWithGrad`), or the
documents of other ranks would contribute no gradient and the loss would no
longer equal the loss of one big batch.

Order is rank order: ``gather(x)`` on ranks 0..R-1 returns ``cat([x_0, ..., x_R-1])``
on every rank, so gathering queries, positives and negatives separately and
concatenating gives exactly the layout of the single-process batch made by
concatenating the ranks' batches.  Every rank then computes that same full
loss; DDP's gradient averaging divides by R what the all_gather backward summed
over R ranks, which leaves the single-batch gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _GatherWithGrad(torch.autograd.Function):
    """all_gather whose backward sums each rank's gradient of the gathered tensor and keeps this rank's slice.

    Why our own: ``torch.distributed.nn.functional.all_gather`` is deprecated (a FutureWarning on every rank);
    this uses only the public collectives, all of which gloo and NCCL have.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # (n, H) -> (R * n, H)
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x)
        ctx.n, ctx.rank = x.shape[0], dist.get_rank()
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # (R * n, H) -> (n, H)
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)  # every rank's loss depends on this rank's rows
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """(n, H) on each rank -> (R * n, H) in rank order, gradients flowing back to every rank's x.

    All ranks must pass the same n (pad or drop the last uneven batch).
    """
    if world_size() == 1:
        return x
    return _GatherWithGrad.apply(x.contiguous())
