"""The few torch.distributed facts a training loop needs, with a single-process fallback.

`torchrun --nproc_per_node N` sets WORLD_SIZE / RANK / LOCAL_RANK; we then join
a process group (NCCL on GPU, gloo on CPU).  Without those variables everything
here is a no-op, so the same loop runs alone or replicated.  torch is imported only when a group is
joined or used: the command line reads `launched_as` before it knows whether the command needs torch.
"""

from __future__ import annotations

import datetime
import gc
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)


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


def this_rank_only(error: E) -> E:
    """Mark `error` as one this rank may have met alone (its share of the work, its own saved generator), and
    return it: the command line prints a marked error on any rank, naming the rank.

    Why: under torchrun rank 0 alone prints errors, since every rank runs the same checks on the same input and
    would say the same thing once per rank; an error raised on rank 1 alone then ended the run with no word of
    ours, only torchrun's summary.
    """
    error.this_rank_only = True  # type: ignore[attr-defined]
    return error


def met_by_this_rank_only(error: BaseException) -> bool:
    """Whether `error` was marked by `this_rank_only`."""
    return bool(getattr(error, "this_rank_only", False))


def launched_as() -> DistInfo:
    """The world torchrun started this process in (WORLD_SIZE / RANK / LOCAL_RANK), without joining any group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    return DistInfo(world, int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")))


# How long a rank waits in a collective: work that one rank does for all (mining, a dev evaluation, encoding its
# shards) can take hours on a large corpus, while torch's defaults (10 min NCCL, 30 min gloo) would kill the
# waiting ranks. A rank that fails exits, and torchrun stops the others, so a long wait never hides a failure.
COLLECTIVE_TIMEOUT_HOURS = 12


def init_distributed(device: str | None = None) -> DistInfo:
    """Join the process group torchrun describes (or return a world of one).

    device: the device the command computes on (its ``--device``: "cpu", "cuda", "cuda:1"; None: a GPU when
    there is one). NCCL for a GPU, gloo for the CPU: ``--device cpu`` on a machine with a GPU joined NCCL,
    whose collectives refuse CPU tensors.
    """
    info = launched_as()
    if not info.enabled:
        return info
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dev = device.split(":")[0] if device else ("cuda" if torch.cuda.is_available() else "cpu")
        if dev == "cuda":
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend="nccl" if dev == "cuda" else "gloo",
                                timeout=datetime.timedelta(hours=COLLECTIVE_TIMEOUT_HOURS))
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


def _comm_device() -> torch.device:
    """Where this group's collectives take their tensors: the current GPU under NCCL, else the CPU (gloo)."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def stopped_anywhere(error: BaseException | None, info: DistInfo, who: str) -> None:
    """Every rank learns whether any failed (one all-reduce; alone: `error` is raised, if any): the failed rank
    re-raises its error, the others raise `PeerStopped`, so none waits in a later collective for ever (or fails
    there with gloo's "Connection closed by peer" once the failed rank has exited). An error rank 0 did not meet
    is marked `this_rank_only`, so that the rank that met it says it (rank 0, which speaks for all, has nothing
    to say)."""
    if not info.enabled:
        if error is not None:
            raise error
        return
    failed, main_failed = all_reduce_sum([1.0 if error is not None else 0.0,
                                          1.0 if error is not None and info.is_main else 0.0], info, _comm_device())
    if error is not None:
        if not main_failed:
            this_rank_only(error)
        raise error
    if failed:
        raise PeerStopped(f"{who} stopped; its error message says why")


def from_main(info: DistInfo, compute: Callable[[], T], share: Callable[[T], Any] | None = None,
              unshare: Callable[[Any], T] | None = None) -> T | None:
    """`compute()` on rank 0 alone; the other ranks get None, or with `share` / `unshare` rank 0's result:
    ``unshare(share(result))``, where `share` makes it a JSON value. Alone: just `compute()`.

    Why: work whose result every rank needs the same (mined negatives) or that only rank 0 uses (the dev first
    stage, a build's checks) is done once instead of once per rank. JSON, not pickle: nothing a rank receives
    is unpickled. If `compute` fails on rank 0, rank 0 re-raises its error and the others raise `PeerStopped`.
    """
    if not info.enabled:
        return compute()
    result, error = None, None
    if info.is_main:
        try:
            result = compute()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            error = exc
    stopped_anywhere(error, info, "rank 0")
    if share is None:
        return result
    value = _broadcast_json(share(result) if info.is_main else None)
    return result if info.is_main else unshare(value) if unshare is not None else value


