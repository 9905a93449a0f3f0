"""Append-only vector segments (issue 19, item 8): commits write what they change, search equals a fresh build.

References: ``VectorIndex.build`` over the same live vectors (a fresh build) and a numpy
brute force; bytes written are read from ``/proc/self/io`` (every byte handed to ``write``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from twotower.indexing import IndexStore, MergePolicy, VectorIndex

from .helpers import brute_force, clustered, recall_at_k

DIM = 16


def docs(ids):
    return [{"id": i, "text": f"text of {i}"} for i in ids]


def wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_a_small_commit_writes_a_small_amount(tmp_path):
    n, dim = 20000, 64
    x = np.random.default_rng(0).normal(size=(n + 10, dim)).astype("float32")
    d = tmp_path / "idx"
    with IndexStore.create(d, dim, "Flat") as store:
        store.add(docs([f"d{i}" for i in range(n)]), x[:n])
    (big,) = d.glob("seg-*.faiss")
    before = (big.stat().st_ino, big.stat().st_mtime_ns, big.stat().st_size)
    assert before[2] > n * dim * 4  # 5 MB of vectors
    store = IndexStore.open(d)
    w0 = wchar()
    store.add(docs([f"n{i}" for i in range(10)]), x[n:])
    store.delete(["d3", "d4"])
    store.commit()
    written = wchar() - w0
    store.close()
    assert written < 200_000, f"a 10-document commit wrote {written:,} bytes to a {before[2]:,}-byte index"
    assert (big.stat().st_ino, big.stat().st_mtime_ns, big.stat().st_size) == before  # untouched
    with IndexStore.open(d, readonly=True) as ro:
        assert len(ro) == n + 8 and ro.search(x[n + 5:n + 6], 1).ids == [["n5"]]
        assert "d3" not in ro.vectors and ro.get(["d3"]) == [None]


@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_flat_search_over_segments_equals_a_fresh_build(tmp_path, metric, seed):
    """Random adds, deletes and replacements over many commits and merges; then the same as one index."""
    rng = np.random.default_rng(seed)
    pool = clustered(3000, DIM, seed=seed)
    policy = MergePolicy(factor=3, min_segment=20, max_deleted=0.3)
    store = IndexStore.create(tmp_path / "idx", DIM, "Flat", metric, merge_policy=policy)
    live: dict[str, np.ndarray] = {}  # id -> vector, in insertion order (a replaced id moves to the end)
    nxt = 0
    for _commit in range(40):
        batch = int(rng.integers(1, 60))
        ids = [f"d{nxt + j}" for j in range(batch)]
        nxt += batch
        vecs = pool[nxt - batch:nxt]  # distinct vectors: no exact ties to order arbitrarily
        store.add(docs(ids), vecs)
        live.update(zip(ids, vecs))
        if live and rng.random() < 0.7:
            gone = [str(i) for i in rng.choice(list(live), size=min(len(live), int(rng.integers(1, 25))), replace=False)]
            store.delete(gone)
            for g in gone:
                del live[g]
        if live and rng.random() < 0.3:
            again = [str(i) for i in rng.choice(list(live), size=min(len(live), 5), replace=False)]
            new = pool[len(pool) - 1 - nxt - np.arange(len(again))]  # unused rows, from the end of the pool
            nxt += len(again)
            store.add(docs(again), new, on_duplicate="replace")
            for i in again:
                del live[i]
            live.update(zip(again, new))
        store.commit()
    assert len(store.vectors.segments) > 1  # the test is about more than one segment
    queries = pool[rng.integers(0, len(pool), 25)] + 0.01 * rng.normal(size=(25, DIM)).astype("float32")
    ids = list(live)
    fresh = VectorIndex.build(ids, np.stack([live[i] for i in ids]), factory="Flat", metric=metric)
    want = fresh.search(queries, 10)
    ref_ids, ref_scores = brute_force(np.stack([live[i] for i in ids]), ids, queries, 10, metric)
    for view in (store, IndexStore.open(tmp_path / "idx", readonly=True)):
        got = view.search(queries, 10)
        np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.scores, ref_scores, rtol=1e-4, atol=1e-4)
        assert got.ids == want.ids  # clustered float data: no exact ties
        assert sorted(view.vectors.ids()) == sorted(ids) and view.docstore.count() == len(ids)
    assert store.vectors.ids() == ids  # insertion order survives merges
    store.close()


def test_merge_policy_keeps_segments_few_and_rewrites_logarithmically(tmp_path):
    policy = MergePolicy(factor=4, min_segment=10)
    x = np.random.default_rng(0).normal(size=(2000, DIM)).astype("float32")
    written = 0
    with IndexStore.create(tmp_path / "idx", DIM, "Flat", merge_policy=policy) as store:
        seen = set()
        for c in range(400):  # 400 commits of 5 vectors
            ids = [f"d{5 * c + j}" for j in range(5)]
            store.add(docs(ids), x[5 * c:5 * c + 5])
            store.commit()
            for s in store.vectors.segments:
                if s.name not in seen:
                    seen.add(s.name)
                    written += s.stored
            levels = {policy.level(len(s.index)) for s in store.vectors.segments}
            assert len(store.vectors.segments) <= (policy.factor - 1) * len(levels) + 1
        assert store.vectors.stored_count == 2000
    # each vector is written once new, then once per level it climbs: log4(2000/10) < 4 levels
    assert written <= 2000 * (1 + 4), written


def test_plan_examples():
    p = MergePolicy(factor=10, min_segment=1000, max_deleted=0.3)
    assert p.plan([(200_000, 200_000)] + [(100, 100)] * 9) == []
    assert p.plan([(200_000, 200_000)] + [(100, 100)] * 10) == [list(range(1, 11))]
    assert p.plan([(130_000, 200_000), (100, 100)]) == [[0]]  # 30 % deleted: compact it alone
    assert p.plan([(0, 50), (100, 100)]) == [[0]]  # nothing live: dropped
    assert p.plan([(9000, 9000)] * 9 + [(100, 100)] * 10) == [list(range(10))]  # level 0 is < 10,000
    cascade = p.plan([(10_000, 10_000)] * 9 + [(1000, 1000)] * 10)  # ten of level 0 make a 10th of level 1
    assert cascade == [list(range(19))]


def test_heavily_deleted_segment_is_compacted(tmp_path):
    x = np.random.default_rng(1).normal(size=(300, DIM)).astype("float32")
    with IndexStore.create(tmp_path / "idx", DIM, "HNSW32", merge_policy=MergePolicy(max_deleted=0.3)) as store:
        store.add(docs([f"d{i}" for i in range(300)]), x)
    with IndexStore.open(tmp_path / "idx") as store:
        store.delete([f"d{i}" for i in range(50)])
        store.commit()
        assert store.vectors.tombstone_count == 50  # 1/6 deleted: tombstones only
        store.delete([f"d{i}" for i in range(50, 100)])
        store.commit()
        assert store.vectors.tombstone_count == 0 and store.vectors.stored_count == 200  # compacted
        assert store.search(x[150:151], 1).ids == [["d150"]]


def test_ivf_segments_share_the_training(tmp_path):
    x = clustered(3000, DIM, seed=3)
    store = IndexStore.create(tmp_path / "idx", DIM, "IVF16,Flat", nprobe=16)  # all lists: exact
    store.train(x[:2000])
    store.add(docs([f"d{i}" for i in range(2000)]), x[:2000])
    store.commit()
    store.close()
    with IndexStore.open(tmp_path / "idx") as store:  # a new segment, trained like the first
        assert store.vectors.is_trained
        store.add(docs([f"d{i}" for i in range(2000, 3000)]), x[2000:])
    with IndexStore.open(tmp_path / "idx", readonly=True) as ro:
        assert len(ro.vectors.segments) == 2
        q = x[::97]
        want, _ = brute_force(x, [f"d{i}" for i in range(3000)], q, 10, "cosine")
        assert recall_at_k(ro.search(q, 10).ids, want) > 0.99


def test_hnsw_segments_recall(tmp_path):
    x = clustered(4000, DIM, seed=4)
    with IndexStore.create(tmp_path / "idx", DIM, "HNSW32") as store:
        store.add(docs([f"d{i}" for i in range(3000)]), x[:3000])
    for c in range(5):  # five more segments
        with IndexStore.open(tmp_path / "idx") as store:
            lo = 3000 + 200 * c
            store.add(docs([f"d{i}" for i in range(lo, lo + 200)]), x[lo:lo + 200])
    with IndexStore.open(tmp_path / "idx", readonly=True) as ro:
        assert len(ro.vectors.segments) == 6
        q = x[::53] + 0.05
        want, _ = brute_force(x, [f"d{i}" for i in range(4000)], q, 10, "cosine")
        assert recall_at_k(ro.search(q, 10).ids, want) > 0.95


def test_refresh_reuses_unchanged_segments(tmp_path):
    x = np.random.default_rng(2).normal(size=(120, DIM)).astype("float32")
    with IndexStore.create(tmp_path / "idx", DIM, "Flat") as store:
        store.add(docs([f"d{i}" for i in range(100)]), x[:100])
    reader = IndexStore.open(tmp_path / "idx", readonly=True)
    (first,) = reader.vectors.segments
    with IndexStore.open(tmp_path / "idx") as store:
        store.add(docs([f"d{i}" for i in range(100, 120)]), x[100:])
        store.delete(["d1"])
    assert reader.refresh() is True
    old, new = reader.vectors.segments
    assert old.base is first.base  # not read again: only the new segment was opened
    assert "d1" not in reader.vectors and "d1" in first.index  # the old snapshot keeps its view
    assert reader.search(x[110:111], 1).ids == [["d110"]]
    reader.close()
