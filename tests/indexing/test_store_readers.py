"""Readers never fail while a writer commits (issue 19, item 2).

A real writer process commits 20 documents at a time (and deletes some) while this process
opens read-only stores and refreshes them. To make the old race certain rather than rare,
``faiss.read_index`` is slowed down on every 4th call: a reader then reads the generation,
waits, and only then opens the vector file — by which time the writer has committed several
generations and removed files the reader's generation named. A reader must still end up
with one whole commit (old or new), never an error. With ``retain=0`` the writer deletes
merged-away files at once, so readers must take the retry path (and the test checks they
did); with the default the writer keeps them a while and readers rarely need to.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import faiss
import numpy as np
import pytest

import twotower.indexing.store as store_module
from twotower.indexing import IndexStore
from twotower.indexing.bm25 import BM25
from twotower.indexing.store import bm25_name

from .procs import start_writer, stop_writer

DIM = 8


@pytest.fixture
def slow_faiss_open(monkeypatch):
    real = faiss.read_index
    calls = {"n": 0}

    def slow(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % 4 == 1:
            time.sleep(0.15)
        return real(*args, **kwargs)

    monkeypatch.setattr(faiss, "read_index", slow)
    return calls


def _consistent(store: IndexStore) -> None:
    """One commit's documents and vectors: same ids, and a searched hit has its text."""
    assert store.docstore.count() == len(store.vectors)
    res = store.search(np.ones((1, DIM), dtype="float32"), 3)
    docs = store.get(res.ids[0])
    assert all(d is not None and d["text"] for d in docs), (res.ids, docs)


@pytest.mark.parametrize("retain", [0.0, None])
def test_readers_see_a_whole_commit_while_a_writer_commits(tmp_path, slow_faiss_open, caplog, retain):
    caplog.set_level(logging.INFO, logger="twotower.indexing.store")
    d = tmp_path / "idx"
    with IndexStore.create(d, DIM, "Flat", "cosine") as store:
        store.add([{"id": f"s{i}", "text": f"seed {i}"} for i in range(100)],
                  np.random.default_rng(0).normal(size=(100, DIM)).astype("float32"))
    proc, stop = start_writer(tmp_path, d, DIM, pause=0.03, retain=retain)
    errors, opens, refreshes, generations = [], 0, 0, set()
    try:
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline:
            try:
                with IndexStore.open(d, readonly=True) as ro:
                    opens += 1
                    _consistent(ro)
                    generations.add(ro.generation)
                    for _ in range(3):
                        ro.refresh()
                        refreshes += 1
                        _consistent(ro)
                        generations.add(ro.generation)
            except Exception as e:  # noqa: BLE001 - counted, then reported
                errors.append(repr(e))
    finally:
        commits, _ = stop_writer(proc, stop)
    assert errors == [], f"{len(errors)} of {opens} opens / {refreshes} refreshes failed: {errors[:3]}"
    assert commits > 20 and len(generations) >= 3, (commits, generations)
    retries = [r for r in caplog.records if "removed by a newer commit" in r.getMessage()]
    if retain == 0.0:
        assert retries, "the race was not exercised: no reader found a file removed under it"


# ---- the BM25 cache while a writer commits ----------------------------------------------------------
def _bm25_store(d: Path, n: int = 40) -> None:
    with IndexStore.create(d, DIM, "Flat", "cosine", bm25=True) as store:
        store.add([{"id": f"s{i}", "text": f"seed word{i}"} for i in range(n)],
                  np.random.default_rng(0).normal(size=(n, DIM)).astype("float32"))


def _no_rebuild(monkeypatch) -> None:
    """From now on, building BM25 from documents fails the test (a reader must load its generation's cache)."""
    monkeypatch.setattr(BM25, "add", lambda *a, **k: pytest.fail("a reader rebuilt BM25 from every document"))


