"""A transactional on-disk index directory: documents + vectors (+ BM25) that change together.

Layout of ``<dir>/``::

    manifest.json              what this is (format, dim, metric, factory, counts, extra)
    docs.sqlite                documents + the committed ``generation`` (the commit point)
    vectors-<generation>.faiss the VectorIndex of that generation (FAISS file + id-map trailer)
    bm25-<generation>.npz      BM25 of that generation (a derived cache; rebuilt if absent)
    LOCK                       flock'ed by the one writer

Commit protocol (``commit()``): changes are staged — documents inside an open SQLite
transaction, vectors in memory. Commit writes ``vectors-<g+1>.faiss`` atomically (temp,
fsync, rename), then in the *same* SQLite transaction that holds the staged documents
sets ``generation = g+1`` and commits. That single SQLite commit is the commit point:

* killed before it → SQLite rolls the documents back, ``generation`` is still ``g``, and
  ``vectors-<g+1>.faiss`` is a stray file that the next writable ``open`` deletes;
* killed after it → generation ``g+1`` is complete; the old vector file, the manifest
  counts and the BM25 cache are tidied by the next ``open``.

So a directory always opens with exactly the documents and vectors of the last completed
commit (tests/indexing/test_store_crash.py kills real processes at each step).

New directories (``create``, ``copy_to``) are built beside their target and renamed into
place, so a target path holds either nothing or a whole index. Bulk builds from a corpus
(encode in resumable shards, then one commit) are ``twotower.retrieval.build``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from twotower.common.atomic import TMP_MARKER, fsync_dir
from twotower.indexing.bm25 import BM25, document_text
from twotower.indexing.docstore import DocStore, Document, as_document
from twotower.indexing.errors import IndexFormatError
from twotower.indexing.manifest import MANIFEST_NAME, Manifest
from twotower.indexing.search_result import SearchResult
from twotower.indexing.vector_index import Metric, VectorIndex

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

DOCS_NAME = "docs.sqlite"
LOCK_NAME = "LOCK"
_VECTORS_RE = re.compile(r"^vectors-(\d+)\.faiss$")
_BM25_RE = re.compile(r"^bm25-(\d+)\.npz$")

# Test seam: called with a stage name at each step of commit(); the crash tests set it to
# a function that signals the parent process and waits to be SIGKILLed.
CRASH_HOOK: Callable[[str], None] | None = None


def _crash_point(stage: str) -> None:
    if CRASH_HOOK is not None:
        CRASH_HOOK(stage)


def vectors_name(generation: int) -> str:
    return f"vectors-{generation:08d}.faiss"


def bm25_name(generation: int) -> str:
    return f"bm25-{generation:08d}.npz"


class IndexLockedError(RuntimeError):
    """Another process holds the directory open for writing."""


@contextlib.contextmanager
def _built_aside(directory: Path) -> Iterator[Path]:
    """A temporary sibling of `directory` to fill; on success it is fsynced and renamed to `directory`.

    `directory` must not exist or be empty (a rename replaces an empty directory atomically on POSIX).
    On an error the temporary directory is removed and `directory` is left as it was.
    """
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory}: already exists and is not an empty directory")
    tmp = directory.parent / f"{directory.name}{TMP_MARKER}{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        yield tmp
        fsync_dir(tmp)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(directory.parent)


class IndexStore:
    """Documents, vectors and optional BM25 in one directory, committed together.

    Use ``IndexStore.create(...)`` for a new directory and ``IndexStore.open(...)`` for an
    existing one. As a context manager it commits on normal exit and rolls back on an
    exception; ``close()`` alone discards uncommitted changes.
    """

    def __init__(self, directory: Path, *, readonly: bool, mmap: bool) -> None:  # use create/open
        self.directory = directory
        self.readonly = readonly
        self._mmap = mmap
        self._lock_fd: int | None = None
        self._pending = False
        self._manifest_dirty = False
        self._bm25: BM25 | None = None
        self.manifest = Manifest.read(directory / MANIFEST_NAME)  # before locking: is it an index dir?
        if not readonly:
            self._lock()
        try:
            self.docstore = DocStore(directory / DOCS_NAME, readonly=readonly)
            self._load_generation()
        except BaseException:
            self.close()
            raise
        if not readonly:
            self._sweep()
            self._refresh_manifest()

    # ------------------------------------------------------------------ create / open
    @classmethod
    def create(
        cls,
        directory: str | os.PathLike,
        dim: int,
        factory: str | None = None,
        metric: Metric = "cosine",
        *,
        expected_size: int | None = None,
        bm25: bool | Mapping[str, Any] = False,
        extra: Mapping[str, Any] | None = None,
        **vector_options: Any,
    ) -> IndexStore:
        """Create a new index directory (atomically: built aside, then renamed into place).

        ``factory=None`` uses ``auto_factory(expected_size, dim)``. ``bm25`` is ``True`` for
        the default BM25 or a dict of ``BM25`` arguments. ``vector_options`` go to
        ``VectorIndex`` (``ef_search``, ``nprobe``, ``train_sample``, …). ``directory`` must
        not exist or be empty.
        """
        directory = Path(directory)
        vectors = VectorIndex(dim, factory, metric, expected_size=expected_size, **vector_options)
        bm25_args = (dict(bm25) if isinstance(bm25, Mapping) else {}) if bm25 else None
        if bm25_args is not None:
            BM25(**bm25_args)  # validate the arguments now
        with _built_aside(directory) as tmp:
            vectors.save(tmp / vectors_name(0))
            with DocStore(tmp / DOCS_NAME) as docs:
                docs.set_meta("generation", "0")
            if bm25_args is not None:
                BM25(**bm25_args).save(tmp / bm25_name(0))
            (tmp / LOCK_NAME).touch()
            Manifest(
                dim=vectors.dim,
                metric=metric,
                factory=vectors.factory,
                bm25=bm25_args,
                extra=dict(extra or {}),
            ).write(tmp / MANIFEST_NAME)
        return cls(directory, readonly=False, mmap=True)

    @classmethod
    def open(cls, directory: str | os.PathLike, *, readonly: bool = False, mmap: bool = True) -> IndexStore:
        """Open an existing directory at its last committed generation.

        A writer (``readonly=False``) takes an exclusive lock and deletes leftovers of an
        interrupted commit. A reader pins the SQLite snapshot it opened, so documents and
        vectors stay consistent until ``refresh()``. ``mmap`` maps the vector file.
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: index directory not found")
        return cls(directory, readonly=readonly, mmap=mmap)

    def _lock(self) -> None:
        if fcntl is None:  # pragma: no cover
            return
        fd = os.open(self.directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise IndexLockedError(f"{self.directory}: open for writing by another process") from None
        self._lock_fd = fd

    def _load_generation(self, attempts: int = 5) -> None:
        """Read the committed generation and load its vector file (retrying if a writer moved on)."""
        for attempt in range(attempts):
            if self.readonly:
                self.docstore.rollback()
                self.docstore.begin(write=False)  # pin one snapshot for docs and generation
            gen = self.docstore.get_meta("generation")
            if gen is None or not gen.isdigit():
                raise IndexFormatError(self.docstore.path, f"missing or invalid 'generation' ({gen!r})")
            path = self.directory / vectors_name(int(gen))
            try:
                vectors = VectorIndex.load(path, mmap=self._mmap)
                break
            except FileNotFoundError:
                if not self.readonly or attempt == attempts - 1:
                    raise IndexFormatError(
                        path, "vector file of the committed generation is missing"
                    ) from None
        m = self.manifest
        if (vectors.dim, vectors.metric) != (m.dim, m.metric):
            raise IndexFormatError(
                path,
                f"holds dim={vectors.dim} metric={vectors.metric}, manifest says dim={m.dim} metric={m.metric}",
            )
        n_docs = self.docstore.count()
        if n_docs != len(vectors):
            raise IndexFormatError(
                path, f"holds {len(vectors)} vectors but {DOCS_NAME} holds {n_docs} documents"
            )
        self.generation = int(gen)
        self.vectors = vectors
        self._bm25 = None

    def _sweep(self) -> None:
        """Delete files no committed generation names: interrupted commits and temp files."""
        for p in self.directory.iterdir():
            vm, bm = _VECTORS_RE.match(p.name), _BM25_RE.match(p.name)
            stale = (vm and int(vm.group(1)) != self.generation) or (
                bm and int(bm.group(1)) != self.generation
            )
            if stale or TMP_MARKER in p.name:
                logger.info("removing stale %s", p)
                p.unlink(missing_ok=True)

    def _refresh_manifest(self, force: bool = False) -> None:
        counts = {
            "documents": len(self.vectors),  # equal by construction (checked at open)
            "vectors": len(self.vectors),
            "tombstones": self.vectors.tombstone_count,
        }
        m = self.manifest
        if force or self._manifest_dirty or m.counts != counts or m.generation != self.generation:
            m.counts, m.generation = counts, self.generation
            m.write(self.directory / MANIFEST_NAME)
            self._manifest_dirty = False

    def refresh(self) -> bool:
        """Reader: move to the newest committed generation; returns whether it changed."""
        if not self.readonly:
            raise ValueError("refresh() is for readers; a writer always sees its own state")
        old = self.generation
        self._load_generation()
        return self.generation != old

    # ------------------------------------------------------------------ staging
    def _check_writable(self) -> None:
        if self.readonly:
            raise ValueError(f"{self.directory}: opened read-only; to change it, open it with readonly=False "
                             "(SearchPipeline.load(..., readonly=False) or IndexStore.open(..., readonly=False))")
        if self._lock_fd is None and fcntl is not None:
            raise ValueError(f"{self.directory}: store is closed")

    def _begin(self) -> None:
        if not self.docstore.in_transaction:
            self.docstore.begin()

    def add(
        self,
        docs: Sequence[Mapping[str, Any]],
        vectors: np.ndarray,
        *,
        on_duplicate: Literal["error", "skip", "replace"] = "error",
    ) -> int:
        """Stage documents and their vectors (N, D); visible to this store at once, durable at ``commit()``.

        Returns how many documents were added (or replaced). Both parts change or neither.
        """
        self._check_writable()
        rows = [as_document(d, f"docs[{j}]") for j, d in enumerate(docs)]
        vectors = np.asarray(vectors)
        if vectors.ndim != 2 or vectors.shape[0] != len(rows):
            raise ValueError(
                f"add: {len(rows)} documents need vectors of shape ({len(rows)}, D), got {vectors.shape}"
            )
        if vectors.shape[1] != self.manifest.dim:
            raise ValueError(
                f"add: vectors have dimension {vectors.shape[1]} but this index holds dimension {self.manifest.dim}"
            )
        if on_duplicate == "skip":
            keep = [j for j, c in enumerate(self.docstore.contains_many([d["id"] for d in rows])) if not c]
            rows, vectors, on_duplicate = [rows[j] for j in keep], vectors[keep], "error"
        if not rows:
            return 0
        bm25 = self._bm25_for_change()
        self._begin()
        with self.docstore.transaction():  # a savepoint: undone if the vectors are refused
            replaced = [
                d["id"] for d, c in zip(rows, self.docstore.contains_many([d["id"] for d in rows])) if c
            ]
            self.docstore.add(rows, on_duplicate=on_duplicate)
            self.vectors.add([d["id"] for d in rows], vectors, on_duplicate=on_duplicate)
        if bm25 is not None:
            bm25.delete(replaced)
            bm25.add([d["id"] for d in rows], [document_text(d) for d in rows])
        self._pending = True
        return len(rows)

    def delete(self, ids: Iterable[str]) -> list[str]:
        """Stage deletion of ``ids``; returns the ids that were not present (nothing else happens to them)."""
        self._check_writable()
        ids = list(dict.fromkeys(ids))
        bm25 = self._bm25_for_change()
        self._begin()
        with self.docstore.transaction():
            missing = self.docstore.delete(ids)
            vmissing = self.vectors.remove(ids)
            if set(missing) != set(vmissing):
                raise IndexFormatError(self.directory, "documents and vectors disagree about which ids exist")
        if bm25 is not None:
            bm25.delete(ids)
        if len(missing) < len(ids):
            self._pending = True
        return missing

    def train(self, vectors: np.ndarray) -> None:
        """Train an IVF/PQ index on a sample before the first ``add`` (no-op when trained)."""
        self._check_writable()
        self.vectors.train(vectors)

    def set_extra(self, **values: Any) -> None:
        """Update the manifest's free-form ``extra`` object (written at the next ``commit()``)."""
        self._check_writable()
        self.manifest.extra.update(values)
        self._manifest_dirty = True

    @property
    def has_pending(self) -> bool:
        return self._pending

    # ------------------------------------------------------------------ commit / rollback
    def commit(self) -> int:
        """Make staged changes durable (protocol in the module docstring); returns the generation."""
        self._check_writable()
        if self._pending:
            new_gen = self.generation + 1
            _crash_point("before_vectors")
            self.vectors.save(self.directory / vectors_name(new_gen))
            _crash_point("vectors_written")
            self._begin()
            self.docstore.set_meta("generation", str(new_gen))
            self.docstore.commit()  # <- the commit point
            self.generation = new_gen
            self._pending = False
            _crash_point("sqlite_committed")
            self._sweep()
        self._refresh_manifest()
        _crash_point("manifest_written")
        if self._bm25 is not None and not (self.directory / bm25_name(self.generation)).exists():
            self._bm25.save(self.directory / bm25_name(self.generation))
        return self.generation

    def rollback(self) -> None:
        """Discard staged changes and return to the last committed generation."""
        self._check_writable()
        self.docstore.rollback()
        if self._pending:
            self._load_generation()
        self._pending = False

    # ------------------------------------------------------------------ copying
    def copy_to(self, target: str | os.PathLike) -> Path:
        """Write a complete copy of the last committed generation to a new directory `target`, atomically.

        Copies the manifest, the SQLite documents (with their write-ahead log), the vector file and
        the BM25 cache of this generation; staged changes are not copied (``commit()`` first).
        `target` must not exist or be empty; it is built beside itself and renamed into place.
        This store keeps working on its own directory.
        """
        target = Path(target)
        names = [MANIFEST_NAME, DOCS_NAME, DOCS_NAME + "-wal", vectors_name(self.generation),
                 bm25_name(self.generation)]
        with _built_aside(target) as tmp:
            for name in names:
                if (self.directory / name).exists():
                    shutil.copy2(self.directory / name, tmp / name)
            (tmp / LOCK_NAME).touch()
        return target

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.vectors)

    def contains_many(self, ids: Sequence[str]) -> list[bool]:
        """Whether each id is present (staged changes included for the writer)."""
        return self.docstore.contains_many(ids)

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """Documents by id, in order (``None`` for unknown ids, e.g. the ``""`` padding)."""
        return self.docstore.get(ids)

    def search(self, queries: np.ndarray, k: int = 10, **params: Any) -> SearchResult:
        """Dense search (see ``VectorIndex.search``); queries (Q, D)."""
        return self.vectors.search(queries, k, **params)

    @property
    def bm25(self) -> BM25 | None:
        """The BM25 index (loaded or rebuilt from the documents on first use), or None when disabled."""
        if self.manifest.bm25 is None:
            return None
        if self._bm25 is None:
            path = self.directory / bm25_name(self.generation)
            if path.exists() and not self._pending:
                self._bm25 = BM25.load(path)
            else:  # absent (interrupted or lazy commit) or staged changes: rebuild from the documents
                bm = BM25(**self.manifest.bm25)
                for batch in self.docstore.iter_batches(5000):
                    bm.add([d["id"] for d in batch], [document_text(d) for d in batch])
                self._bm25 = bm
        return self._bm25

    def _bm25_for_change(self) -> BM25 | None:
        """The BM25 to update in step with a change: only one already in memory.

        If none is loaded, nothing is done now; the next ``bm25`` access rebuilds it from
        the documents (which include the staged change), keeping bulk builds cheap.
        """
        return self._bm25

    def search_bm25(self, queries: Sequence[str], k: int = 10) -> SearchResult:
        """Lexical search over title + text; ValueError if the store was created without BM25."""
        bm = self.bm25
        if bm is None:
            raise ValueError(f"{self.directory}: created without BM25, which hybrid search needs; build it with "
                             "bm25=True (SearchPipeline.build(..., bm25=True) or IndexStore.create(..., bm25=True))")
        return bm.search(queries, k)

    def info(self) -> dict[str, Any]:
        """A JSON-able summary (for ``twotower index info``)."""
        return {
            "directory": str(self.directory),
            "generation": self.generation,
            "documents": self.docstore.count(),
            "vectors": len(self.vectors),
            "tombstones": self.vectors.tombstone_count,
            "dim": self.manifest.dim,
            "metric": self.manifest.metric,
            "factory": self.manifest.factory,
            "bm25": self.manifest.bm25,
            "extra": self.manifest.extra,
            "pending": self._pending,
        }

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the lock and the database; uncommitted changes are discarded."""
        docstore = getattr(self, "docstore", None)
        if docstore is not None and not docstore.closed:
            if self._pending:
                logger.warning("%s: closing with uncommitted changes; they are discarded", self.directory)
            docstore.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None and not self.readonly and self._lock_fd is not None:
                self.commit()
        finally:
            self.close()

    def __repr__(self) -> str:
        return f"IndexStore({str(self.directory)!r}, generation={self.generation}, docs={len(self)})"
