"""VectorIndex against brute-force numpy on clustered data."""

import os

import faiss
import numpy as np
import pytest

from twotower.indexing import IndexFormatError, SearchResult, VectorIndex

from .helpers import brute_force, clustered, recall_at_k

N, DIM, Q, K = 600, 24, 13, 7  # odd sizes so shape bugs surface


@pytest.fixture(scope="module")
def data():
    x = clustered(N + Q, DIM, seed=1)
    return x[:N], x[N:], [f"doc-{i:04d}" for i in range(N)]


@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
def test_flat_equals_brute_force(data, metric):
    x, q, ids = data
    idx = VectorIndex(DIM, "Flat", metric)
    assert idx.add(ids, x) == N
    res = idx.search(q, K)
    assert isinstance(res, SearchResult)
    assert res.scores.shape == (Q, K) and res.scores.dtype == np.float32
    want_ids, want_scores = brute_force(x, ids, q, K, metric)
    assert res.ids == want_ids
    np.testing.assert_allclose(res.scores, want_scores, rtol=1e-4, atol=1e-3)


def test_cosine_does_not_modify_caller_arrays(data):
    x, q, ids = data
    x_copy, q_copy = x.copy(), q.copy()
    idx = VectorIndex(DIM, "Flat", "cosine")
    idx.add(ids, x)
    idx.search(q, 3)
    np.testing.assert_array_equal(x, x_copy)
    np.testing.assert_array_equal(q, q_copy)


def test_single_query_vector_and_padding(data):
    x, q, ids = data
    idx = VectorIndex(DIM, "Flat", "ip")
    idx.add(ids[:3], x[:3])
    res = idx.search(q[0], k=5)  # (D,) is one query; only 3 docs exist
    assert len(res.ids) == 1 and res.ids[0][3:] == ["", ""]
    assert set(res.ids[0][:3]) == set(ids[:3])
    assert np.isneginf(res.scores[0, 3:]).all() and np.isfinite(res.scores[0, :3]).all()


def test_empty_index_returns_padding():
    res = VectorIndex(4, "HNSW32").search(np.ones((2, 4), np.float32), 3)
    assert res.ids == [["", "", ""], ["", "", ""]]
    assert np.isneginf(res.scores).all()


def test_string_ids_round_trip_with_unicode(tmp_path, data):
    x, _, _ = data
    ids = ["α/β", "doc with spaces", "中文", "a" * 300, "line\nbreak"]
    idx = VectorIndex(DIM, "Flat", "cosine")
    idx.add(ids, x[:5])
    for j, i in enumerate(ids):
        assert idx.search(x[j], 1).ids[0][0] == i
    idx.save(tmp_path / "v.faiss")
    back = VectorIndex.load(tmp_path / "v.faiss")
    assert back.ids() == ids
    assert [back.search(x[j], 1).ids[0][0] for j in range(5)] == ids


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat", "SQ8"])
def test_native_remove_matches_brute_force_over_the_rest(data, factory):
    x, q, ids = data
    idx = VectorIndex(DIM, factory, "l2", nprobe=8)  # nprobe=nlist: IVF search is exhaustive
    idx.add(ids, x)
    gone = ids[::3]
    assert idx.remove(gone + ["not-there"]) == ["not-there"]
    assert len(idx) == N - len(gone) and idx.tombstone_count == 0 and idx.stored_count == len(idx)
    keep = [j for j in range(N) if j % 3]
    res = idx.search(q, K)
    want, _ = brute_force(x[keep], [ids[j] for j in keep], q, K, "l2")
    assert not set(gone) & {i for row in res.ids for i in row}
    if factory == "SQ8":  # lossy codes: near-exact
        assert recall_at_k(res.ids, want) >= 0.9
    else:
        assert res.ids == want


def test_hnsw_recall_against_flat(data):
    x, q, ids = data
    idx = VectorIndex(DIM, "HNSW32", "cosine", ef_search=64)
    idx.add(ids, x)
    want, _ = brute_force(x, ids, q, 10, "cosine")
    assert recall_at_k(idx.search(q, 10).ids, want) >= 0.95


