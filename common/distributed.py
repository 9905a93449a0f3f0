"""The few torch.distributed facts a training loop needs, with a single-process fallback.

`torchrun --nproc_per_node N` sets WORLD_SIZE / RANK / LOCAL_RANK; we then join
a process group (NCCL on GPU, gloo on CPU).  Without those variables everything
here is a no-op, so the same loop runs alone or replicated.  torch is imported only when a group is
joined or used: the command line reads `launched_as` before it knows whether the command needs torch.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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
