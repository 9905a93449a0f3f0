"""The few torch.distributed facts a training loop needs, with a single-process fallback.

`torchrun --nproc_per_node N` sets WORLD_SIZE / RANK / LOCAL_RANK; we then join
a process group (NCCL on GPU, gloo on CPU).  Without those variables everything
here is a no-op, so the same loop runs alone or replicated.  torch is imported only when a group is
joined or used: the command line reads `launched_as` before it knows whether the command needs torch.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

T = TypeVar("T")


@dataclass
class DistInfo:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class PeerStopped(Exception):
    """Another rank stopped the collective work and reported why; this rank has nothing of its own to say."""


def launched_as() -> DistInfo:
    """The world torchrun started this process in (WORLD_SIZE / RANK / LOCAL_RANK), without joining any group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    return DistInfo(world, int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed(device_type: str | None = None) -> DistInfo:
    """Join the process group torchrun describes (or return a world of one)."""
    info = launched_as()
    if not info.enabled:
        return info
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dev = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
        if dev == "cuda":
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend="nccl" if dev == "cuda" else "gloo")
    return info


def barrier(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist

        dist.barrier()


def all_reduce_sum(values: list[float], info: DistInfo, device: torch.device | str = "cpu") -> list[float]:
    """Sum a few scalars over all ranks (float64, so token counts stay exact)."""
    if not info.enabled:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Replace each gradient by its mean over the ranks (a no-op alone).

    Why: each rank back-propagates the mean loss of its own slice of a global batch whose slices are equally
    large, so the mean of their gradients is the gradient of the whole batch's mean loss: N ranks then step
    like one process with an N times larger batch (`train_dual`, `train_reranker`). Every rank must pass the
    same parameters in the same order, with a gradient on all ranks or on none.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    n = dist.get_world_size()
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= n


def from_main(info: DistInfo, compute: Callable[[], T], share: bool = True) -> T | None:
    """`compute()` on rank 0 alone; with `share` every rank gets its result (pickled and broadcast), else the
    other ranks get None. Alone: just `compute()`.

    Why: work whose result every rank needs the same (mined negatives) or that only rank 0 uses (the dev first
    stage) is done once instead of once per rank. If it fails on rank 0, rank 0 re-raises its error and the
    other ranks raise `PeerStopped`, so none waits in a collective for ever.
    """
    if not info.enabled:
        return compute()
    import torch.distributed as dist

    result, error = None, None
    if info.is_main:
        try:
            result = compute()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            error = exc
    box: list[Any] = [(error is not None, result if share and error is None else None)]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    failed, value = box[0]
    if failed:
        raise PeerStopped("rank 0 stopped; its error message says why")
    return result if info.is_main else value


def gather_shards(items: Sequence[Any], compute: Callable[[list], np.ndarray], info: DistInfo) -> np.ndarray:
    """`compute` over this rank's contiguous share of `items`, the rows of every rank concatenated in order:
    every rank gets ``compute(items)`` (up to floating point: the shares are computed in other batches).

    Why: embedding a corpus is split over the ranks instead of repeated on each (`Teacher`). A failure on
    one rank is re-raised there; the others raise `PeerStopped`.
    """
    if not info.enabled:
        return compute(list(items))
    import numpy as np
    import torch.distributed as dist

    per = -(-len(items) // info.world_size)
    mine = list(items[info.rank * per:(info.rank + 1) * per])
    part, error = None, None
    try:
        part = compute(mine) if mine else None
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
        error = exc
    parts: list[Any] = [None] * info.world_size
    dist.all_gather_object(parts, (error is not None, part))
    if error is not None:
        raise error
    if any(failed for failed, _ in parts):
        raise PeerStopped("another rank stopped; its error message says why")
    rows = [p for _, p in parts if p is not None]
    return np.concatenate(rows) if rows else compute([])


def cleanup(info: DistInfo) -> None:
    """Leave the process group so that gloo's worker threads are joined before the interpreter exits.

    Why this order: a gloo worker thread drops its last reference to a finished collective's output tensors
    after the caller has already returned; if that happens while Python is finalising, the thread cannot take
    the GIL and the process aborts ("terminate called without an active exception", SIGABRT) although the work
    succeeded. Autograd graphs that went through a differentiable all_gather keep the group alive, so they are
    collected first; the barrier lets every rank finish its last collective before anyone tears down.
    """
    if not info.enabled:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
