"""Crash safety: SIGKILL a real writer process at each step of a commit, then reopen.

The child commits batch 1 (d0..d99), then stages batch 2 (d100..d199 added, d0 deleted)
and commits it. A hook in ``IndexStore.commit`` (``twotower.indexing.store.CRASH_HOOK``) writes a
signal file at the chosen step and sleeps; the parent SIGKILLs it there. Before the
SQLite commit point the directory must hold exactly batch 1; after it, exactly batch 2.

The BM25 cache of batch 2 is written before the commit point too: whatever the step, the directory holds
the cache of the generation it opens at, so a reader loads it rather than rebuilding BM25 from every document,
and a cache of the uncommitted generation is a stray that ``index check`` ignores and the next writable open
deletes, like a stray segment.

Two merge policies cover both ways a commit writes vectors: the default one writes batch 2
as a new segment (d0 becomes a tombstone row), and ``merge`` (factor 2) merges batch 1 and
batch 2 into one new segment in the same commit, deleting the old file after the commit point.
"""

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.indexing.procs import kill_at_flag
from twotower.indexing import IndexStore
from twotower.indexing.bm25 import BM25
from twotower.indexing.check import check_index
from twotower.indexing.store import bm25_name

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {repo!r})
    import faiss, numpy as np
    faiss.omp_set_num_threads(1)
    import twotower.indexing.store as st
    from twotower.indexing import IndexStore, MergePolicy

    directory, stage, signal_file, factory, policy = sys.argv[1:]
    policy = MergePolicy(factor=2, min_segment=10) if policy == "merge" else MergePolicy()
    x = np.random.default_rng(0).normal(size=(200, 8)).astype("float32")
    docs = lambda lo, hi: [{{"id": f"d{{i}}", "title": "t", "text": f"word{{i}}"}} for i in range(lo, hi)]

    def stop_here(name):
        # write, then rename: the parent polls for the file and must never read it half-written
        with open(signal_file + ".tmp", "w") as f:
            f.write(name)
        os.replace(signal_file + ".tmp", signal_file)
        time.sleep(120)  # the parent kills us here

    store = IndexStore.create(directory, 8, factory, "cosine", bm25=True, merge_policy=policy)
    store.add(docs(0, 100), x[:100])
    store.commit()
    store.search_bm25(["word1"], 1)  # load BM25 so commits also write it
    st.CRASH_HOOK = lambda name: stop_here(name) if name == stage else None
    store.add(docs(100, 200), x[100:200])
    store.delete(["d0"])
    if stage == "staged":
        stop_here(stage)
    store.commit()
    stop_here("done")
    """
)

X = np.random.default_rng(0).normal(size=(200, 8)).astype("float32")  # same as the child's


def run_and_kill(tmp_path: Path, stage: str, factory: str, policy: str) -> Path:
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    directory, flag = tmp_path / "idx", tmp_path / "signal"
    proc = subprocess.Popen([sys.executable, str(script), str(directory), stage, str(flag), factory, policy])
    kill_at_flag(proc, flag, stage)
    assert proc.returncode == -signal.SIGKILL
    return directory


@pytest.mark.parametrize(
    "stage,committed,policy",
    [
        ("staged", False, "default"),  # documents staged in SQLite, vectors in memory
        ("before_vectors", False, "default"),  # commit() entered
        ("segment_written", False, "default"),  # the new segment renamed into place, SQLite not committed
        ("merge_written", False, "merge"),  # the merged segment renamed into place, SQLite not committed
        ("files_written", False, "default"),  # records staged in the SQLite transaction, not committed
        ("files_written", False, "merge"),
        ("bm25_written", False, "default"),  # the next generation's BM25 cache in place, SQLite not committed
        ("sqlite_committed", True, "default"),  # the commit point passed; manifest not tidied
        ("sqlite_committed", True, "merge"),  # ... and the merged-away file not yet deleted
        ("old_files_removed", True, "merge"),
        ("manifest_written", True, "default"),  # manifest tidied too (the BM25 cache was written before the commit)
        ("manifest_written", True, "merge"),
    ],
)
@pytest.mark.parametrize("factory", ["Flat", "HNSW32"])
def test_sigkill_during_commit_leaves_last_commit(tmp_path, stage, committed, policy, factory, monkeypatch):
    directory = run_and_kill(tmp_path, stage, factory, policy)
    want = [f"d{i}" for i in (range(1, 200) if committed else range(100))]
    generation = 2 if committed else 1
    report = check_index(directory)  # before any writer tidies: strays of the uncommitted generation are no damage
    assert report.ok and report.generation == generation and not report.notes, (report.problems, report.notes)
    with IndexStore.open(directory, readonly=True) as reader, monkeypatch.context() as m:
        m.setattr(BM25, "add", lambda *a, **k: pytest.fail("a reader rebuilt BM25: the cache was missing"))
        assert reader.generation == generation
        assert reader.search_bm25(["word150"], 1).ids == [["d150" if committed else ""]]
    with IndexStore.open(directory) as store:
        assert store.generation == generation
        assert list(store.docstore.iter_ids()) == want
        assert sorted(store.vectors.ids()) == sorted(want) and len(store.vectors) == len(want)
        assert store.manifest.counts["documents"] == len(want)  # repaired if stale
        probe = 150 if committed else 5
        assert store.search(X[probe : probe + 1], 1).ids == [[f"d{probe}"]]
        assert store.search_bm25([f"word{probe}"], 1).ids == [[f"d{probe}"]]
        assert ("d0" in store.vectors) is not committed
        segments = {s.name for s in store.vectors.segments}
        assert len(segments) == (1 if not committed or policy == "merge" else 2)
    with IndexStore.open(directory, readonly=True, verify="full") as ro:  # checksums of what survived
        assert len(ro) == len(want)
    names = sorted(p.name for p in directory.iterdir())
    assert {n for n in names if n.endswith(".faiss")} == segments  # strays and merged-away files are gone
    assert [n for n in names if n.startswith("bm25-")] == [bm25_name(generation)]
    assert not [n for n in names if ".tmp-" in n]
