"""One IndexStore shared by threads (issue 19, item 3): real threads search and fetch documents.

While they do, a real writer process commits (adds and deletes) and one more thread moves the
shared store to the newest commit with ``refresh()``. Every search must return hits whose
documents exist in the same commit as the vectors (no ``None`` text), and nothing may raise.
"""

from __future__ import annotations

import threading

import numpy as np

from twotower.indexing import IndexStore

from .procs import run_threads, run_with_refresher, start_writer, stop_writer

DIM = 8


def test_threads_share_one_store_while_it_refreshes(tmp_path):
    d = tmp_path / "idx"
    with IndexStore.create(d, DIM, "Flat", "cosine") as store:
        store.add([{"id": f"s{i}", "text": f"seed {i}"} for i in range(200)],
                  np.random.default_rng(0).normal(size=(200, DIM)).astype("float32"))
    proc, stop = start_writer(tmp_path, d, DIM)
    shared = IndexStore.open(d, readonly=True)
    errors: list[str] = []
    missing_text, searches = [0], [0]
    done = threading.Event()
    lock = threading.Lock()

    def search_loop(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not done.is_set():
            try:
                with shared.snapshot() as snap:
                    res = snap.search(rng.normal(size=(2, DIM)).astype("float32"), 10)
                    got = snap.get([i for row in res.ids for i in row])
                with lock:
                    searches[0] += 1
                    missing_text[0] += sum(g is None for g in got)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
                return

    refreshes = run_with_refresher(shared, [lambda s=s: search_loop(s) for s in range(4)], done, errors)
    commits, _ = stop_writer(proc, stop)
    shared.close()
    assert errors == [], errors[:3]
    assert missing_text[0] == 0
    assert searches[0] > 50 and refreshes > 10 and commits > 10, (searches, refreshes, commits)


def test_plain_store_methods_work_from_other_threads(tmp_path):
    """The simple API (store.search / store.get without snapshot) is usable from any thread, reader or writer."""
    d = tmp_path / "idx"
    x = np.random.default_rng(0).normal(size=(50, DIM)).astype("float32")
    with IndexStore.create(d, DIM, "Flat", "cosine") as store:
        store.add([{"id": f"s{i}", "text": f"seed {i}"} for i in range(50)], x)
    for readonly in (True, False):
        store = IndexStore.open(d, readonly=readonly)
        results: list = []

        def work(i: int, store: IndexStore = store, results: list = results) -> None:
            try:
                res = store.search(x[i:i + 1], 1)
                results.append((res.ids[0][0], store.get(res.ids[0])[0]["text"], store.contains_many([f"s{i}"])))
            except Exception as e:  # noqa: BLE001
                results.append(repr(e))

        run_threads([lambda i=i: work(i) for i in range(8)])
        store.close()
        assert sorted(results) == sorted((f"s{i}", f"seed {i}", [True]) for i in range(8))