def _broadcast_json(value: Any) -> Any:
    """Rank 0's JSON value on every rank: its UTF-8 bytes in a uint8 tensor, the length sent first."""
    import json

    import torch
    import torch.distributed as dist

    device = _comm_device()
    data = json.dumps(value).encode("utf-8") if dist.get_rank() == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else
           torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    dist.broadcast(buf, src=0)
    return json.loads(buf.cpu().numpy().tobytes().decode("utf-8")) if dist.get_rank() != 0 else value


def gather_shards(items: Sequence[Any], compute: Callable[[list], np.ndarray], info: DistInfo) -> np.ndarray:
    """`compute` over this rank's contiguous share of `items`, the rows of every rank concatenated in order:
    every rank gets ``compute(items)`` (up to floating point: the shares are computed in other batches).
    `compute` returns a float32 array of one row per item.

    Why: embedding a corpus is split over the ranks instead of repeated on each (`Teacher`). A failure on
    one rank is re-raised there; the others raise `PeerStopped`. Tensors, not pickled objects, cross ranks.
    """
    if not info.enabled:
        return compute(list(items))
    import numpy as np
    import torch
    import torch.distributed as dist

    per = -(-len(items) // info.world_size)
    mine = list(items[info.rank * per:(info.rank + 1) * per])
    part, error = None, None
    try:
        part = np.asarray(compute(mine), dtype=np.float32) if mine else None  # (n_r, H)
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
        error = exc
    stopped_anywhere(error, info, "another rank")
    device = _comm_device()
    shape = torch.tensor(part.shape if part is not None else (0, -1), dtype=torch.int64, device=device)
    shapes = [torch.empty_like(shape) for _ in range(info.world_size)]
    dist.all_gather(shapes, shape)
    rows = [int(t[0]) for t in shapes]
    width = max(int(t[1]) for t in shapes)
    if width < 0:  # no rank had items
        return compute([])
    padded = torch.zeros(max(rows), width, dtype=torch.float32, device=device)
    if part is not None:
        padded[:rows[info.rank]] = torch.from_numpy(part)
    parts = [torch.empty_like(padded) for _ in range(info.world_size)]
    dist.all_gather(parts, padded)
    return np.concatenate([t[:n].cpu().numpy() for t, n in zip(parts, rows)])  # (N, H)


def gather_states(states: dict[str, torch.Tensor], info: DistInfo) -> list[dict[str, torch.Tensor]]:
    """Every rank's `states` (the same keys, each a uint8 tensor of the same size on every rank), in rank order,
    on the CPU. Alone: ``[states]``.

    Why: the random generators' states, which each rank draws its own dropout from, are saved by rank 0 alone
    (`twotower.retrieval.training.loop`), so that a resumed run gives each rank its own stream back.
    """
    if not info.enabled:
        return [states]
    import torch
    import torch.distributed as dist

    device = _comm_device()
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(info.world_size)]
    for key in sorted(states):
        mine = states[key].contiguous().to(device)
        parts = [torch.empty_like(mine) for _ in range(info.world_size)]
        dist.all_gather(parts, mine)
        for r, part in enumerate(parts):
            out[r][key] = part.cpu()
    return out


def cleanup(info: DistInfo, failed: bool = False) -> None:
    """Leave the process group so that gloo's worker threads are joined before the interpreter exits.

    Why this order: a gloo worker thread drops its last reference to a finished collective's output tensors
    after the caller has already returned; if that happens while Python is finalising, the thread cannot take
    the GIL and the process aborts ("terminate called without an active exception", SIGABRT) although the work
    succeeded. Autograd graphs that went through a differentiable all_gather keep the group alive, so they are
    collected first; the barrier lets every rank finish its last collective before anyone tears down.

    `failed` (this rank is leaving on an exception: an error, Ctrl-C, SIGTERM): no barrier, since the other
    ranks may still be working and would not reach it (the job hung there until the group's timeout).
    """
    if not info.enabled:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        gc.collect()
        if not failed:
            dist.barrier()
        dist.destroy_process_group()
