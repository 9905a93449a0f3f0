"""twotower.common.malloc: glibc keeps freed large blocks once asked (fewer page faults on reuse), and can be undone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

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


def _child(mode: str) -> tuple[str, int, int]:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__)))}
    env.pop("TWOTOWER_MALLOC", None)
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, check=True)
    applied, faults, grown = out.stdout.split()
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
