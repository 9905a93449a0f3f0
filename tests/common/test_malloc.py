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
a = torch.ones(64 * 2**20 // 4); del a   # one 64 MiB block, freed (numpy would madvise huge pages)
before = faults()
for _ in range(10):
    a = torch.ones(64 * 2**20 // 4); del a   # the same size again: fresh pages, or the retained ones
print(applied, faults() - before)
"""


def _child(mode: str) -> tuple[str, int]:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(__file__)))}
    env.pop("TWOTOWER_MALLOC", None)
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(malloc._glibc() is None, reason="glibc only")
def test_retained_blocks_are_reused_without_page_faults():
    pages = 10 * 64 * 2**20 // 4096  # what ten fresh 64 MiB blocks fault in at 4 KiB pages
    applied, untouched = _child("untouched")
    assert untouched > pages // 2  # glibc mmaps and unmaps every such block: each reuse faults again
    applied, retained = _child("retain")
    # (glibc may still fall back to a fresh mapping once, when the heap cannot grow in place)
    assert applied == "True" and retained < pages // 4
    applied, restored = _child("default")  # glibc's usual behaviour is back
    assert applied == "True" and restored > pages // 2


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("TWOTOWER_MALLOC", "default")
    assert malloc.retain_freed_memory() is False
