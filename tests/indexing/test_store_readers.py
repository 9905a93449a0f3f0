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
import time

import faiss
import numpy as np
import pytest

from twotower.indexing import IndexStore

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
