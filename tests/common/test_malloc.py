"""twotower.common.malloc: glibc keeps freed large blocks once asked (fewer page faults on reuse), and can be undone;
inference fixes its thresholds, bounded, without undoing a training loop's setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from twotower.common import malloc

CHILD = r"""
import resource, sys
import torch
import twotower.encoder  # a training process has the whole encoder stack loaded before its first step
from twotower.common.malloc import retain_freed_memory
applied = retain_freed_memory(sys.argv[1] == "retain") if sys.argv[1] != "untouched" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss_pages():
    return int(open("/proc/self/statm").read().split()[1])
def step():  # a training step's large arrays (torch allocates them 64-byte aligned: posix_memalign), then freed
    arrays = [torch.ones(mib * 2**20 // 4) for mib in (48, 24, 80, 8, 64)]
    del arrays
step()
before, rss = faults(), rss_pages()
for _ in range(10):
    step()
print(applied, faults() - before, rss_pages() - rss)
"""

STEP_PAGES = (48 + 24 + 80 + 8 + 64) * 2**20 // 4096  # what one step's arrays fault in as fresh 4 KiB pages


def _run(code: str, mode: str) -> list[str]:
    """What a fresh interpreter running `code` prints, split (the allocator state of a new process)."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__)))}
    env.pop("TWOTOWER_MALLOC", None)
    return subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env,
                          check=True).stdout.split()


def _child(mode: str) -> tuple[str, int, int]:
    applied, faults, grown = _run(CHILD, mode)
    return applied, int(faults), int(grown)


@pytest.mark.skipif(malloc._glibc() is None, reason="glibc only")
def test_retained_blocks_are_reused_without_page_faults():
    """Ten steps of five large arrays. A loop of one array alone stopped being a fair test with glibc
    2.36-9+deb12u14 (its _int_memalign fix, CVE-2026-0861): each aligned block of that one size then came
    from fresh heap, so the loop faulted and grew 64 MiB a step, while a step of several arrays, as
    training allocates them, reuses its blocks."""
    pages = 10 * STEP_PAGES
    applied, untouched, _ = _child("untouched")
    assert untouched > pages // 2  # glibc mmaps and unmaps every such block: each reuse faults again
    applied, retained, grown = _child("retain")
    # (glibc may still fall back to fresh memory once, when the heap cannot grow in place)
    assert applied == "True" and retained < pages // 8
    assert grown < STEP_PAGES  # the freed blocks are reused: the heap does not grow step after step
    applied, restored, _ = _child("default")  # glibc's usual behaviour is back
    assert applied == "True" and restored > pages // 2


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("TWOTOWER_MALLOC", "default")
    assert malloc.retain_freed_memory() is False


INFERENCE_CHILD = r"""
import resource, sys
import torch
import twotower.encoder
from twotower.common import malloc
cpu = torch.device("cpu")
mode = sys.argv[1]
if mode == "retain-then-steady":
    malloc.retain_freed_memory()
applied = malloc.steady_thresholds_for(cpu) if mode != "untouched" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def rss_pages():
    return int(open("/proc/self/statm").read().split()[1])
def freed_and_returned(mib):  # pages given back to the kernel when a block of `mib` MiB is freed
    block = torch.ones(mib * 2**20 // 4)
    rss = rss_pages()
    del block
    return rss - rss_pages()
kept = 20 * 2**20 // 4096 - freed_and_returned(20)  # an activation-sized block: kept for the next forward?
def forward():  # a forward's activations, all below 32 MiB, made and freed in turn
    a = torch.ones(12 * 2**20 // 4); b = torch.ones(6 * 2**20 // 4); del a
    c = torch.ones(12 * 2**20 // 4); d = torch.ones(3 * 2**20 // 4); del b, c, d
forward()
before = faults()
for _ in range(10):
    forward()
print(applied, kept, faults() - before, freed_and_returned(80))
"""
FORWARD_PAGES = (12 + 6 + 12 + 3) * 2**20 // 4096
BLOCK_PAGES, BIG_PAGES = 20 * 2**20 // 4096, 80 * 2**20 // 4096


def _inference_child(mode: str) -> tuple[str, int, int, int]:
    applied, kept, faults, returned = _run(INFERENCE_CHILD, mode)
    return applied, int(kept), int(faults), int(returned)


@pytest.mark.skipif(malloc._glibc() is None, reason="glibc only")
def test_inference_thresholds_keep_a_forwards_activations_and_stay_bounded():
    """A freed 20 MiB block goes back to the kernel in a fresh process (glibc maps it afresh), and stays in the
    heap for the next forward once the thresholds are fixed; ten forwards of 3-12 MiB blocks then reuse their
    memory without page faults; a block above 32 MiB is still returned when freed; a training loop's
    `retain_freed_memory` is not undone.  (Left alone, glibc re-faulted anywhere from 1,536 to 65,760 pages over
    those ten forwards from one run to the next, so that count is not compared; reranking alone measured 2,578
    faults a pair in fp32 on CPU-D, docs/results.md.)"""
    pages = 10 * FORWARD_PAGES
    applied, kept, _, returned = _inference_child("untouched")
    assert kept < 0.1 * BLOCK_PAGES and returned > 0.9 * BIG_PAGES
    applied, kept, steady, returned = _inference_child("steady")
    assert applied == "True" and kept > 0.9 * BLOCK_PAGES and steady < pages // 8
    assert returned > 0.9 * BIG_PAGES
    applied, kept, retained, returned = _inference_child("retain-then-steady")
    assert applied == "False" and kept > 0.9 * BLOCK_PAGES and retained < pages // 8
    assert returned < 0.1 * BIG_PAGES  # retain's no-trim setting still holds: the freed block stays


def test_inference_thresholds_only_on_cpu_and_not_when_switched_off(monkeypatch):
    monkeypatch.setattr(malloc, "_applied", None)  # as in a fresh process (an earlier test may have applied one)
    calls = []
    monkeypatch.setattr(malloc, "_apply", lambda mode: calls.append(mode) or True)
    assert malloc.steady_thresholds_for(torch.device("cuda")) is False
    monkeypatch.setenv("TWOTOWER_MALLOC", "default")
    assert malloc.steady_thresholds_for(torch.device("cpu")) is False
    assert calls == []
    monkeypatch.delenv("TWOTOWER_MALLOC")
    assert malloc.steady_thresholds_for(torch.device("cpu")) is True and calls == ["steady"]


HOLES_CHILD = r"""
import torch
from twotower.common import malloc
cpu = torch.device("cpu")
def rss_pages():
    return int(open("/proc/self/statm").read().split()[1])
malloc.steady_thresholds_for(cpu)
malloc.TRIM_ABOVE, malloc.SETTLE_CALLS, malloc._settling = 64 * 2**20, 1, 1
malloc.trim_free_heap_for(cpu)  # the first call sets the floor
big, small = [], []
for _ in range(64):  # 4 MiB blocks (below the 32 MiB mmap threshold: from the heap), each followed by a small
    big.append(torch.ones(4 * 2**20 // 4))  # block that stays, so the freed ones are holes, not the heap's top
    small.append(torch.ones(1024))
rss = rss_pages()
del big
freed = rss - rss_pages()
rss = rss_pages()
trimmed = malloc.trim_free_heap_for(cpu)
print(trimmed, freed, rss - rss_pages())
"""
HOLE_PAGES = 64 * 4 * 2**20 // 4096


@pytest.mark.skipif(malloc._glibc() is None, reason="glibc only")
def test_finished_inference_gives_back_the_heaps_holes():
    """Freed blocks between live ones stay resident under the fixed thresholds (a search process grew 6 MB a
    query that way, docs/results.md); once resident memory has grown past `TRIM_ABOVE`, the trim returns them."""
    trimmed, freed, returned = _run(HOLES_CHILD, "trim")
    assert int(freed) < 0.1 * HOLE_PAGES  # holes: freed, yet resident
    assert trimmed == "True" and int(returned) > 0.9 * HOLE_PAGES


def test_trims_only_past_the_growth_limit_from_a_settled_floor(monkeypatch):
    """The floor is the highest reading of the first `SETTLE_CALLS` calls, and of the first after each trim (their
    forwards have faulted the working set back in by then); a trim needs growth past `TRIM_ABOVE` from it."""
    resident = iter([100, 150, 161, 212, 300, 120, 500, 90, 130, 151, 140, 160])
    trims = []

    class Libc:
        def malloc_trim(self, pad):
            trims.append(pad)

    monkeypatch.setattr(malloc, "_applied", "steady")
    monkeypatch.setattr(malloc, "_floor", None)
    monkeypatch.setattr(malloc, "SETTLE_CALLS", 2)
    monkeypatch.setattr(malloc, "_settling", 2)
    monkeypatch.setattr(malloc, "_glibc", lambda: Libc())
    monkeypatch.setattr(malloc, "_anonymous_resident_bytes", lambda: next(resident))
    monkeypatch.setattr(malloc, "TRIM_ABOVE", 60)
    cpu = torch.device("cpu")
    got = [malloc.trim_free_heap_for(cpu) for _ in range(12)]
    # settling: 100, 150 -> floor 150; 161 +11; 212 +62 trim; settling: 300, 120 -> floor 300; 500 +200 trim;
    # settling: 90, 130 -> floor 130; 151 +21; 140 +10; 160 +30
    assert got == [False, False, False, True, False, False, True, False, False, False, False, False]
    assert trims == [0, 0]
    monkeypatch.setattr(malloc, "_anonymous_resident_bytes", lambda: 80)  # a lower reading lowers the floor
    assert malloc.trim_free_heap_for(cpu) is False and malloc._floor == 80
    assert malloc.trim_free_heap_for(torch.device("cuda")) is False
    monkeypatch.setattr(malloc, "_anonymous_resident_bytes", lambda: 10**12)
    for applied in ("retain", None):  # a training process keeps its heap; glibc left alone
        monkeypatch.setattr(malloc, "_applied", applied)
        assert malloc.trim_free_heap_for(cpu) is False and len(trims) == 2
    monkeypatch.setattr(malloc, "_applied", "steady")
    with malloc._trim_lock:  # another thread checking or trimming: this call skips
        assert malloc.trim_free_heap_for(cpu) is False and len(trims) == 2
    assert malloc.trim_free_heap_for(cpu) is True and len(trims) == 3
