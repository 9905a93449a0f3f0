"""A FAISS index addressed by string document ids.

FAISS only knows int64 labels. ``VectorIndex`` hands out labels sequentially (never
reusing one), keeps the two-way map ``id <-> label`` in Python and persists it inside
the saved file, so callers only ever see their own ids. Deletion depends on the index
kind (see ``twotower.indexing.factory.index_kind``):

* flat-code indexes (``Flat``, ``PQ16``, ``SQ8``, …) are wrapped in ``IndexIDMap2`` and
  remove natively;
* IVF indexes store labels themselves and remove natively;
* graph indexes (``HNSW32``, NSG) cannot remove, so deleted labels become *tombstones*:
  the vector stays in the graph (it still routes searches) but is filtered out of the
  results by over-fetching. When tombstones exceed ``auto_rebuild_fraction`` of the
  stored vectors the index is rebuilt from the live vectors (``rebuild()``).

Saved as one file (``twotower.indexing.vector_file``: a FAISS index plus a JSON trailer), so a
save is one atomic rename and stock FAISS tools still open it. ``load(path, mmap=True)``
maps the vector storage with ``faiss.IO_FLAG_MMAP_IFC`` (flat codes, HNSW storage and IVF
lists; plain ``IO_FLAG_MMAP`` only maps IVF lists in FAISS 1.15) instead of reading it
into RAM. A mapped index is read-only in FAISS (mutating it aborts the process), so the
first ``add``/``remove`` copies it into memory (peak ≈ 2× the index for that moment).

Not thread-safe for mutation; concurrent ``search`` calls on an unchanging index are fine.
"""

from __future__ import annotations

import logging
import math
import re
import warnings
import weakref
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import faiss
import numpy as np
from tqdm.auto import tqdm

from twotower.indexing.errors import IndexFormatError
from twotower.indexing.factory import (
    DEFAULT_EF_SEARCH,
    auto_factory,
    default_nprobe,
    index_kind,
    supports_gpu,
    unwrap,
)
from twotower.indexing.id_map import IdMap
from twotower.indexing.search_result import MISSING_ID, SearchResult, check_k, empty_result, padded
from twotower.indexing.vector_file import read_vector_file, write_vector_file

logger = logging.getLogger(__name__)

Metric = Literal["cosine", "ip", "l2"]
DuplicatePolicy = Literal["error", "skip", "replace"]

VECTOR_METRICS = ("cosine", "ip", "l2")  # what an index can rank by (`index build --metric`)
_FAISS_METRIC = {
    "cosine": faiss.METRIC_INNER_PRODUCT,
    "ip": faiss.METRIC_INNER_PRODUCT,
    "l2": faiss.METRIC_L2,
}
_POINTS_PER_CENTROID_MIN = 39  # below this FAISS k-means warns that centroids are poorly estimated
_POINTS_PER_CENTROID_SAMPLE = 256  # FAISS subsamples to this many per centroid anyway
_OPTIONS = ("ef_search", "ef_construction", "nprobe", "train_sample", "seed", "auto_rebuild_fraction")
# Filtered search (``VectorIndex._search_allowed``): an allowed set this small is scanned exactly
# instead of walking the index with an id selector (benchmarks/filtered_search.py measures the choice)
EXACT_SCAN_MAX = 4096
EXACT_SCAN_FRACTION = 0.02  # HNSW / IVF: of the live vectors
FLAT_EXACT_FRACTION = 0.0  # Flat: the selector search is exact too, and reads the vectors in place (no copy)
EXACT_SCAN_CHUNK = 32768  # vectors reconstructed and scored at a time (bounded memory)
HNSW_FILTER_EF_MAX = 2048  # the widened efSearch of a filtered HNSW search stops here


class FactoryError(ValueError):
    """A FAISS factory string that FAISS cannot build, or whose training needs more vectors than there are."""


class FastScanIVFError(FactoryError):
    """An IVF fast-scan factory, refused (`fast_scan_ivf_error`); its own class so that a caller which knows the
    index already exists can say "rebuild it" instead of "use"."""


def _too_few_to_train(factory: str, need: int, n: int) -> FactoryError:
    return FactoryError(f"{factory!r} needs at least {need} training vectors, got {n}; "
                        "IVF needs a vector a list and PQ 2^bits a codebook: use a smaller nlist or fewer PQ bits, "
                        "or a Flat / HNSW index, for this many vectors")


# FAISS's own spelling of the factory components a user may type in another case (`_factory_error`)
_FAISS_NAMES = ("Flat", "HNSW", "IVF", "PQ", "SQ", "PCA", "OPQ", "RFlat", "Refine", "IDMap", "LSH", "NSG", "RaBitQ",
                "L2norm", "ITQ", "RR", "Residual", "LSQ", "RQ", "PRQ", "PLSQ", "fsr", "fs")
_FAISS_NAME_RE = re.compile("|".join(sorted(_FAISS_NAMES, key=len, reverse=True)), re.IGNORECASE)


