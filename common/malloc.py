"""Keep freed large blocks in the process heap, so a training step stops page-faulting its own arrays.

PyTorch's CPU tensors come from the C allocator.  glibc serves every block above its mmap
threshold (32 MiB at most) with a fresh ``mmap`` and gives it back with ``munmap`` when freed, so
each step of a training loop touches its large activations and gradients (a ``mini`` step has
dozens of 8-80 MB arrays) as brand-new pages: one page fault per 4 KiB, about 5 % of a `mini`
step on a 2-core CPU (`benchmarks/mlm_throughput.py --malloc default` vs `ours`: 5,880 vs 6,200
tokens/s; docs/results.md).  GPU
frameworks avoid this with a caching allocator; here the same effect comes from two ``mallopt``
settings: no mmap for large blocks (they come from the heap) and no trimming of the heap's top, so
freed memory is reused by the next step instead of returned to the kernel.

The price is that the process keeps its peak heap size until it exits — what a training process
does anyway.  Applied by the CPU training loops (pretraining, fine-tuning, dual-encoder and reranker
training) through `retain_freed_memory_for(device)`, never at import.

Inference takes a milder setting, `steady_thresholds_for(device)`: glibc's thresholds fixed at the
values its own adjustment tops out at.  Left to adjust, in a process that only encodes or reranks they
settle at the largest block freed so far (a forward's 6-13 MB activations) and trim the heap's top
above twice that, so each forward's freed activations went back to the kernel and the next forward
faulted them in again: 2,578 minor faults a reranked pair in fp32 on CPU-D, 3 with the thresholds fixed,
and 31.2 -> 34.7 pairs a second (`benchmarks/rerank_throughput.py --ours-only`; docs/results.md).  Bounded: blocks above 32 MiB are
still mapped and unmapped, and at most 64 MiB of free heap top is kept.

Holes are what the thresholds cannot bound: a long-running process that searches and reranks one query after
another (batches of ever other shapes) leaves free memory inside the heap that stays resident: 1.23 GB after 200
SciFact claims in fp32, of which 193 MB were in use (`benchmarks/search_memory.py --trim-above inf`, CPU-D).  So inference also calls
`trim_free_heap_for(device)` when it finishes: once the process's anonymous resident memory has grown by more
than `TRIM_ABOVE` (256 MiB) over where it settled after the last trim, ``malloc_trim(0)`` hands the heap's free
pages back (the next forwards fault what they reuse back in: eight times the faults over that loop).  "Settled"
is the highest reading of the first `SETTLE_CALLS` calls after a trim: a search's query encoding comes before its
reranking, which faults the most back in, so a floor read after the encoding alone left little headroom and
trimmed every few claims.

``TWOTOWER_MALLOC=default`` leaves the allocator alone.  A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_DEFAULT_MMAP_MAX = 65536  # glibc's default number of mmapped blocks
# Where glibc's dynamic thresholds settle in a loop that frees large arrays: the mmap threshold rises
# to the largest freed mmapped block, at most 32 MiB, and the trim threshold to twice that.
_STEADY_MMAP_THRESHOLD = 32 * 1024 * 1024
_STEADY = ((_M_MMAP_MAX, _DEFAULT_MMAP_MAX), (_M_MMAP_THRESHOLD, _STEADY_MMAP_THRESHOLD),
           (_M_TRIM_THRESHOLD, 2 * _STEADY_MMAP_THRESHOLD))
_RETAIN = ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))

# What this process last applied: "retain", "steady" or None (glibc's own adjustment).
_applied: str | None = None
# Anonymous resident growth over the settled floor above which finished inference trims the heap
# (`trim_free_heap_for`), and the calls after a trim whose readings set that floor.
TRIM_ABOVE = 256 * 1024 * 1024
SETTLE_CALLS = 4
_floor: int | None = None  # bytes: the highest reading of the settling calls, then lowered by any lower reading
_settling = SETTLE_CALLS  # settling calls left
_trim_lock = threading.Lock()  # one check or trim at a time (the service's owner and writer threads both encode)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # glibc only: musl and others lack it


def retain_freed_memory(enable: bool = True) -> bool:
    """Make glibc keep freed large blocks for reuse (``enable``) or go back to its usual behaviour.

    ``enable=False`` sets the values glibc's own dynamic thresholds reach in a training loop (mmap
    above 32 MiB, trim above 64 MiB): after any ``mallopt`` call glibc stops adapting them, so this
    is the closest one can come to never having called it (a benchmark uses it to give a peer the
    allocator it would have had).  Returns True when applied (glibc present, and for ``enable`` not
    switched off by ``TWOTOWER_MALLOC=default``).  Idempotent; process-wide.
    """
    if enable and _switched_off():
        return False
    return _apply("retain" if enable else "steady")


def _switched_off() -> bool:
    return os.environ.get("TWOTOWER_MALLOC", "retain") == "default"


def _apply(mode: str) -> bool:
    global _applied
    libc = _glibc()
    if libc is None:
        return False
    ok = all([bool(libc.mallopt(param, value)) for param, value in (_RETAIN if mode == "retain" else _STEADY)])
    logger.debug("mallopt %s applied=%s", mode, ok)
    if ok:
        _applied = mode
    return ok


def retain_freed_memory_for(device: torch.device) -> bool:
    """What a training loop calls: retain freed blocks when it trains on the CPU (GPU memory has its own cache)."""
    return device.type == "cpu" and retain_freed_memory()


def steady_thresholds_for(device: torch.device) -> bool:
    """What CPU inference calls (`encode_texts`, `CrossEncoder.predict`, `TaskModel.predict`): fix glibc's mmap threshold at 32 MiB and its
    trim threshold at 64 MiB, so that a forward's freed activations stay in the heap for the next (module doc).

    Never undoes `retain_freed_memory` (a training loop in the same process keeps its setting) and is applied
    once.  True when the thresholds are fixed by this call or an earlier one.
    """
    if device.type != "cpu" or _applied == "retain" or _switched_off():
        return False
    return _applied == "steady" or _apply("steady")


def _anonymous_resident_bytes() -> int | None:
    """Resident memory not backed by files (statm's resident less shared): a memory-mapped index paged in or out
    is not heap."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def trim_free_heap_for(device: torch.device) -> bool:
    """What CPU inference calls when it finishes (`encode_texts`, `CrossEncoder.predict`, `TaskModel.predict`):
    give the heap's free pages back to the kernel (``malloc_trim(0)``) once the process's anonymous resident memory
    has grown by more than `TRIM_ABOVE` over its settled floor (module doc: holes that later batches do not fill).

    Only where `steady_thresholds_for` applied: never in a training process (`retain_freed_memory` keeps its heap on
    purpose), nor with ``TWOTOWER_MALLOC=default``.  The first `SETTLE_CALLS` calls of the process, and after each
    trim, only set the floor; a call while another thread checks or trims skips.  True when it trimmed.
    """
    global _floor, _settling
    if device.type != "cpu" or _applied != "steady" or not _trim_lock.acquire(blocking=False):
        return False
    try:
        resident = _anonymous_resident_bytes()
        if resident is None:
            return False
        if _settling > 0 or _floor is None:
            _floor = resident if _floor is None else max(_floor, resident)
            _settling = max(0, _settling - 1)
            return False
        if resident < _floor:
            _floor = resident  # memory went back by other ways (unmapped blocks): measure growth from here
            return False
        libc = _glibc()
        if resident - _floor <= TRIM_ABOVE or libc is None:
            return False
        libc.malloc_trim(0)
        _floor, _settling = None, SETTLE_CALLS
        logger.debug("malloc_trim at %d anonymous resident bytes", resident)
        return True
    finally:
        _trim_lock.release()