def test_hnsw_tombstones_are_filtered_and_results_stay_full(data):
    x, q, ids = data
    idx = VectorIndex(DIM, "HNSW32", "cosine", auto_rebuild_fraction=None)
    idx.add(ids, x)
    # remove every doc of the queries' own neighbourhoods: the graph still returns them first
    truth, _ = brute_force(x, ids, q, 20, "cosine")
    gone = sorted({i for row in truth for i in row})
    assert idx.remove(gone) == []
    assert idx.tombstone_count == len(gone) and idx.stored_count == N and len(idx) == N - len(gone)
    res = idx.search(q, K)
    found = {i for row in res.ids for i in row}
    assert not found & set(gone)
    assert all("" not in row for row in res.ids)  # over-fetching refilled every row
    keep = [j for j in range(N) if ids[j] not in set(gone)]
    want, _ = brute_force(x[keep], [ids[j] for j in keep], q, K, "cosine")
    assert recall_at_k(res.ids, want) >= 0.9


def test_hnsw_rebuild_drops_tombstones_and_keeps_results(data):
    x, q, ids = data
    idx = VectorIndex(DIM, "HNSW32", "l2", auto_rebuild_fraction=None, ef_search=256)
    idx.add(ids, x)
    idx.remove(ids[: N // 2])
    before = idx.search(q, K)
    idx.rebuild()
    assert idx.tombstone_count == 0 and idx.stored_count == N - N // 2 == len(idx)
    after = idx.search(q, K)
    want, _ = brute_force(x[N // 2 :], ids[N // 2 :], q, K, "l2")
    assert recall_at_k(after.ids, want) >= 0.95 and recall_at_k(before.ids, want) >= 0.95
    # the rebuilt index can still grow and find new vectors
    idx.add(["new"], x[:1])
    assert idx.search(x[0], 1).ids == [["new"]]


def test_hnsw_auto_rebuild_when_fraction_exceeded(data):
    x, _, ids = data
    idx = VectorIndex(DIM, "HNSW32", "cosine", auto_rebuild_fraction=0.25)
    idx.add(ids, x)
    idx.remove(ids[:100])  # 100/600 < 0.25: stays tombstoned
    assert idx.tombstone_count == 100
    idx.remove(ids[100:200])  # 200/600 > 0.25: compacts
    assert idx.tombstone_count == 0 and idx.stored_count == N - 200


def test_duplicate_policies(data):
    x, _, ids = data
    idx = VectorIndex(DIM, "Flat", "ip")
    idx.add(ids[:5], x[:5])
    with pytest.raises(ValueError, match=r"already in the index.*doc-0002"):
        idx.add(["doc-0002", "fresh"], x[5:7])
    assert "fresh" not in idx and len(idx) == 5  # refused batch changed nothing
    assert idx.add(["doc-0002", "fresh"], x[5:7], on_duplicate="skip") == 1
    np.testing.assert_allclose(idx.reconstruct(["doc-0002"]), x[2:3])
    assert idx.add(["doc-0002"], x[9:10], on_duplicate="replace") == 1
    np.testing.assert_allclose(idx.reconstruct(["doc-0002"]), x[9:10])
    assert len(idx) == 6
    with pytest.raises(ValueError, match="repeated id"):
        idx.add(["z", "z"], x[:2])
    with pytest.raises(ValueError, match="on_duplicate"):
        idx.add(["y"], x[:1], on_duplicate="ignore")
    with pytest.raises(ValueError, match="non-empty strings"):
        idx.add([""], x[:1])


def test_dimension_mismatch_names_both_dims(data):
    x, q, ids = data
    idx = VectorIndex(DIM, "Flat")
    with pytest.raises(
        ValueError, match=rf"dimension {DIM + 1} but this index holds vectors of dimension {DIM}"
    ):
        idx.add(["a"], np.ones((1, DIM + 1), np.float32))
    idx.add(ids[:2], x[:2])
    with pytest.raises(ValueError, match=rf"queries have dimension 5 .* dimension {DIM}"):
        idx.search(np.ones((1, 5), np.float32), 1)
    with pytest.raises(ValueError, match="got 2 ids but 1 vectors"):
        idx.add(["p", "q"], x[:1])
    with pytest.raises(ValueError, match="NaN"):
        idx.add(["nan"], np.full((1, DIM), np.nan, np.float32))
    with pytest.raises(ValueError, match="k must be"):
        idx.search(q, 0)


def test_ivf_training_is_seeded_and_sampled(data):
    x, q, ids = data

    def trained(seed):
        idx = VectorIndex(DIM, "IVF8,Flat", "l2", train_sample=400, seed=seed, nprobe=2)
        assert not idx.is_trained and idx.min_train_size == 8 and idx.train_sample_size(N) == 400
        idx.train(x)
        centroids = faiss.extract_index_ivf(idx._index).quantizer.reconstruct_n(0, 8)  # (8, D)
        return idx, centroids

    a, ca = trained(3)
    b, cb = trained(3)
    _, cc = trained(4)
    np.testing.assert_array_equal(ca, cb)  # same seed -> same sample -> same k-means
    assert not np.array_equal(ca, cc)  # the sample really depends on the seed
    a.add(ids, x)
    b.add(ids, x)
    ra, rb = a.search(q, K), b.search(q, K)
    assert ra.ids == rb.ids
    np.testing.assert_array_equal(ra.scores, rb.scores)


def test_ivf_untrained_add_with_too_few_vectors_is_an_error(data):
    x, _, ids = data
    idx = VectorIndex(DIM, "IVF64,Flat")
    with pytest.raises(ValueError, match="needs at least 64 training vectors, got 10"):
        idx.add(ids[:10], x[:10])
    assert len(idx) == 0
    with pytest.warns(UserWarning, match="poorly estimated"):
        idx.add(ids, x)  # 600 < 39*64: trains, warns
    assert idx.is_trained and len(idx) == N
    assert VectorIndex(DIM, "IVF8,PQ4").min_train_size == 256  # PQ codebooks need 2^8


def test_ivf_pq_build_matches_raw_faiss(data):
    _, q, _ = data
    big = clustered(3000, DIM, seed=7)
    names = [f"b{i}" for i in range(3000)]
    idx = VectorIndex.build(names, big, factory="IVF16,PQ8x4", metric="l2", nprobe=4, train_sample=3000)
    assert idx.is_trained and len(idx) == 3000
    raw = faiss.index_factory(DIM, "IVF16,PQ8x4", faiss.METRIC_L2)  # the reference: same data, same order
    raw.train(big)
    raw.add(big)
    dist, lab = raw.search(q, 10, params=faiss.SearchParametersIVF(nprobe=4))
    res = idx.search(q, 10)
    assert res.ids == [[names[j] for j in row] for row in lab]
    np.testing.assert_allclose(res.scores, -dist, rtol=1e-6)
    want, _ = brute_force(big, names, q, 10, "l2")
    assert recall_at_k(res.ids, want) > 0.3  # coarse 4-bit codes, but far above chance (10/3000)


@pytest.mark.parametrize("factory", ["Flat", "HNSW32", "IVF8,Flat", "IVF8,SQ8"])
@pytest.mark.parametrize("mmap", [True, False])
def test_save_load_round_trip(tmp_path, data, factory, mmap):
    x, q, ids = data
    idx = VectorIndex(DIM, factory, "cosine", auto_rebuild_fraction=None, ef_search=77, nprobe=3)
    idx.add(ids, x)
    idx.remove(ids[10:20])
    path = tmp_path / "v.faiss"
    idx.save(path)
    back = VectorIndex.load(path, mmap=mmap)
    assert back.is_mmapped == mmap
    assert (back.dim, back.metric, back.factory, back.ef_search, back.nprobe) == (
        DIM,
        "cosine",
        factory,
        77,
        3,
    )
    assert back.ids() == idx.ids() and back.tombstone_count == idx.tombstone_count
    r1, r2 = idx.search(q, K), back.search(q, K)
    assert r1.ids == r2.ids
    np.testing.assert_array_equal(r1.scores, r2.scores)
    # a loaded (even memory-mapped) index can still change: it is copied into RAM first
    back.add(["late"], x[:1])
    back.remove(["doc-0500"])
    assert not back.is_mmapped and "late" in back and "doc-0500" not in back
    assert [p.name for p in tmp_path.iterdir()] == ["v.faiss"]  # no temp files left


def test_saved_file_is_a_plain_faiss_index(tmp_path, data):
    x, _, ids = data
    idx = VectorIndex(DIM, "HNSW32", "cosine")
    idx.add(ids, x)
    idx.save(tmp_path / "v.faiss")
    raw = faiss.read_index(str(tmp_path / "v.faiss"))  # trailer is ignored by FAISS
    assert raw.ntotal == N and raw.d == DIM


def test_load_errors_name_the_file(tmp_path):
    bogus = tmp_path / "bogus.faiss"
    bogus.write_bytes(b"x" * 100)
    with pytest.raises(IndexFormatError, match="bogus.faiss.*trailer magic"):
        VectorIndex.load(bogus)
    with pytest.raises(FileNotFoundError, match="nope.faiss"):
        VectorIndex.load(tmp_path / "nope.faiss")
    idx = VectorIndex(4, "Flat")
    idx.add(["a"], np.ones((1, 4), np.float32))
    good = tmp_path / "good.faiss"
    idx.save(good)
    raw = good.read_bytes()
    future = raw.replace(b'"format_version": 1', b'"format_version": 9')
    (tmp_path / "future.faiss").write_bytes(future)
    with pytest.raises(IndexFormatError, match="future.faiss.*format_version 9"):
        VectorIndex.load(tmp_path / "future.faiss")
    (tmp_path / "torn.faiss").write_bytes(raw[:40] + raw[-400:])  # FAISS part cut short
    with pytest.raises(IndexFormatError, match="torn.faiss"):
        VectorIndex.load(tmp_path / "torn.faiss")


def test_l2_scores_are_negated_squared_distances():
    idx = VectorIndex(2, "Flat", "l2")
    idx.add(["o", "far"], np.array([[0, 0], [3, 4]], np.float32))
    res = idx.search(np.array([[0, 0]], np.float32), 2)
    assert res.ids == [["o", "far"]]
    np.testing.assert_array_equal(res.scores, [[0.0, -25.0]])


def test_use_gpu_true_without_gpu_is_an_error():
    if faiss.get_num_gpus() > 0:
        pytest.skip("a GPU is visible")
    with pytest.raises(ValueError, match="use_gpu=True"):
        VectorIndex(4, "Flat", use_gpu=True)


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat"])
def test_a_search_deeper_than_a_gpu_selects_runs_on_the_cpu_index(monkeypatch, factory):
    """FAISS on a GPU refuses k (and nprobe) above 2048, and skipping tombstones deepens the fetch: such a search
    raised on the GPU copy. A stand-in GPU copy records the depths it is asked for (no GPU here)."""
    GPU_MAX_K = 2048  # faiss/gpu/utils/DeviceDefs.cuh

    rng = np.random.default_rng(0)
    x = rng.standard_normal((GPU_MAX_K + 600, 8)).astype(np.float32)
    idx = VectorIndex(8, factory, "ip")
    idx.add([f"d{i}" for i in range(len(x))], x)
    cpu = idx._index
    asked: list[int] = []

    class GpuCopy:
        def search(self, q, k, params=None):
            asked.append(k)
            assert k <= GPU_MAX_K and (params is None or params.nprobe <= GPU_MAX_K), "the GPU would refuse"
            return cpu.search(q, k, params=params)

    monkeypatch.setattr(VectorIndex, "_gpu_possible", lambda self: True)
    idx._gpu_index = GpuCopy()
    q = x[:2]
    shallow = idx.search(q, 10)
    deep = idx.search(q, GPU_MAX_K + 100)
    assert asked and max(asked) <= GPU_MAX_K  # the shallow search ran on the stand-in GPU copy, the deep one not
    assert deep.ids[0][:10] == shallow.ids[0] and len(deep.ids[0]) == GPU_MAX_K + 100


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
@pytest.mark.parametrize("factory", ["Flat", "HNSW32", "IVF8,Flat"])
def test_mmap_load_really_maps_the_file(tmp_path, data, factory):
    x, _, ids = data
    idx = VectorIndex(DIM, factory, "cosine")
    idx.add(ids, x)
    path = tmp_path / f"{factory.replace(',', '_')}.faiss"
    idx.save(path)

    def mapped():
        return any(str(path) in line for line in open("/proc/self/maps"))

    plain = VectorIndex.load(path, mmap=False)
    assert not mapped()
    mm = VectorIndex.load(path, mmap=True)
    assert mapped()
    assert mm.search(x[:3], 3).ids == plain.search(x[:3], 3).ids