def _factory_error(factory: str, dim: int, metric: Metric, raw: str) -> FactoryError:
    """A FAISS refusal of ``factory`` in words a user can act on.

    Why: FAISS says "could not parse index string Flat" of ``"Flat "`` (the space invisible) and of ``"flat"``
    (its strings are case-sensitive), and "'metric == METRIC_L2' failed" of an L2-only index (LSH) under
    another metric; each message now says what is wrong, with the string that works when there is one.
    """
    msg = raw.strip().splitlines()[-1]
    # FAISS prefixes "Error in <C++ signature> at <file>:<line>: " (and "Error: '<assertion>' failed: ")
    if "'metric == METRIC_L2' failed" in msg:
        return FactoryError(f"{factory!r} works only with the l2 metric (--metric l2), not {metric}: choose l2, "
                            "or another index")
    msg = re.sub(r"^Error in .*? at \S+:\d+: (Error: '.*?' failed: )?", "", msg)
    if msg.startswith("could not parse index string"):
        msg = "FAISS cannot parse it (factory strings are case-sensitive, with no spaces)"
        fixed = _FAISS_NAME_RE.sub(lambda m: next(n for n in _FAISS_NAMES if n.lower() == m[0].lower()),
                                   re.sub(r"\s+", "", factory))
        if fixed != factory:
            try:
                if isinstance(unwrap(faiss.index_factory(dim, fixed, _FAISS_METRIC[metric])), faiss.IndexIVFFastScan):
                    fixed = _without_fast_scan(fixed)  # never suggest what the next step refuses
                    faiss.index_factory(dim, fixed, _FAISS_METRIC[metric])
                msg += f"; did you mean {fixed!r}?"
            except RuntimeError:
                pass
    return FactoryError(f"invalid FAISS factory string {factory!r}: {msg}")


def _without_fast_scan(factory: str) -> str:
    """``factory`` with its fast-scan packing dropped (``IVF4,PQ8x4fs_64`` -> ``IVF4,PQ8``)."""
    return re.sub(r"(?:x4)?fsr?(?:_\d+)?\b", "", factory)


def fast_scan_ivf_error(factory: str, *, built: bool = False) -> FastScanIVFError:
    """The refusal of an IVF fast-scan index (``IVF…,PQ…x4fs``/``fsr``, ``IVF…,RaBitQfs``); ``built``: an
    index made before they were refused, which can still be searched without a filter.

    Why refused: FAISS packs their codes in blocks it cannot decode one vector at a time; reconstructing
    stored vectors (the exact scan of a filtered search, the merge of segments at a commit) crashed the
    process (segfault) on a saved index instead of raising. Plain IVF-PQ keeps the same lists and codes.
    """
    plain = _without_fast_scan(factory)
    suggestion = f"{plain!r} (the same IVF lists, codes without fast-scan packing)" if plain != factory else "IVF…,PQ…"
    what = (f"this index was built with {factory!r}, an IVF fast-scan index, which" if built
            else f"{factory!r} is an IVF fast-scan index, which")
    return FastScanIVFError(f"{what} cannot return its stored vectors (filtered search and segment merges need them; "
                        f"FAISS crashes instead of refusing): {'rebuild it with --factory' if built else 'use'} "
                        f"{suggestion}, or a fast-scan PQ without IVF such as 'PQ8x4fs', or HNSW32 / Flat")


def check_factory(factory: str, dim: int, metric: Metric, num_vectors: int) -> None:
    """Raise `FactoryError` if FAISS cannot build ``factory`` for ``dim``-dimensional vectors, or if
    ``num_vectors`` cannot train it: an index build calls this before encoding, so that a typo or an IVF
    too large for the corpus costs a second, not the encoding of the whole corpus."""
    need = VectorIndex(dim, factory, metric).min_train_size
    if num_vectors < need:
        raise _too_few_to_train(factory, need, num_vectors)


# FAISS on a GPU selects at most this many rows (and IVF lists) per query (faiss/gpu/utils/DeviceDefs.cuh)
GPU_MAX_K = 2048


