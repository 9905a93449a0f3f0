"""Splitting an index build across processes started by ``torchrun``.

Encoding is the expensive part of a build and it is embarrassingly parallel:
each rank encodes the shards whose number is ``rank (mod world_size)`` and
writes them to the shared build directory; after a barrier, rank 0 reads all
shards in order and assembles the index.  Because shard boundaries depend only
on the corpus and the shard size, every world size produces the same shards,
hence the same index.

The process group uses gloo on CPU (NCCL is not needed: only barriers cross
processes, no tensors) and a long timeout, because a rank may legitimately wait
at the barrier for as long as another takes to encode its share.
"""

from __future__ import annotations

from twotower.common.distributed import DistInfo, barrier, cleanup, init_distributed

__all__ = ["DistInfo", "barrier", "cleanup", "init_build_group", "owns_shard"]


def init_build_group() -> DistInfo:
    """Join the torchrun process group for a build (gloo even beside a GPU: only barriers and a few numbers cross
    processes; the long timeout of `init_distributed`), or a world of one without torchrun."""
    return init_distributed("cpu")


def owns_shard(shard: int, info: DistInfo) -> bool:
    """Strided assignment: rank r encodes shards r, r + W, r + 2W, ..."""
    return shard % info.world_size == info.rank
