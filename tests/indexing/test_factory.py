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
    with pytest.raises(FactoryError, match="invalid FAISS factory string 'NOPE12': could not parse index string NOPE12$"):
        VectorIndex(8, "NOPE12")


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