def test_a_reader_refreshing_right_after_the_commit_point_loads_the_new_bm25_cache(tmp_path, monkeypatch):
    """The service's owner thread refreshes before every batch. A refresh that landed between the SQLite commit and
    the cache's save found generation N+1 without its cache and rebuilt BM25 from every document on that thread
    (5.3 s for 50,000 documents, seconds to minutes on a large index). The writer stops here at the commit point."""
    d = tmp_path / "idx"
    _bm25_store(d)
    reader, writer = IndexStore.open(d, readonly=True), IndexStore.open(d)
    writer.add([{"id": "new", "text": "zebra finch song"}], np.ones((1, DIM), dtype="float32"))
    paused, go = threading.Event(), threading.Event()

    def hook(stage: str) -> None:
        if stage == "sqlite_committed":
            paused.set()
            assert go.wait(30)

    monkeypatch.setattr(store_module, "CRASH_HOOK", hook)
    committing = threading.Thread(target=writer.commit)
    committing.start()
    try:
        assert paused.wait(30)
        _no_rebuild(monkeypatch)
        assert reader.refresh() and reader.generation == 2
        assert (d / bm25_name(2)).exists()
        assert reader.search_bm25(["zebra"], 1).ids == [["new"]]
    finally:
        go.set()
        committing.join()
        writer.close()
        reader.close()


def test_a_reader_of_the_previous_generation_still_loads_its_bm25_cache(tmp_path, monkeypatch):
    """A reader pinned at generation N that had not loaded BM25 when the writer committed N+1 found N's cache swept
    at once and rebuilt it from every document; it is kept for RETAIN_SECONDS, like merged-away segments."""
    d = tmp_path / "idx"
    _bm25_store(d)
    with IndexStore.open(d, readonly=True) as reader, IndexStore.open(d) as writer:
        writer.add([{"id": "new", "text": "zebra finch song"}], np.ones((1, DIM), dtype="float32"))
        writer.commit()
        _no_rebuild(monkeypatch)
        assert reader.generation == 1 and reader.search_bm25(["word3"], 1).ids == [["s3"]]


def test_a_busy_writer_keeps_only_the_previous_bm25_cache(tmp_path):
    """A cache is the size of the index's text: commits in quick succession keep one superseded cache, not all."""
    d = tmp_path / "idx"
    _bm25_store(d)
    with IndexStore.open(d) as writer:
        for i in range(3):
            writer.add([{"id": f"new{i}", "text": "zebra"}], np.ones((1, DIM), dtype="float32"))
            writer.commit()
        assert sorted(p.name for p in d.glob("bm25-*")) == [bm25_name(3), bm25_name(4)]
    assert [p.name for p in d.glob("bm25-*")] == [bm25_name(4)]


@pytest.mark.parametrize("vanishes", ["before the load", "while the load opens it"])
def test_a_bm25_cache_swept_while_a_reader_loads_it_is_rebuilt_not_an_error(tmp_path, monkeypatch, vanishes):
    """A newer commit's sweep can remove generation N's cache between a reader's check that it exists and its load
    (FileNotFoundError), or inside the load (it became "not a readable BM25 file"): the search failed (a 500
    from the service). The reader's snapshot still holds N's documents: it rebuilds BM25 from them."""
    d = tmp_path / "idx"
    _bm25_store(d)
    cache = d / bm25_name(1)
    if vanishes == "before the load":
        real_load = BM25.load.__func__

        def load(cls, path):
            if Path(path) == cache:
                cache.unlink(missing_ok=True)
            return real_load(cls, path)

        monkeypatch.setattr(BM25, "load", classmethod(load))
    else:
        real_np_load = np.load

        def np_load(path, *args, **kwargs):
            if isinstance(path, str | Path) and Path(path) == cache:
                cache.unlink(missing_ok=True)
            return real_np_load(path, *args, **kwargs)

        monkeypatch.setattr(np, "load", np_load)
    with IndexStore.open(d, readonly=True) as reader:
        assert reader.search_bm25(["word3"], 1).ids == [["s3"]]
    assert not cache.exists()