class VectorIndex:
    """Vectors keyed by string ids, searched with FAISS.

    Args:
        dim: vector dimension.
        factory: FAISS index-factory string (``"Flat"``, ``"HNSW32"``, ``"IVF1024,Flat"``,
            ``"IVF1024,PQ48"``, …). ``None`` picks ``auto_factory(expected_size, dim)``.
        metric: ``"cosine"`` (inner product of L2-normalised vectors; added and query
            vectors are normalised for you, your arrays are not modified), ``"ip"`` or
            ``"l2"``. Scores are always higher-is-better (L2 gives ``-squared_distance``).
        expected_size: corpus size used only when ``factory`` is ``None``.
        ef_search: HNSW search breadth (default 128); raised to the fetch depth if smaller.
        ef_construction: HNSW build breadth (FAISS default 40 when ``None``).
        nprobe: IVF lists visited per query (default ``max(8, nlist/16)``).
        train_sample: vectors sampled for IVF/PQ training (default 256 per centroid).
        seed: seed of the training sample (FAISS k-means is itself seeded).
        auto_rebuild_fraction: rebuild a tombstoned index when tombstones exceed this
            fraction of stored vectors; ``None`` never rebuilds by itself.
        use_gpu: ``None`` = use all GPUs when FAISS sees any and the kind supports it
            (never for graph indexes); ``True`` = require it; ``False`` = CPU only.

    Example:
        >>> idx = VectorIndex(4, "Flat", "cosine")
        >>> idx.add(["a", "b"], np.eye(2, 4, dtype="float32"))
        2
        >>> idx.search(np.array([[1, 0, 0, 0]], dtype="float32"), k=3).ids
        [['a', 'b', '']]
    """

    def __init__(
        self,
        dim: int,
        factory: str | None = "Flat",
        metric: Metric = "cosine",
        *,
        expected_size: int | None = None,
        ef_search: int | None = None,
        ef_construction: int | None = None,
        nprobe: int | None = None,
        train_sample: int | None = None,
        seed: int = 0,
        auto_rebuild_fraction: float | None = 0.25,
        use_gpu: bool | None = None,
    ) -> None:
        if not isinstance(dim, int | np.integer) or dim <= 0:
            raise ValueError(f"VectorIndex: dim must be a positive int, got {dim!r}")
        if metric not in _FAISS_METRIC:
            raise ValueError(f"VectorIndex: metric must be one of {sorted(_FAISS_METRIC)}, got {metric!r}")
        if factory is None:
            if expected_size is None:
                raise ValueError("VectorIndex: pass factory=... or expected_size=... (for auto_factory)")
            factory = auto_factory(expected_size, int(dim))
        if auto_rebuild_fraction is not None and not 0 < auto_rebuild_fraction <= 1:
            raise ValueError(f"auto_rebuild_fraction must be in (0, 1] or None, got {auto_rebuild_fraction}")
        self.dim = int(dim)
        self.metric: Metric = metric
        self.factory = factory
        self.ef_search = ef_search
        self.ef_construction = ef_construction
        self.nprobe = nprobe
        self.train_sample = train_sample
        self.seed = seed
        self.auto_rebuild_fraction = auto_rebuild_fraction
        self.use_gpu = use_gpu
        self._index = self._new_faiss_index()
        self.kind = index_kind(self._index)
        self._ids = IdMap()
        self._tombstones: set[int] = set()  # labels still stored in a graph index but deleted
        self._mmapped = False
        self._gpu_index: faiss.Index | None = None
        self._sel_cache: tuple[Any, faiss.IDSelector, np.ndarray] | None = None  # see _selector
        if use_gpu and not self._gpu_possible():
            raise ValueError(
                f"use_gpu=True but FAISS sees {faiss.get_num_gpus()} GPUs or index kind {self.kind!r} "
                "cannot run on GPU"
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        ids: Sequence[str],
        vectors: np.ndarray,
        *,
        factory: str | None = None,
        metric: Metric = "cosine",
        batch_size: int = 65536,
        progress: bool = False,
        **kwargs: Any,
    ) -> VectorIndex:
        """Create, train (if needed) and fill an index in one call.

        ``vectors`` may be an ``np.memmap`` (embeddings streamed to disk): it is read in
        ``batch_size`` slices and only the training sample is gathered at once.
        """
        if vectors.ndim != 2:
            raise ValueError(f"VectorIndex.build: vectors must be 2-D (N, D), got shape {vectors.shape}")
        n, dim = vectors.shape
        index = cls(dim, factory if factory is not None else auto_factory(n, dim), metric, **kwargs)
        if not index.is_trained:
            index.train(vectors)
        for start in tqdm(range(0, n, batch_size), desc="index vectors", disable=not progress):
            index.add(list(ids[start : start + batch_size]), vectors[start : start + batch_size])
        return index

    def _new_faiss_index(self) -> faiss.Index:
        try:
            index = faiss.index_factory(self.dim, self.factory, _FAISS_METRIC[self.metric])
        except RuntimeError as e:
            raise _factory_error(self.factory, self.dim, self.metric, str(e)) from None
        kind = index_kind(index)
        core = unwrap(index)
        if isinstance(core, faiss.IndexIVFFastScan):
            raise fast_scan_ivf_error(self.factory)
        if kind == "hnsw" and self.ef_construction is not None:
            core.hnsw.efConstruction = int(self.ef_construction)
        if kind != "ivf" and not isinstance(faiss.downcast_index(index), faiss.IndexIDMap):
            index = faiss.IndexIDMap2(index)  # IVF keeps labels itself; others need the map
        self._apply_search_params(index, kind)
        return index

    def _apply_search_params(self, index: faiss.Index, kind: str) -> None:
        """Store the default efSearch / nprobe on the FAISS object too (so stock tools see them)."""
        core = unwrap(index)
        if kind == "hnsw":
            core.hnsw.efSearch = self._ef_search_default()
        elif kind == "ivf":
            faiss.extract_index_ivf(core).nprobe = self._nprobe_default(core)

    def _ef_search_default(self) -> int:
        return int(self.ef_search) if self.ef_search is not None else DEFAULT_EF_SEARCH

    def _nprobe_default(self, core: faiss.Index | None = None) -> int:
        if self.nprobe is not None:
            return int(self.nprobe)
        ivf = faiss.extract_index_ivf(unwrap(self._index) if core is None else core)
        return default_nprobe(ivf.nlist)

    def set_search_params(self, *, ef_search: int | None = None, nprobe: int | None = None) -> None:
        """Change the default search breadth (persisted by ``save``)."""
        if ef_search is not None:
            self.ef_search = int(ef_search)
        if nprobe is not None:
            self.nprobe = int(nprobe)
        self._apply_search_params(self._index, self.kind)
        self._gpu_index = None

    # ------------------------------------------------------------------ properties
    def __len__(self) -> int:
        """Number of live (searchable) vectors."""
        return len(self._ids)

    def __contains__(self, doc_id: object) -> bool:
        return doc_id in self._ids

    def contains_many(self, ids: Iterable[str]) -> list[bool]:
        """Membership of each id, in order."""
        return [i in self._ids for i in ids]

    def ids(self) -> list[str]:
        """Live ids in insertion order."""
        return self._ids.ids()

    @property
    def tombstone_count(self) -> int:
        """Deleted vectors still stored (graph indexes only; 0 elsewhere)."""
        return len(self._tombstones)

    @property
    def stored_count(self) -> int:
        """Vectors physically in the FAISS index (live + tombstones)."""
        return int(self._index.ntotal)

    @property
    def is_trained(self) -> bool:
        return bool(self._index.is_trained)

    @property
    def is_mmapped(self) -> bool:
        return self._mmapped

    @property
    def uses_tombstones(self) -> bool:
        return self.kind in ("hnsw", "graph")

    @property
    def min_train_size(self) -> int:
        """Fewest training vectors FAISS accepts: nlist for IVF, 2^nbits for PQ codebooks."""
        if self.is_trained:
            return 0
        need = 1
        core = unwrap(self._index)
        ivf = faiss.try_extract_index_ivf(core)
        if ivf is not None:
            need = max(need, int(ivf.nlist))
        pq = getattr(faiss.downcast_index(ivf if ivf is not None else core), "pq", None)
        if pq is not None:
            need = max(need, 1 << int(pq.nbits))
        return need

    def train_sample_size(self, n: int) -> int:
        """How many of ``n`` available vectors ``train`` uses."""
        want = (
            self.train_sample
            if self.train_sample is not None
            else (_POINTS_PER_CENTROID_SAMPLE * self.min_train_size)
        )
        return int(min(n, max(want, self.min_train_size)))

    # ------------------------------------------------------------------ mutation
    def train(self, vectors: np.ndarray) -> None:
        """Train IVF/PQ/SQ parts on a seeded random sample of ``vectors`` (N, D); no-op if trained."""
        if self.is_trained:
            return
        if getattr(vectors, "ndim", None) != 2:
            raise ValueError(
                f"train: vectors must be 2-D (N, D), got shape {getattr(vectors, 'shape', None)}"
            )
        n = vectors.shape[0]
        need = self.min_train_size
        if n < need:
            raise _too_few_to_train(self.factory, need, n)
        if n < _POINTS_PER_CENTROID_MIN * need:
            warnings.warn(
                f"training {self.factory!r} on {n} vectors (< {_POINTS_PER_CENTROID_MIN}×{need}): "
                "centroids will be poorly estimated",
                stacklevel=2,
            )
        m = self.train_sample_size(n)
        rng = np.random.default_rng(self.seed)
        rows = np.sort(rng.choice(n, size=m, replace=False)) if m < n else np.arange(n)
        x = self._prepare(vectors[rows], "training vectors")  # (m, D)
        self._ensure_writable()
        self._index.train(x)
        self._gpu_index = None

    def add(self, ids: Sequence[str], vectors: np.ndarray, *, on_duplicate: DuplicatePolicy = "error") -> int:
        """Add ``vectors`` (N, D) under ``ids``; returns how many were added.

        ``on_duplicate`` decides what happens to ids already in the index: ``"error"``
        (ValueError naming them), ``"skip"`` (keep the old vector) or ``"replace"``.
        Repeated ids within one call are always an error. An untrained index is trained
        on this batch first.
        """
        if on_duplicate not in ("error", "skip", "replace"):
            raise ValueError(f"on_duplicate must be 'error', 'skip' or 'replace', got {on_duplicate!r}")
        ids = _check_ids(ids, "add")
        x = self._prepare(vectors, "vectors")  # (N, D)
        if len(ids) != x.shape[0]:
            raise ValueError(f"add: got {len(ids)} ids but {x.shape[0]} vectors")
        present = [i for i in ids if i in self._ids]
        if present:
            if on_duplicate == "error":
                raise ValueError(
                    f"add: {len(present)} id(s) already in the index, e.g. {present[:5]}; "
                    "pass on_duplicate='skip' or 'replace'"
                )
            if on_duplicate == "skip":
                keep = [j for j, i in enumerate(ids) if i not in self._ids]
                ids, x = [ids[j] for j in keep], x[keep]
            else:  # replace
                self.remove(present)
        return self._insert(ids, x, train=self.train)

    def _insert(self, ids: list[str], x: np.ndarray, train) -> int:
        """Give `ids` fresh labels and add the prepared vectors `x` (N, D); the id map is undone on failure."""
        if not ids:
            return 0
        self._ensure_writable()
        if not self.is_trained:
            train(x)
        labels = self._ids.assign(ids)  # (N,) int64, fresh
        try:
            self._index.add_with_ids(x, labels)
        except BaseException:
            self._ids.release(ids)
            raise
        self._changed()
        return len(ids)

    def remove(self, ids: Iterable[str]) -> list[str]:
        """Delete ``ids``; returns the ids that were not in the index (in input order)."""
        ids = list(dict.fromkeys(ids))
        missing = [i for i in ids if i not in self._ids]
        present = [i for i in ids if i in self._ids]
        if not present:
            return missing
        labels = self._ids.labels(present)  # (n,) int64
        self._ensure_writable()
        if self.uses_tombstones:
            self._tombstones.update(labels.tolist())
        else:
            removed = self._index.remove_ids(labels)
            if removed != len(labels):
                raise RuntimeError(f"FAISS removed {removed} of {len(labels)} vectors; id map is out of step")
        self._ids.release(present)
        self._changed()
        if (
            self.auto_rebuild_fraction is not None
            and self._tombstones
            and len(self._tombstones) > self.auto_rebuild_fraction * self._index.ntotal
        ):
            logger.info("rebuilding %s: %d tombstones", self.factory, len(self._tombstones))
            self.rebuild()
        return missing

    def rebuild(self) -> None:
        """Re-create the FAISS index from the live vectors (drops tombstones, compacts).

        Vectors are re-read from the index, so lossy codes (PQ, SQ) stay as stored.
        Trained parts (IVF centroids, PQ codebooks) are kept; labels are kept too.
        """
        labels = self._ids.live_labels()  # (n,)
        vectors = self._reconstruct_labels(labels)  # (n, D)
        if (
            self._index.is_trained
            and not faiss.index_factory(self.dim, self.factory, _FAISS_METRIC[self.metric]).is_trained
        ):
            new = faiss.deserialize_index(faiss.serialize_index(self._index))  # keep training
            new.reset()
        else:
            new = self._new_faiss_index()
        if len(labels):
            new.add_with_ids(vectors, labels)
        self._index = new
        self._tombstones.clear()
        self._mmapped = False
        self._changed()

    def hide(self, ids: Iterable[str]) -> list[str]:
        """Delete ``ids`` from search results *without touching the FAISS index* (tombstones, any kind).

        Used for the committed, immutable segments of an ``IndexStore``: the stored file stays as it
        is (it may be memory-mapped and shared), the ids leave the id map and their labels are
        filtered out of results like graph tombstones. Returns the ids that were not present.
        """
        ids = list(dict.fromkeys(ids))
        present = [i for i in ids if i in self._ids]
        if present:
            self._tombstones.update(self._ids.release(present).tolist())
        hidden = set(present)
        return [i for i in ids if i not in hidden]

    def shallow_copy(self) -> VectorIndex:
        """A copy sharing the (read-only) FAISS index but with its own id map and tombstones.

        Lets several read snapshots of one immutable segment hide different deletions while the
        vector storage (often memory-mapped) exists once. Never mutate the FAISS index of either.
        """
        other = self.__class__.__new__(self.__class__)
        other.__dict__.update(self.__dict__)
        other._ids = IdMap(self._ids.state())
        other._tombstones = set(self._tombstones)
        other._gpu_index = None
        other._sel_cache = None
        return other

    def empty_copy(self) -> VectorIndex:
        """A new empty index with the same configuration and the same training (IVF centroids, PQ codebooks)."""
        other = self.__class__.__new__(self.__class__)
        other.__dict__.update(self.__dict__)
        if self.is_trained and not faiss.index_factory(self.dim, self.factory, _FAISS_METRIC[self.metric]).is_trained:
            # serialise, not clone_index: a clone of a mapped index keeps read-only mapped lists (reset aborts)
            other._index = faiss.deserialize_index(faiss.serialize_index(self._index))
            other._index.reset()
        else:
            other._index = other._new_faiss_index()
        other._ids = IdMap()
        other._tombstones = set()
        other._mmapped = False
        other._gpu_index = None
        other._sel_cache = None
        return other

    def add_stored(self, ids: Sequence[str], vectors: np.ndarray) -> int:
        """Add vectors exactly as another index of this metric stored them (no re-normalisation).

        For merging segments: ``reconstruct`` returns stored (already normalised) vectors, and
        normalising again could change their last bits; this keeps them bit-identical.
        """
        ids = _check_ids(ids, "add")
        x = np.ascontiguousarray(vectors, dtype=np.float32)  # (N, D)
        if x.ndim != 2 or x.shape != (len(ids), self.dim):
            raise ValueError(f"add_stored: need vectors of shape ({len(ids)}, {self.dim}), got {x.shape}")
        present = [i for i in ids if i in self._ids]
        if present:
            raise ValueError(f"add_stored: {len(present)} id(s) already in the index, e.g. {present[:5]}")
        return self._insert(ids, x, train=lambda v: self._index.train(v))

    def reconstruct(self, ids: Sequence[str]) -> np.ndarray:
        """Stored vectors (N, D) of ``ids`` (as normalised/encoded by the index); KeyError if absent."""
        missing = [i for i in ids if i not in self._ids]
        if missing:
            raise KeyError(f"reconstruct: {len(missing)} id(s) not in the index, e.g. {missing[:5]}")
        return self._reconstruct_labels(self._ids.labels(ids))

    def _reconstruct_labels(self, labels: np.ndarray) -> np.ndarray:
        out = np.empty((len(labels), self.dim), dtype=np.float32)  # (n, D)
        if len(labels) == 0:
            return out
        index = faiss.downcast_index(self._index)
        if isinstance(unwrap(index), faiss.IndexIVFFastScan):  # an index built before the factory was refused
            raise fast_scan_ivf_error(self.factory, built=True)  # (FAISS segfaults or says "direct map")
        if isinstance(index, faiss.IndexIDMap):
            inner = index.index
            stored = faiss.vector_to_array(index.id_map)  # (ntotal,) label at each position
            labels = np.asarray(labels, dtype=np.int64)
            if len(stored) > 1 and bool((stored[1:] > stored[:-1]).all()):
                # labels are handed out in order and removal keeps the order: a binary search per label
                pos_all = np.minimum(np.searchsorted(stored, labels), len(stored) - 1)
                if not bool((stored[pos_all] == labels).all()):
                    raise KeyError("reconstruct: a label is not stored in the index")
            else:
                pos_of = {int(lab): p for p, lab in enumerate(stored)}
                pos_all = np.array([pos_of[int(lab)] for lab in labels], dtype=np.int64)
            for start in range(0, len(labels), 65536):
                pos = pos_all[start : start + 65536]
                out[start : start + len(pos)] = inner.reconstruct_batch(pos)
            return out
        ivf = faiss.extract_index_ivf(unwrap(index))
        if ivf.direct_map.type == faiss.DirectMap.NoMap:
            self._ensure_writable()
            ivf = faiss.extract_index_ivf(unwrap(self._index))
            ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        return self._index.reconstruct_batch(labels)

    def _ensure_writable(self) -> None:
        """A memory-mapped FAISS index aborts the process on mutation: copy it into RAM first."""
        if self._mmapped:
            self._index = faiss.deserialize_index(faiss.serialize_index(self._index))
            self._mmapped = False

    def _changed(self) -> None:
        self._gpu_index = None

    # ------------------------------------------------------------------ search
    def search(
        self, queries: np.ndarray, k: int = 10, *, ef_search: int | None = None, nprobe: int | None = None,
        allowed: Collection[str] | np.ndarray | None = None,
    ) -> SearchResult:
        """Top-``k`` ids and scores for each row of ``queries`` (Q, D) (a single (D,) vector is Q=1).

        ``ef_search`` / ``nprobe`` override the defaults for this call only. ``allowed`` restricts
        the hits to those ids (ids not in the index are ignored), or to those labels when it is an
        int64 array (``allowed_labels``); see ``search_allowed`` for how k hits are guaranteed.
        """
        k = check_k(k)
        q = self._prepare(queries, "queries")  # (Q, D)
        num_q = q.shape[0]
        live = len(self)
        if live == 0 or num_q == 0:
            return empty_result(num_q, k)
        if k > live:  # the work is for the stored vectors; the padding to k comes once, at the end
            return padded(self.search(q, live, ef_search=ef_search, nprobe=nprobe, allowed=allowed), k)
        if allowed is not None:
            labels = allowed if isinstance(allowed, np.ndarray) else self.allowed_labels(allowed)
            return self._search_allowed(q, int(k), labels, ef_search, nprobe)
        ntotal = int(self._index.ntotal)
        want = min(k, live)
        if self._tombstones:  # expected tombstones in the top k', plus slack
            frac = len(self._tombstones) / ntotal
            fetch = min(ntotal, int(np.ceil(want / max(1e-6, 1 - frac) * 1.5)) + 8)
        else:
            fetch = want
        ids_out: list[list[str]] = [[] for _ in range(num_q)]
        scores_out = np.full((num_q, k), -np.inf, dtype=np.float32)  # (Q, k)
        todo = np.arange(num_q)
        while len(todo):
            dist, lab = self._raw_search(q[todo], fetch, ef_search, nprobe)  # (q, fetch) each
            names, alive = self._ids.lookup()  # by label
            found = lab >= 0
            safe = np.where(found, lab, 0)
            ok = found & alive[safe]
            tomb_hit = found & ~ok  # (q, fetch) tombstoned labels returned by FAISS
            score = (0.0 - dist) if self.metric == "l2" else dist  # 0.0 - d avoids -0.0
            if fetch == k and bool(ok.all()):
                # The common case (no tombstone, k hits for every query): map all labels in one array op
                # instead of a Python loop per query; on a small Flat index that loop was most of the overhead.
                rows = names[lab].tolist()  # (q, k) lists of str
                for row, qi in enumerate(todo.tolist()):
                    ids_out[qi] = rows[row]
                scores_out[todo] = score
                break
            retry = []
            for row, qi in enumerate(todo.tolist()):
                keep = np.flatnonzero(ok[row])[:k]
                if len(keep) < want and fetch < ntotal and tomb_hit[row].any():
                    retry.append(qi)  # tombstones crowded out live hits: fetch deeper
                    continue
                ids_out[qi] = names[safe[row, keep]].tolist()
                scores_out[qi, : len(keep)] = score[row, keep]
            todo = np.array(retry, dtype=np.int64)
            fetch = min(ntotal, fetch * 2)
        for row in ids_out:
            row.extend([MISSING_ID] * (k - len(row)))
        return SearchResult(ids=ids_out, scores=scores_out)

    # ------------------------------------------------------------------ filtered search
    def allowed_labels(self, ids: Iterable[str]) -> np.ndarray:
        """Sorted labels of the live ids among ``ids`` (others are skipped).  # (n,) int64"""
        return self._ids.labels_present(ids)

    def _search_allowed(self, q: np.ndarray, k: int, labels: np.ndarray, ef_search: int | None,
                        nprobe: int | None) -> SearchResult:
        """Top-k among ``labels`` (live labels of this index), never fewer than ``min(k, len(labels))``.

        Few allowed vectors (``<= EXACT_SCAN_MAX`` or ``EXACT_SCAN_FRACTION`` of the index; for Flat
        ``FLAT_EXACT_FRACTION``) are scored exactly after reconstructing them: faster than any
        index walk at that size, and exact. Otherwise FAISS searches with an id selector (a
        bitmap; Flat: exact; HNSW/IVF: approximate, HNSW with efSearch widened by
        ``1/sqrt(allowed fraction)``); a query for which the selector found fewer than
        ``min(k, allowed)`` hits — HNSW under a selective filter, IVF when the probed lists hold
        too few allowed vectors — is answered by the exact scan instead (no silent shortfall).
        """
        num_q, n = q.shape[0], len(labels)
        if n == 0:
            return empty_result(num_q, k)
        live = len(self)
        fraction = FLAT_EXACT_FRACTION if self.kind == "flat" else EXACT_SCAN_FRACTION
        if n <= max(EXACT_SCAN_MAX, fraction * live):
            return self.exact_search(q, k, labels)
        want = min(k, n)
        sel, _bits = self._selector(labels)  # _bits: the bitmap FAISS reads, alive for this search
        if self.kind == "hnsw":
            ef = ef_search if ef_search is not None else self._ef_search_default()
            # the walk still crosses filtered-out nodes, so fewer allowed ones reach the result list:
            # widen it by 1/sqrt(allowed fraction) (measured: recall@10 at 10 % 0.90 -> ~0.97)
            ef = min(max(ef / math.sqrt(n / live), ef), HNSW_FILTER_EF_MAX)
            params: faiss.SearchParameters = faiss.SearchParametersHNSW(sel=sel, efSearch=int(max(ef, want)))
        elif self.kind == "ivf":
            params = faiss.SearchParametersIVF(
                sel=sel, nprobe=int(nprobe if nprobe is not None else self._nprobe_default()))
        else:
            params = faiss.SearchParameters(sel=sel)
        dist, lab = self._index.search(q, want, params=params)  # (Q, want) each; CPU index: selectors
        names, _ = self._ids.lookup()
        score = (0.0 - dist) if self.metric == "l2" else dist
        ids_out: list[list[str]] = []
        scores_out = np.full((num_q, k), -np.inf, dtype=np.float32)  # (Q, k)
        short = []
        for row in range(num_q):
            keep = np.flatnonzero(lab[row] >= 0)
            if len(keep) < want:
                short.append(row)
                ids_out.append([])
                continue
            ids_out.append(names[lab[row, keep]].tolist() + [MISSING_ID] * (k - len(keep)))
            scores_out[row, : len(keep)] = score[row, keep]
        if short:
            exact = self.exact_search(q[short], k, labels)
            for j, row in enumerate(short):
                ids_out[row] = exact.ids[j]
                scores_out[row] = exact.scores[j]
        return SearchResult(ids=ids_out, scores=scores_out)

    def _selector(self, labels: np.ndarray) -> tuple[faiss.IDSelector, np.ndarray]:
        """An ``IDSelectorBitmap`` over the labels (one bit per label ever handed out: O(1) membership,
        built with numpy); the last one is reused while the same labels array is searched again."""
        cached = self._sel_cache
        if cached is not None and cached[0]() is labels:
            return cached[1], cached[2]
        mask = np.zeros(self._ids.next_label, dtype=bool)  # (labels,)
        mask[labels] = True
        bits = np.packbits(mask, bitorder="little")  # FAISS reads bit i & 7 of byte i >> 3
        sel = faiss.IDSelectorBitmap(len(mask), faiss.swig_ptr(bits))
        try:
            self._sel_cache = (weakref.ref(labels), sel, bits)
        except TypeError:
            pass
        return sel, bits

    def exact_search(self, q: np.ndarray, k: int, labels: np.ndarray) -> SearchResult:
        """Brute-force top-k of prepared queries (Q, D) over the stored vectors of ``labels``.

        Scores the vectors as the index stores them (``reconstruct``: exact for Flat/HNSW-Flat,
        the decoded codes for PQ/SQ), ``EXACT_SCAN_CHUNK`` at a time so memory stays bounded.
        Ties keep label order.
        """
        num_q = q.shape[0]
        metric = faiss.METRIC_L2 if self.metric == "l2" else faiss.METRIC_INNER_PRODUCT
        best_s = np.full((num_q, k), -np.inf, dtype=np.float32)  # (Q, k)
        best_l = np.full((num_q, k), -1, dtype=np.int64)  # (Q, k)
        for start in range(0, len(labels), EXACT_SCAN_CHUNK):
            chunk = labels[start : start + EXACT_SCAN_CHUNK]
            x = self._reconstruct_labels(chunk)  # (c, D)
            kk = min(k, len(chunk))
            dist, pos = faiss.knn(q, x, kk, metric=metric)  # (Q, kk) each
            s = (0.0 - dist) if self.metric == "l2" else dist
            cand_s = np.concatenate([best_s, s.astype(np.float32)], axis=1)  # (Q, k + kk)
            cand_l = np.concatenate([best_l, np.where(pos >= 0, chunk[np.maximum(pos, 0)], -1)], axis=1)
            order = np.argsort(-cand_s, axis=1, kind="stable")[:, :k]
            best_s = np.take_along_axis(cand_s, order, 1)
            best_l = np.take_along_axis(cand_l, order, 1)
        names, _ = self._ids.lookup()
        ids_out = [[names[lab] if lab >= 0 else MISSING_ID for lab in row] for row in best_l.tolist()]
        return SearchResult(ids=ids_out, scores=best_s)

    def _raw_search(
        self, q: np.ndarray, fetch: int, ef_search: int | None, nprobe: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        nprobe = nprobe if nprobe is not None or self.kind != "ivf" else self._nprobe_default()
        index = self._searcher(max(fetch, nprobe or 0))
        params = None
        if self.kind == "hnsw":
            ef = ef_search if ef_search is not None else self._ef_search_default()
            params = faiss.SearchParametersHNSW(efSearch=int(max(ef, fetch)))
        elif self.kind == "ivf":
            params = faiss.SearchParametersIVF(nprobe=int(nprobe))
        return index.search(q, fetch, params=params)

    def _gpu_possible(self) -> bool:
        return (
            supports_gpu(self.kind) and faiss.get_num_gpus() > 0 and hasattr(faiss, "index_cpu_to_all_gpus")
        )

    def _searcher(self, depth: int = 0) -> faiss.Index:
        """The GPU copy when one is wanted and possible, else the CPU index (the source of truth).

        depth: the k (or IVF nprobe) of the search. FAISS on a GPU refuses more than `GPU_MAX_K`, and a
        search that skips tombstones asks for more rows the more there are, so a deep one runs on the CPU.
        """
        if self.use_gpu is False or depth > GPU_MAX_K or not self._gpu_possible():
            return self._index
        if self._gpu_index is None:  # pragma: no cover - needs faiss-gpu and a GPU
            self._gpu_index = faiss.index_cpu_to_all_gpus(self._index)
        return self._gpu_index  # pragma: no cover

    def _prepare(self, x: np.ndarray, what: str) -> np.ndarray:
        """Validate and copy to contiguous float32 (N, D); L2-normalise for cosine."""
        x = np.asarray(x)
        if x.ndim == 1:
            x = x[None, :]
        if x.ndim != 2:
            raise ValueError(f"{what} must be 2-D (N, D), got shape {x.shape}")
        if x.shape[1] != self.dim:
            raise ValueError(
                f"{what} have dimension {x.shape[1]} but this index holds vectors of dimension {self.dim}"
            )
        out = np.array(x, dtype=np.float32, order="C", copy=True)
        if not np.isfinite(out).all():
            raise ValueError(f"{what} contain NaN or infinite values")
        if self.metric == "cosine":
            faiss.normalize_L2(out)
        return out

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Write the index and its id map to one file, atomically (temp file, fsync, rename)."""
        state = {key: getattr(self, key) for key in ("dim", "metric", "factory", *_OPTIONS)}
        state.update(ids_by_label=self._ids.state(), tombstones=sorted(self._tombstones))
        write_vector_file(path, self._index, state)

    @classmethod
    def load(cls, path: str | Path, *, mmap: bool = True, use_gpu: bool | None = None) -> VectorIndex:
        """Open a file written by ``save``; ``mmap=True`` maps vector storage instead of reading it."""
        index, state = read_vector_file(path, mmap=mmap)
        self = cls.__new__(cls)
        self.dim, self.metric, self.factory = int(state["dim"]), state["metric"], state["factory"]
        for key in _OPTIONS:
            setattr(self, key, state.get(key))
        self.use_gpu = use_gpu
        self._index = index
        self.kind = index_kind(index)
        try:
            self._ids = IdMap(state["ids_by_label"])
        except ValueError as e:
            raise IndexFormatError(path, str(e)) from None
        self._tombstones = set(state["tombstones"])
        self._mmapped = mmap
        self._gpu_index = None
        self._sel_cache = None
        if index.d != self.dim:
            raise IndexFormatError(path, f"FAISS index has dimension {index.d}, trailer says {self.dim}")
        if index.ntotal != len(self._ids) + len(self._tombstones):
            raise IndexFormatError(
                path,
                f"FAISS index holds {index.ntotal} vectors but the id map has {len(self._ids)} live ids "
                f"and {len(self._tombstones)} tombstones",
            )
        return self

    def __repr__(self) -> str:
        return (
            f"VectorIndex(dim={self.dim}, factory={self.factory!r}, metric={self.metric!r}, "
            f"live={len(self)}, tombstones={self.tombstone_count}, mmapped={self._mmapped})"
        )


def _check_ids(ids: Sequence[str], op: str) -> list[str]:
    ids = list(ids)
    for j, i in enumerate(ids):
        if not isinstance(i, str) or not i:
            raise ValueError(f"{op}: ids must be non-empty strings; item {j} is {i!r}")
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dups = [i for i in ids if i in seen or seen.add(i)]
        raise ValueError(f"{op}: repeated id(s) within one call, e.g. {dups[:5]}")
    return ids
