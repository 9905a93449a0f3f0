"""Choosing and inspecting FAISS index types (index-factory strings).

Automatic choice, ``auto_factory(n, dim)`` — the rule and why:

* ``n <= 50_000`` → ``"Flat"``: exact search. Brute force over 50k × 384 floats is
  about 19M multiply-adds a query, a fraction of a millisecond with BLAS for a
  batch, so an approximate index would only cost recall and build time.
* ``50_000 < n <= 5_000_000`` → ``"HNSW32"`` searched with ``efSearch = 128``
  (``DEFAULT_EF_SEARCH``). HNSW needs no training, adds incrementally, and on
  sentence embeddings M=32 / efSearch≥64 typically keeps recall@10 against Flat
  above 0.95 while visiting a few thousand vectors instead of all of them — the
  target of the 200k-MiniLM benchmark (recall@10 ≥ 0.95 at ≥ 4× Flat's queries/s).
  Deletions are tombstones (see ``VectorIndex``).
* ``n > 5_000_000`` → ``"IVF{nlist},SQ8"`` with ``nlist`` the power of two nearest
  ``4·sqrt(n)`` and ``nprobe = nlist/16``: HNSW32 over float vectors needs
  ``4·dim + 256`` bytes a vector plus slow single-threaded-ish inserts, which stops
  being reasonable at this size; SQ8 cuts vector memory 4× at a small recall cost.
  This branch is not benchmarked here (no corpus that large) — tune ``nprobe``.
"""

from __future__ import annotations

import math

import faiss

FLAT_MAX = 50_000
HNSW_MAX = 5_000_000
DEFAULT_EF_SEARCH = 128


def ivf_nlist(n: int) -> int:
    """Number of IVF lists for ``n`` vectors: the power of two nearest 4·sqrt(n), in [16, 65536]."""
    target = 4.0 * math.sqrt(max(n, 1))
    return int(min(65536, max(16, 2 ** round(math.log2(target)))))


def auto_factory(n: int, dim: int) -> str:
    """Index-factory string for ``n`` vectors of dimension ``dim`` (rule in the module docstring)."""
    if n < 0:
        raise ValueError(f"auto_factory: corpus size must be >= 0, got {n}")
    if dim <= 0:
        raise ValueError(f"auto_factory: dimension must be > 0, got {dim}")
    if n <= FLAT_MAX:
        return "Flat"
    if n <= HNSW_MAX:
        return "HNSW32"
    return f"IVF{ivf_nlist(n)},SQ8"


def default_nprobe(nlist: int) -> int:
    """Starting nprobe for an IVF index: 1/16 of the lists, at least 8 (never more than nlist)."""
    return int(min(nlist, max(8, nlist // 16)))


def unwrap(index: faiss.Index) -> faiss.Index:
    """The innermost index that does the search (through IDMap, PreTransform and Refine wrappers)."""
    index = faiss.downcast_index(index)
    while True:
        if isinstance(index, faiss.IndexIDMap | faiss.IndexIDMap2 | faiss.IndexPreTransform):
            index = faiss.downcast_index(index.index)
        elif isinstance(index, faiss.IndexRefine):
            index = faiss.downcast_index(index.base_index)
        else:
            return index


def index_kind(index: faiss.Index) -> str:
    """``"ivf"``, ``"hnsw"``, ``"graph"`` (other graph indexes, e.g. NSG), ``"flat"`` or ``"other"``.

    The kind decides how ids and deletions work: IVF stores ids itself and removes
    natively; graph indexes cannot remove (tombstones); flat-code indexes remove through
    ``IndexIDMap2``.
    """
    core = unwrap(index)
    if faiss.try_extract_index_ivf(core) is not None:
        return "ivf"
    if isinstance(core, faiss.IndexHNSW):
        return "hnsw"
    if isinstance(core, faiss.IndexNSG | faiss.IndexNNDescent):
        return "graph"
    if isinstance(core, faiss.IndexFlatCodes):
        return "flat"
    return "other"


def supports_gpu(kind: str) -> bool:
    """Whether ``faiss.index_cpu_to_all_gpus`` can take an index of this kind (graphs cannot)."""
    return kind in ("flat", "ivf")
