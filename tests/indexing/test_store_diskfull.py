"""A full disk during add/delete gives a clear error and leaves the last commit intact (issue 19, item 5).

The index lives on a real 4 MiB tmpfs (mounted for the test; skipped where mounting is not
permitted), which a filler file then fills to the last byte, so FAISS, SQLite and Python all
meet a real ``ENOSPC``.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import uuid
from pathlib import Path

import numpy as np
import pytest

from twotower.indexing import IndexDiskFullError, IndexStore

DIM = 64
X = np.random.default_rng(0).normal(size=(900, DIM)).astype("float32")


def docs(lo, hi):
    return [{"id": f"d{i}", "text": f"text {i}"} for i in range(lo, hi)]


@pytest.fixture
def tiny_fs(tmp_path):
    mnt = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(mnt: Path) -> Path:
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 4096, 512, 1):  # to the last byte
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


@pytest.mark.parametrize("factory", ["Flat", "HNSW32"])
@pytest.mark.parametrize("change", ["add", "delete", "add_replace"])
def test_full_disk_during_commit(tiny_fs, factory, change):
    d = tiny_fs / "idx"
    with IndexStore.create(d, DIM, factory, "cosine") as store:
        store.add(docs(0, 300), X[:300])
    store = IndexStore.open(d)
    filler = _fill(tiny_fs)
    with pytest.raises(IndexDiskFullError) as info:
        if change == "add":
            store.add(docs(300, 900), X[300:900])
        elif change == "add_replace":
            store.add(docs(0, 600), X[300:900], on_duplicate="replace")
        else:
            store.delete([f"d{i}" for i in range(0, 300, 2)])
        store.commit()
    msg = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert "no space left" in msg.lower() and str(d) in msg and "unchanged" in msg, msg
    store.close()
    os.unlink(filler)
    with IndexStore.open(d, readonly=True) as ro:  # the last commit, whole
        assert ro.generation == 1 and len(ro) == 300 and ro.docstore.count() == 300
        assert ro.search(X[7:8], 1).ids == [["d7"]]
    with IndexStore.open(d) as again:  # and writable again once there is room
        again.add(docs(300, 320), X[300:320])
    with IndexStore.open(d, readonly=True) as ro:
        assert len(ro) == 320


def test_sqlite_disk_full_at_the_commit_point_is_a_clear_error(tmp_path, monkeypatch):
    d = tmp_path / "idx"
    with IndexStore.create(d, DIM, "Flat", "cosine") as store:
        store.add(docs(0, 10), X[:10])
    store = IndexStore.open(d)
    store.add(docs(10, 20), X[10:20])

    def full() -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(store.docstore, "commit", full)
    with pytest.raises(IndexDiskFullError, match="unchanged"):
        store.commit()
    monkeypatch.undo()
    store.close()
    with IndexStore.open(d, readonly=True) as ro:
        assert len(ro) == 10 and ro.generation == 1


def test_no_room_for_the_bm25_cache_leaves_the_commit_standing(tmp_path, monkeypatch, caplog):
    """The cache is written before the commit point now; a full disk there still only costs the cache (a derived
    file: each process rebuilds it), with one warning, as when it was saved after the commit."""
    from twotower.indexing.bm25 import BM25

    d = tmp_path / "idx"
    with IndexStore.create(d, DIM, "Flat", "cosine", bm25=True) as store:
        store.add(docs(0, 10), X[:10])
    store = IndexStore.open(d)
    store.add(docs(10, 20), X[10:20])

    def full(self, path) -> None:
        Path(path).write_bytes(b"half")  # as if interrupted mid-file: it must not stay behind
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(BM25, "save", full)
    assert store.commit() == 2
    monkeypatch.undo()
    store.close()
    assert [r.getMessage() for r in caplog.records if "BM25 cache" in r.getMessage()] == [
        f"{d}: no space left for the BM25 cache; it is rebuilt when needed"]
    assert not list(d.glob("bm25-*")) and not list(d.glob("*.tmp-*"))
    with IndexStore.open(d, readonly=True) as ro:
        assert ro.generation == 2 and len(ro) == 20 and ro.search_bm25(["text 15"], 1).ids == [["d15"]]
