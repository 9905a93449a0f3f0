"""Negatives from every rank: a differentiable all_gather for contrastive losses under torchrun.

With data parallelism each rank holds B queries; gathering the documents of all
ranks lets every query see world_size * N negatives for the price of one
all_gather.  The gather must be *differentiable* (torch.distributed.nn), or the
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


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """(n, H) on each rank -> (R * n, H) in rank order, gradients flowing back to every rank's x.

    All ranks must pass the same n (pad or drop the last uneven batch).
    """
    if world_size() == 1:
        return x
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(x.contiguous()), dim=0)
