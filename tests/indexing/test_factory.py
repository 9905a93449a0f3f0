import re

import faiss
import numpy as np
import pytest

from twotower.indexing import FactoryError, VectorIndex, auto_factory, check_factory, index_kind
from twotower.indexing.factory import FLAT_MAX, HNSW_MAX, default_nprobe, ivf_nlist


def test_auto_factory_rule_boundaries():
    assert auto_factory(0, 384) == "Flat"
    assert auto_factory(FLAT_MAX, 384) == "Flat"
    assert auto_factory(FLAT_MAX + 1, 384) == "HNSW32"
    assert auto_factory(200_000, 384) == "HNSW32"
    assert auto_factory(HNSW_MAX, 384) == "HNSW32"
    big = auto_factory(HNSW_MAX + 1, 384)
    assert big == f"IVF{ivf_nlist(HNSW_MAX + 1)},SQ8"
    # 4*sqrt(5M) ~ 8944 -> nearest power of two 8192
    assert ivf_nlist(HNSW_MAX + 1) == 8192


def test_auto_factory_rejects_bad_input():
    with pytest.raises(ValueError, match="corpus size"):
        auto_factory(-1, 8)
    with pytest.raises(ValueError, match="dimension"):
        auto_factory(10, 0)


def test_ivf_nlist_and_nprobe_are_clamped():
    assert ivf_nlist(1) == 16
    assert ivf_nlist(10**12) == 65536
    assert default_nprobe(16) == 8
    assert default_nprobe(4) == 4  # never more than nlist
    assert default_nprobe(4096) == 256


@pytest.mark.parametrize(
    "factory,kind",
    [
        ("Flat", "flat"),
        ("PQ4", "flat"),
        ("SQ8", "flat"),
        ("HNSW32", "hnsw"),
        ("HNSW16,Flat", "hnsw"),
        ("IVF8,Flat", "ivf"),
        ("IVF8,PQ4", "ivf"),
        ("PCA8,IVF8,Flat", "ivf"),
        ("NSG32,Flat", "graph"),
    ],
)
def test_factory_strings_build_the_expected_kind(factory, kind):
    idx = VectorIndex(16, factory, "l2")
    assert idx.kind == kind
    assert index_kind(faiss.index_factory(16, factory)) == kind
    assert idx.uses_tombstones == (kind in ("hnsw", "graph"))


def test_invalid_factory_string_is_a_clear_error():
    with pytest.raises(FactoryError, match=r"invalid FAISS factory string 'NOPE12': FAISS cannot parse it "
                                           r"\(factory strings are case-sensitive, with no spaces\)$"):
        VectorIndex(8, "NOPE12")


@pytest.mark.parametrize("factory,meant", [("Flat ", "Flat"), ("flat", "Flat"), ("hnsw32", "HNSW32"),
                                           ("ivf4, sq8", "IVF4,SQ8"), ("pq4x4FS", "PQ4x4fs"),
                                           ("ivf4,pq4x4FS", "IVF4,PQ4")])  # never a refused IVF fast-scan
def test_a_factory_string_faiss_cannot_parse_names_the_one_that_works(factory, meant):
    """FAISS's "could not parse index string Flat" hid the trailing space of "Flat " and did not say its
    strings are case-sensitive ("flat"); the message shows the string with repr and the spelling FAISS takes."""
    with pytest.raises(FactoryError, match=rf"invalid FAISS factory string {re.escape(repr(factory))}: FAISS cannot "
                                           rf"parse it .*; did you mean {meant!r}\?$"):
        VectorIndex(8, factory)


def test_an_l2_only_factory_under_another_metric_names_the_metric():
    """FAISS said only "'metric == METRIC_L2' failed" of LSH under cosine."""
    with pytest.raises(FactoryError, match=r"^'LSH' works only with the l2 metric \(--metric l2\), not cosine: choose l2"):
        VectorIndex(8, "LSH", "cosine")
    assert VectorIndex(8, "LSH", "l2").kind == "flat"


def test_check_factory_knows_what_training_needs_before_any_vector():
    """nlist vectors for IVF, 2^bits for a PQ codebook; `train` refuses the same counts with the same words."""
    check_factory("IVF16,Flat", 8, "l2", 16)
    with pytest.raises(FactoryError, match="'IVF16,Flat' needs at least 16 training vectors, got 15"):
        check_factory("IVF16,Flat", 8, "l2", 15)
    with pytest.raises(FactoryError, match="needs at least 256 training vectors, got 100"):
        check_factory("IVF4,PQ4", 8, "l2", 100)
    check_factory("HNSW8", 8, "cosine", 1)
    with pytest.raises(FactoryError, match="needs at least 16 training vectors, got 15"):
        VectorIndex(8, "IVF16,Flat", "l2").train(np.zeros((15, 8), dtype="float32"))


