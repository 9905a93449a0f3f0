"""The vector backend seam: what an ``IndexStore`` needs from "vectors with string ids".

Two implementations:

* ``twotower.indexing.segments.Segments`` — FAISS, append-only segment files in the index
  directory (the default);
* ``twotower.indexing.milvus.MilvusVectors`` — a Milvus collection (Milvus Lite file, server or
  cluster) reached through ``pymilvus.MilvusClient``.

Both stage changes (``add`` / ``remove``, visible at once to the writer's own searches), write
what a commit needs *before* the store's SQLite commit point (``prepare_commit``) and switch to
the committed state after it (``apply``). The store records ``CommitPlan`` in the same SQLite
transaction as the documents, so documents and vectors change together (the protocol is in
``twotower.indexing.store``; Milvus's side of it in ``twotower.indexing.milvus``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from twotower.indexing.search_result import SearchResult

BACKENDS = ("faiss", "milvus")


@runtime_checkable
class VectorBackend(Protocol):
    """Vectors with string ids, staged and committed with an ``IndexStore``'s documents."""

    dim: int
    factory: str  # FAISS factory string, or the Milvus index type
    kind: str  # what search options tune: "flat", "hnsw", "ivf", ... (`twotower.indexing.factory.index_kind`)
    metric: str  # "cosine" | "ip" | "l2"; scores are higher-is-better for all three
    native_filters: bool  # search(filter=Filter) is evaluated by the backend itself (Milvus)
    max_k: int | None  # the most hits one search may ask for (Milvus's topk bound), None: no bound

    # membership (staged changes included for the writer)
    def __len__(self) -> int: ...
    def __contains__(self, doc_id: object) -> bool: ...
    def contains_many(self, ids: Iterable[str]) -> list[bool]: ...
    def ids(self) -> list[str]: ...
    @property
    def tombstone_count(self) -> int: ...  # deleted or superseded vectors still stored
    @property
    def stored_count(self) -> int: ...
    @property
    def has_changes(self) -> bool: ...
    @property
    def segments(self) -> Sequence[Any]: ...  # local files of the commit (none for Milvus)

    # training (IVF/PQ on FAISS; nothing to do on Milvus)
    @property
    def is_trained(self) -> bool: ...
    def train_sample_size(self, n: int) -> int: ...
    def train(self, vectors: np.ndarray) -> None: ...

    # staging
    def add(self, ids: Sequence[str], vectors: np.ndarray, *, on_duplicate: str = "error",
            metadata: Sequence[Mapping[str, Any]] | None = None) -> int: ...
    def remove(self, ids: Iterable[str]) -> list[str]: ...

    # reading
    def search(self, queries: np.ndarray, k: int = 10, *, filter: Any = None,
               allowed: Collection[str] | None = None, **params: Any) -> SearchResult: ...
    def reconstruct(self, ids: Sequence[str]) -> np.ndarray: ...

    # commit
    def digest(self) -> int: ...  # set digest of the live ids, compared with the documents' on open
    def prepare_commit(self, directory: Path, seq: int, written: list[Path],
                       checkpoint: Callable[[str], None] = ...) -> Any: ...
    def apply(self, segments: Any) -> None: ...
    def repair(self) -> None: ...  # writer open: remove leftovers of an interrupted commit, check the rest
    def close(self) -> None: ...  # writer close: release what the commits no longer need