def test_factory_none_uses_auto_choice():
    assert VectorIndex(8, None, expected_size=10).factory == "Flat"
    assert VectorIndex(8, None, expected_size=100_000).factory == "HNSW32"
    with pytest.raises(ValueError, match="expected_size"):
        VectorIndex(8, None)


@pytest.mark.parametrize("factory,plain", [("IVF4,PQ8x4fs", "IVF4,PQ8"), ("IVF4,PQ4x4fsr", "IVF4,PQ4"),
                                           ("IVF4,RaBitQfs", "IVF4,RaBitQ"), ("PCA8,IVF4,PQ4x4fs", "PCA8,IVF4,PQ4"),
                                           ("IVF4,PQ8x4fs_64", "IVF4,PQ8"), ("IVF4,RaBitQfs_64", "IVF4,RaBitQ")])
def test_ivf_fast_scan_is_refused_before_anything_is_built(tmp_path, factory, plain):
    """FAISS cannot decode an IVF fast-scan code alone: the exact scan of a filtered search and a segment
    merge (reconstruct) crashed the process on a saved index. Refused up front, with the plain IVF form."""
    from twotower.indexing import IndexStore

    with pytest.raises(FactoryError, match=rf"{factory!r} is an IVF fast-scan index.*use {plain!r}"):
        check_factory(factory, 16, "cosine", 10_000)
    with pytest.raises(FactoryError, match="IVF fast-scan"):
        IndexStore.create(tmp_path / "idx", dim=16, factory=factory)
    assert not (tmp_path / "idx").exists()
    VectorIndex(16, "PQ4x4fs")  # fast-scan without IVF reconstructs through IDMap2: still accepted
    VectorIndex(16, plain)


@pytest.mark.parametrize("id_map", [False, True])
def test_an_ivf_fast_scan_index_built_before_the_refusal_raises_instead_of_crashing(id_map):
    """An index saved by an older version still opens and searches without a filter; what needs its stored
    vectors raises a FactoryError saying to rebuild it, instead of reaching FAISS's reconstruct (which, inside
    an IDMap2, failed with FAISS's own "direct map" error)."""
    idx = VectorIndex(16, "IVF4,PQ4", "l2")
    idx._index = faiss.index_factory(16, "IVF4,PQ4x4fs", faiss.METRIC_L2)  # what the old version built
    if id_map:
        idx._index = faiss.IndexIDMap2(idx._index)
    idx.factory = "IVF4,PQ4x4fs"
    x = np.random.default_rng(0).standard_normal((700, 16)).astype("float32")
    idx.add([f"d{i}" for i in range(700)], x)
    assert idx.search(x[:1], k=3).ids[0][0] != ""
    with pytest.raises(FactoryError, match=r"built with 'IVF4,PQ4x4fs'.*rebuild it with --factory 'IVF4,PQ4'"):
        idx.search(x[:1], k=3, allowed=["d1", "d2"])
    with pytest.raises(FactoryError, match="rebuild it"):
        idx.reconstruct(["d1"])


def test_an_index_store_built_with_ivf_fast_scan_says_rebuild_on_add(tmp_path, monkeypatch):
    """An index an older version built with an IVF fast-scan factory still searches; an add to it needs a
    new segment of that factory, which is refused: the message says to rebuild it, not to "use" another."""
    from twotower.indexing import IndexStore

    monkeypatch.setattr(faiss, "IndexIVFFastScan", type("NotRefused", (), {}))  # what the old version allowed
    x = np.random.default_rng(0).standard_normal((700, 16)).astype("float32")
    with IndexStore.create(tmp_path / "idx", dim=16, factory="IVF4,PQ4x4fs", metric="l2") as store:
        store.add([{"id": f"d{i}", "text": "t"} for i in range(700)], x)
    monkeypatch.undo()
    assert IndexStore.open(tmp_path / "idx", readonly=True).search(x[:1], k=3).ids[0][0] == "d0"
    with IndexStore.open(tmp_path / "idx") as store:
        with pytest.raises(FactoryError, match=r"built with 'IVF4,PQ4x4fs'.*rebuild it with --factory 'IVF4,PQ4'"):
            store.add([{"id": "new", "text": "t"}], x[:1])
