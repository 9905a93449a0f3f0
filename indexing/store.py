"""A transactional on-disk index directory: documents + vectors (+ BM25) that change together.

Layout of ``<dir>/`` (docs/formats.md has the field-by-field description)::

    manifest.json                 what this is (format, dim, metric, factory, counts, extra)
    docs.sqlite                   documents, the commit record and the committed ``generation``
    seg-<seq>-<token>.faiss       vector segments (immutable; FAISS file + id-map trailer)
    bm25-<generation>.npz         BM25 of that generation (a derived cache; rebuilt if absent)
    LOCK                          flock'ed by the one writer

Vectors live in append-only *segments* (``twotower.indexing.segments``): a commit writes the
vectors added since the last one as one new segment file, records deletions as rows of a
``tombstones`` table, and now and then merges segments (a log-structured merge policy), so
what a commit writes is proportional to its change, not to the index.

Commit protocol (``commit()``): changes are staged — documents inside an open SQLite
transaction, vectors in memory. Commit writes the new segment file(s) atomically (temp,
fsync, rename, under names never used before), then in the *same* SQLite transaction that
holds the staged documents records them (``segments``, ``tombstones``, with each file's
size, SHA-256 and id digest), sets ``generation = g+1`` and commits. That single SQLite
commit is the commit point. The BM25 cache of ``g+1`` (when the writer has BM25 loaded, which
``add`` and ``delete`` see to) is written before it too, atomically, and its SHA-256 recorded in the
same transaction: a reader that sees ``g+1`` finds its cache (written after the commit point, a
reader that refreshed in between rebuilt BM25 from every document, on its own thread):

* killed before it → SQLite rolls everything back, ``generation`` is still ``g``, and the new
  segment files and BM25 cache are strays that the next writable ``open`` deletes (``index check``
  reads only the files the commit names, so it ignores them as it ignores stray segments);
* killed after it → generation ``g+1`` is complete; segment files it no longer names (merged
  away), the previous BM25 cache and the manifest counts are tidied after the commit or by the
  next ``open``.

So a directory always opens with exactly the documents and vectors of the last completed
commit (tests/indexing/test_store_crash.py kills real processes at each step).

Readers never fail because a writer moved on (why it is race-free): a reader pins one
SQLite snapshot (generation ``g`` and its segment list) and opens the files it names. Segment
files are immutable and their names are never reused, so a file that opens is the file the
record describes (its size, id digest and — up to 16 MiB — SHA-256 are checked). The writer
deletes a file only *after* committing a generation that no longer names it, so if a file of
``g`` is missing, a generation newer than ``g`` is committed: the reader drops its snapshot,
pins the newest one and tries again. If the newest generation still names a missing file, no
writer explains it and the reader reports the damage. A file, once opened (read or mapped),
stays readable after it is unlinked (POSIX), so a snapshot never changes under a search.
A retry reuses the segments it already opened, and a writer keeps the files it merged away
for ``RETAIN_SECONDS`` (deleting them at the next commit after that, or when it closes), so
a reader rarely needs to retry at all — the retry is what makes it correct, the delay what
keeps a slow reader from starving while merges keep coming. The previous generation's BM25
cache (only that one) is kept as long, for a reader of that generation that has not loaded it
yet; one that finds it gone (or sees it vanish while it opens it) rebuilds BM25 from its own
snapshot's documents.
``refresh()`` builds the new snapshot beside the old one and swaps it in; searches that hold
the old one (``snapshot()``) finish on it, and its SQLite connection closes with the last.

Threads: reads (``search``, ``get``, ``snapshot()``, ``refresh()``) may be shared by threads;
changes (``add``, ``delete``, ``commit``) are one writer's, from one thread at a time.

New directories (``create``, ``copy_to``) are built beside their target and renamed into
place, so a target path holds either nothing or a whole index. Bulk builds from a corpus
(encode in resumable shards, then one commit) are ``twotower.retrieval.build``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np

from twotower.common.atomic import TMP_MARKER, fsync_dir
from twotower.common.documents import document_records
from twotower.common.errors import refuse_keywords
from twotower.common.file_lock import LOCK_WAIT_S, check_lock_wait, try_lock
from twotower.common.ids import id_list
from twotower.common.paths import path_argument
from twotower.indexing.bm25 import BM25, document_text
from twotower.indexing.docstore import DocStore, Document, _checked_row, _index_rows, _not_passage_row
from twotower.indexing.errors import IndexDiskFullError, IndexFormatError
from twotower.indexing.filters import Filter, as_filter
from twotower.indexing.integrity import file_sha256, hex64, set_digest
from twotower.indexing.manifest import MANIFEST_NAME, Manifest
from twotower.indexing.milvus import MilvusSpec
from twotower.indexing.search_result import SearchResult, check_k, is_count, padded, tie_at_cut, ties_by_id
from twotower.indexing.segments import (
    HASH_ON_OPEN_MAX,
    VECTOR_OPTIONS,
    MergePolicy,
    Segment,
    Segments,
    SegmentVanished,
    load_segment,
)
from twotower.indexing.vector_index import Metric, VectorIndex
from twotower.indexing.vectors import VectorBackend

logger = logging.getLogger(__name__)

DOCS_NAME = "docs.sqlite"
LOCK_NAME = "LOCK"
LAYOUT = "segments-1"  # meta 'vector_layout'; absent in directories written before segments
_VECTORS_RE = re.compile(r"^vectors-(\d+)\.faiss$")  # the one-file layout of earlier versions
_SEGMENT_RE = re.compile(r"^seg-\d{8}-[0-9a-f]{8}\.faiss$")
_BM25_RE = re.compile(r"^bm25-(\d+)\.npz$")
OPEN_ATTEMPTS = 100  # a reader retries this often while a writer keeps replacing the files it was opening
FILTER_CACHE = 16  # filters whose allowed ids a reader's snapshot keeps (Snapshot.allowed_ids)
RETAIN_SECONDS = 10.0  # a writer keeps the segment files it merged away this long (see IndexStore._sweep)

Verify = Literal["none", "ids", "full"]

# Test seam: called with a stage name at each step of commit(); the crash tests set it to
# a function that signals the parent process and waits to be SIGKILLed.
CRASH_HOOK: Callable[[str], None] | None = None


def _crash_point(stage: str) -> None:
    if CRASH_HOOK is not None:
        CRASH_HOOK(stage)


def vectors_name(generation: int) -> str:
    """The vector file of a generation in the one-file layout of earlier versions (still read)."""
    return f"vectors-{generation:08d}.faiss"


def bm25_name(generation: int) -> str:
    return f"bm25-{generation:08d}.npz"


_DISK_FULL_TEXTS = ("no space left on device", "database or disk is full", "disk quota exceeded")


def _bm25_args(bm25: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """``IndexStore.create``'s `bm25` as the manifest records it (None: no BM25), validated now."""
    args = (dict(bm25) if isinstance(bm25, Mapping) else {}) if bm25 else None
    if args is not None:
        BM25(**args)  # a bad argument fails before anything is written
    return args


def recorded_vector_options(docs: DocStore) -> dict[str, Any]:
    """The vector options `docs` records (a JSON object; {} when it records none).

    Raises IndexFormatError naming docs.sqlite when the entry is damaged. Why: ``{bad`` was a JSONDecodeError
    naming no file, and ``[1]`` a TypeError traceback out of ``index check``.
    """
    text = docs.get_meta("vector_options") or "{}"
    try:
        options = json.loads(text)
    except ValueError:
        options = None
    if not isinstance(options, dict):
        raise IndexFormatError(docs.path, f"its 'vector_options' entry is damaged (not a JSON object: {text[:40]!r})")
    return options


def vector_options(docs: DocStore, manifest: Manifest, manifest_path: Path) -> dict[str, Any]:
    """The vector options `docs` records, less dim, metric and factory, which must be the manifest's.

    Raises IndexFormatError naming manifest.json where they differ (docs.sqlite where its entry is damaged,
    `recorded_vector_options`). Why one function: opening an index
    and ``index check`` must blame the same file (the check blamed the segments for an edited manifest).
    """
    options = recorded_vector_options(docs)
    m = manifest
    described = options.pop("dim", m.dim), options.pop("metric", m.metric), options.pop("factory", m.factory)
    if described != (m.dim, m.metric, m.factory):
        raise IndexFormatError(manifest_path,
                               f"manifest says dim={m.dim} metric={m.metric} factory={m.factory}, but {DOCS_NAME} "
                               f"records dim={described[0]} metric={described[1]} factory={described[2]} (the "
                               "manifest was edited or belongs to another index)")
    return options


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) says the disk is full: OSError ENOSPC / EDQUOT,
    SQLite's "database or disk is full", FAISS's RuntimeError quoting strerror."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(e).lower() for text in _DISK_FULL_TEXTS):
            return True
        e = e.__cause__ or e.__context__
    return False


class IndexLockedError(RuntimeError):
    """Another process holds the directory open for writing."""


_T = TypeVar("_T")


def wait_for_lock(open_writer: Callable[[], _T], wait_s: float = LOCK_WAIT_S,
                  stop: Callable[[], bool] = lambda: False) -> _T:
    """`open_writer()` (it opens an index for writing), retried while another writer holds the index's lock.

    Why: writers take turns on the lock for the length of one commit (`twotower serve` between its writes,
    `twotower index add`); failing at once made a write collide with one that would finish in a second.
    Gives up with the last `IndexLockedError` after `wait_s` seconds, or as soon as `stop()` is true;
    ValueError when `wait_s` is not a finite number >= 0 (NaN never reached its deadline).
    """
    wait_s = check_lock_wait(wait_s, "wait_s")
    deadline = time.monotonic() + wait_s
    delay = 0.02
    while True:
        try:
            return open_writer()
        except IndexLockedError:
            left = deadline - time.monotonic()
            if left <= 0 or stop():
                raise
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.5)


_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)

# directories this process holds the write lock of, so that a second writer here is told it is its own
_WRITING_HERE: set[Path] = set()


def _release_lock(fd: int, held: Path) -> None:
    _WRITING_HERE.discard(held)
    os.close(fd)


class IndexNotWritableError(OSError):
    """The directory cannot be written (read-only storage, or no permission): it can be searched, not changed.

    Why its own type: the writer's first write is its lock file, and the bare OSError of that open was a
    traceback; callers name their own flag (``--index DIR``) in front of this message.
    """

    def __init__(self, directory: Path, cause: OSError) -> None:
        why = cause.strerror.lower() if cause.strerror else str(cause)
        super().__init__(cause.errno, f"{directory}: not writable ({why}); it can be searched but not changed "
                                      "here: copy it to writable storage to change it")

    def __str__(self) -> str:
        return str(self.strerror)


Occupant = Literal["file", "index", "empty index", "empty milvus index", "being written", "directory"]


def _being_written(directory: Path) -> bool:
    """Whether a writer holds `directory`'s lock now: an `IndexStore` of this process (`_WRITING_HERE`), or another
    process (the lock file's flock, probed and let go at once; a lock file that cannot be opened tells nothing)."""
    if directory.resolve() in _WRITING_HERE:
        return True
    lock = directory / LOCK_NAME
    if not lock.is_file():
        return False
    try:
        fd = try_lock(lock)
    except OSError:
        return False
    if fd is None:
        return True
    os.close(fd)
    return False


def occupant(directory: str | os.PathLike[str]) -> Occupant | None:
    """What is at `directory` that a new index must not replace, or None (nothing, or an empty directory).

    ``"empty index"`` is an index at generation 0 that no writer holds: nothing was ever committed to it, as a
    ``with IndexStore.create(...)`` block that raised before its first commit leaves it. Read from
    ``docs.sqlite`` (the commit point), not the manifest, which is refreshed after a commit and could still say
    0. ``"being written"``: at generation 0 with its lock held, a writer staging its first commit (removing
    the directory would delete that work). ``"empty milvus index"``: empty, but its vectors go to a Milvus
    collection (removing the directory leaves staged rows there, which a new create then refuses).
    ``"directory"``: anything else, a manifest without ``docs.sqlite`` too (someone's own files);
    ``"index"``: an index with commits, or whose ``docs.sqlite`` cannot be read.

    Why one function: ``IndexStore.create``, ``SearchPipeline.build`` (before and under its lock) and
    ``twotower index build`` told the cases apart each with its own copy; each caller now phrases the
    case in its own words (Python calls, or command-line flags).
    """
    path = Path(directory)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return None
    if not path.is_dir():
        return "file"
    if not (path / MANIFEST_NAME).is_file() or not (path / DOCS_NAME).is_file():
        return "directory"
    try:
        with DocStore(path / DOCS_NAME, readonly=True) as docs:
            generation, milvus = docs.get_meta("generation"), docs.get_meta("milvus")
    except Exception:  # damaged or unreadable: an index all the same, never called empty
        return "index"
    if generation != "0":
        return "index"
    if _being_written(path):
        return "being written"
    return "empty index" if milvus is None else "empty milvus index"


# `IndexStore.create`'s refusal of each `occupant` case ({d}: the directory)
_CREATE_REFUSALS: dict[str, str] = {
    "file": "a file; give IndexStore.create the name of a new (or empty) directory",
    "index": "already an index; open it with IndexStore.open({d!r}) to change it, or remove the directory first",
    "empty index": ("already an index, empty at generation 0 (nothing was ever committed to it, as when the with "
                    "block of an earlier IndexStore.create raised before its first commit); open it with "
                    "IndexStore.open({d!r}), or remove the directory"),
    "empty milvus index": ("already an index, empty at generation 0, whose vectors go to a Milvus collection; open "
                           "it with IndexStore.open({d!r}) (removing the directory would leave its staged rows in "
                           "the collection, which a new IndexStore.create then refuses)"),
    "being written": ("an index another writer holds open and is writing its first commit to; leave it to that "
                      "writer and give IndexStore.create a new directory"),
    "directory": "a directory that is not empty; give IndexStore.create a new or empty directory",
}


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


# Search-time keywords of `IndexStore.search`, and the index kinds (`twotower.indexing.factory.index_kind`)
# each one tunes: given to another kind, it was passed on and ignored without a word (nprobe=4 on a Flat index).
SEARCH_OPTIONS = {"ef_search": "hnsw", "nprobe": "ivf"}

# From this k on, `Snapshot.search` counts the rows first and searches at most that many (padding the rest):
# a k far past the index's size (k=3_000_000 on four documents) cost seconds and hundreds of MB in padding.
COUNT_FROM_K = 1024


# what other libraries call the number of hits (`search_options`)
_K_NAMES = dict.fromkeys(("top_k", "topk", "limit", "n", "num", "size"), "the number of hits is k")


def search_options(vectors: VectorBackend, params: Mapping[str, Any]) -> dict[str, Any]:
    """The search keywords of ``search(**params)`` that apply to `vectors`' index (None values dropped).

    Why here: an unknown keyword failed deep in the backend, naming its class ("VectorIndex.search() got an
    unexpected keyword argument 'top_k'"), and a known one that the index kind has no use for was ignored.
    """
    refuse_keywords("search", {name: v for name, v in params.items() if name not in SEARCH_OPTIONS},
                    "queries, k, filter, and ef_search (HNSW) or nprobe (IVF)", _K_NAMES)
    out = {}
    for name, value in params.items():
        if value is None:
            continue
        if vectors.kind != SEARCH_OPTIONS[name]:
            raise ValueError(f"{name}={value!r}: {name} tunes the search of an {SEARCH_OPTIONS[name].upper()} index, "
                             f"but this index is {vectors.factory!r}; leave it out")
        if not is_count(value) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
        out[name] = int(value)
    return out


class Snapshot:
    """One commit as searched: its generation, vectors, documents and BM25, used together.

    A reader's snapshot is immutable and owns a SQLite connection pinned to its commit; it is
    shared by threads and closed when it has been replaced (``refresh``) and its last user is
    done. A writer has one snapshot whose state it changes in place (its staged changes).
    """

    def __init__(self, directory: Path, manifest: Manifest, generation: int, vectors: VectorBackend,
                 docstore: DocStore, *, owns_docstore: bool, writer: bool = False) -> None:
        self.directory = directory
        self.manifest = manifest
        self.generation = generation
        self.vectors = vectors
        self.docstore = docstore
        self._owns = owns_docstore
        self._writer = writer
        self._bm25: BM25 | None = None
        self._filter_cache: dict[Filter, frozenset[str]] = {}  # see allowed_ids
        self._lock = threading.RLock()
        self._users = 0
        self._retired = False
        self.pending = False  # writer only: staged changes exist

    # ------------------------------------------------------------------ lifetime
    def acquire(self) -> Snapshot:
        with self._lock:
            self._users += 1
        return self

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._retired and self._users == 0:
                self._close()

    def retire(self, now: bool = False) -> None:
        """No new users; closed when the last one releases it (or at once with ``now``)."""
        with self._lock:
            self._retired = True
            if now or self._users == 0:
                self._close()

    def _close(self) -> None:
        if self._owns and not self.docstore.closed:
            self.docstore.close()

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.vectors)

    def search(self, queries: np.ndarray, k: int = 10, *, filter: Filter | str | None = None,
               **params: Any) -> SearchResult:
        """Dense search (see ``VectorIndex.search``); queries (Q, D); ``ef_search`` (HNSW) and ``nprobe`` (IVF) as
        keywords override the index's search breadth for this call (`search_options`).

        ``filter`` (``twotower.indexing.filters``): only rows whose metadata passes it are hits,
        k of them whenever k exist. A backend that filters natively (Milvus) gets the ``Filter``;
        FAISS gets the allowed ids, resolved from this snapshot's documents (``allowed_ids``).

        Equal scores are ordered by document id, descending (trec_eval's order), and the hits of a
        smaller ``k`` are the first hits of a larger one: the backend is asked for one hit more, and
        deeper while documents tie across the cut, since which of them it keeps is its own choice.
        """
        k = check_k(k)
        if k > COUNT_FROM_K:  # a k deeper than the index: search the stored rows, pad once at the end
            n = max(1, len(self.vectors))  # counted only for a deep k (Milvus counts its rows in SQLite)
            if k > n:
                return padded(self.search(queries, n, filter=filter, **params), k)
        if params:
            params = search_options(self.vectors, params)
        flt = as_filter(filter)
        native = self.vectors.native_filters
        if flt is not None and native:
            flt.check_fields(self.docstore.metadata_fields())
        allowed = self.allowed_ids(flt) if flt is not None and not native else None
        cap = self.vectors.max_k
        fetch, most = (k + 1 if cap is None else min(k + 1, cap)), None
        while True:
            if flt is None:
                res = self.vectors.search(queries, fetch, **params)
            elif allowed is None:
                res = self.vectors.search(queries, fetch, filter=flt, **params)
            else:
                res = self.vectors.search(queries, fetch, allowed=allowed, filter=flt, **params)
            if fetch <= k or not tie_at_cut(res, k):
                return ties_by_id(res, k)
            if most is None:  # counted only when a tie crosses the cut (Milvus counts its rows in SQLite)
                most = max(k + 1, len(self.vectors))
                most = most if cap is None else min(most, cap)
            if fetch >= most:
                return ties_by_id(res, k)
            fetch = min(fetch * 2, most)

    def allowed_ids(self, flt: Filter) -> frozenset[str]:
        """Ids of the rows passing ``flt`` (FilterError for an unknown field).

        The set is cached per filter (the last ``FILTER_CACHE`` filters): a service answering many
        queries with one filter (a tenant, a language) scans the documents once, and the vector
        backend maps the same set object to its labels once too; one filtered search (row count,
        dense and BM25 recall) resolves it once. A reader's snapshot never changes; the writer's
        cache is dropped whenever its rows do (``rows_changed``).
        """
        with self._lock:
            hit = self._filter_cache.get(flt)
            if hit is not None:
                return hit
        ids = frozenset(self.docstore.matching_ids(flt))
        with self._lock:
            if len(self._filter_cache) >= FILTER_CACHE:
                self._filter_cache.pop(next(iter(self._filter_cache)))
            self._filter_cache[flt] = ids
        return ids

    def rows_changed(self) -> None:
        """The writer staged or discarded changes: filters are resolved again."""
        with self._lock:
            self._filter_cache.clear()

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """Documents by id, in order (``None`` for unknown ids, e.g. the ``""`` padding)."""
        return self.docstore.get(ids)

    def contains_many(self, ids: Sequence[str]) -> list[bool]:
        return self.docstore.contains_many(ids)

    @property
    def bm25(self) -> BM25 | None:
        """The BM25 index (loaded or rebuilt from the documents on first use), or None when disabled."""
        if self.manifest.bm25 is None:
            return None
        with self._lock:
            if self._bm25 is None and not self.pending:
                # No exists() first: a newer commit's sweep may remove the file between a check and the load.
                with contextlib.suppress(FileNotFoundError):
                    self._bm25 = BM25.load(self.directory / bm25_name(self.generation))
            if self._bm25 is None:  # absent (interrupted commit, swept) or staged changes: rebuild from the documents
                bm = BM25(**self.manifest.bm25)
                for batch in self.docstore.iter_batches(5000):
                    bm.add([d["id"] for d in batch], [document_text(d) for d in batch])
                self._bm25 = bm
            return self._bm25

    def search_bm25(self, queries: Sequence[str], k: int = 10, *,
                    filter: Filter | str | None = None) -> SearchResult:
        """Lexical search over title + text (``filter`` as in ``search``); ValueError if the store
        was created without BM25."""
        if isinstance(queries, (str, bytes)):  # BM25 named itself ("BM25.search: pass a list ..."), not this method
            raise TypeError("search_bm25 takes a list of query strings; wrap a single query in a list: "
                            f"search_bm25([{queries!r}])")
        k = check_k(k, "search_bm25: ")  # k=True reached numpy's TypeError
        bm = self.bm25
        if bm is None:
            raise ValueError(f"{self.directory}: created without BM25, which BM25 search (search_bm25, and BM25 or hybrid "
                             "recall) needs; build it with bm25=True (SearchPipeline.build(..., bm25=True) or "
                             "IndexStore.create(..., bm25=True); on the command line `twotower index build --bm25`)")
        flt = as_filter(filter)
        return bm.search(queries, k, allowed=None if flt is None else self.allowed_ids(flt))


class IndexStore:
    """Documents, vectors and optional BM25 in one directory, committed together.

    Use ``IndexStore.create(...)`` for a new directory and ``IndexStore.open(...)`` for an
    existing one. As a context manager it commits on normal exit and rolls back on an
    exception; ``close()`` alone discards uncommitted changes.
    """

    def __init__(self, directory: Path, *, readonly: bool, mmap: bool, verify: Verify = "ids") -> None:
        if verify not in ("none", "ids", "full"):
            raise ValueError(f"verify must be 'none', 'ids' or 'full', got {verify!r}")
        self.directory = directory
        self.readonly = readonly
        self._mmap = mmap
        self._verify = verify
        self._lock_fd: int | None = None
        self._manifest_dirty = False
        self._refresh_lock = threading.Lock()  # one refresh at a time
        self._swap_lock = threading.Lock()  # guards replacing / acquiring the current snapshot
        self._probe: DocStore | None = None
        self._writer_docs: DocStore | None = None
        self._snap: Snapshot | None = None
        self._retired: dict[str, float] = {}  # writer: segment files merged away, BM25 caches superseded -> when
        self._milvus_uri: str | None = None  # the Milvus client this store holds (released by close)
        # The generation this store last committed (None: nothing since it opened), set at the commit point itself,
        # so that whoever is interrupted later can say whether the change is in (the CLI's Ctrl-C message).
        self.last_commit: int | None = None
        self.manifest = Manifest.read(directory / MANIFEST_NAME)  # before locking: is it an index dir?
        if not readonly:
            self._lock()
        try:
            if readonly:
                self._snap = self._open_snapshot(None)
            else:
                self._writer_docs = DocStore(directory / DOCS_NAME)
                if self._writer_docs.get_meta("vector_layout") is None:
                    self._upgrade_layout()
                self._snap = self._writer_snapshot(None)
        except BaseException:
            self.close()
            raise
        if not readonly:
            try:
                self.vectors.repair()  # Milvus: rows of an interrupted commit; FAISS: nothing (the sweep)
            except BaseException:
                self.close()
                raise
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
        merge_policy: MergePolicy | None = None,
        milvus: MilvusSpec | None = None,
        **vector_options: Any,
    ) -> IndexStore:
        """Create a new index directory (atomically: built aside, then renamed into place).

        ``factory=None`` uses ``auto_factory(expected_size, dim)``. ``bm25`` is ``True`` for
        the default BM25 or a dict of ``BM25`` arguments. ``vector_options`` go to
        ``VectorIndex`` (``ef_search``, ``nprobe``, ``train_sample``, …). ``merge_policy``
        says when segments are merged (default ``MergePolicy()``). ``directory`` must not
        exist or be empty.

        ``milvus`` keeps the vectors in a Milvus collection instead of FAISS segment files
        (``twotower.indexing.milvus``; ``factory`` is then the Milvus index type, default FLAT).
        The collection is checked and created before anything is written here: an unreachable
        URI raises ``MilvusUnavailableError`` and leaves no directory behind.
        """
        directory = Path(path_argument(directory))
        # in create's words, for either backend (Milvus's had a check of its own); `_built_aside` checks again,
        # for a directory made meanwhile
        kind = occupant(directory)
        if kind is not None:
            raise FileExistsError(f"{directory}: {_CREATE_REFUSALS[kind].format(d=str(directory))}")
        if milvus is not None:
            return cls._create_milvus(directory, dim, factory, metric, bm25=bm25, extra=extra, spec=milvus,
                                      **vector_options)
        if factory is None and expected_size is None:  # VectorIndex named itself and its auto_factory
            raise ValueError("IndexStore.create: pass factory= (a FAISS factory string such as 'Flat' or 'HNSW32') "
                             "or expected_size= (how many vectors you expect; a factory is chosen for that size)")
        vectors = VectorIndex(dim, factory, metric, expected_size=expected_size, **vector_options)
        bm25_args = _bm25_args(bm25)
        policy = merge_policy or MergePolicy()
        options = {key: getattr(vectors, key) for key in VECTOR_OPTIONS}
        options.update(dim=vectors.dim, metric=metric, factory=vectors.factory)
        manifest = Manifest(dim=vectors.dim, metric=metric, factory=vectors.factory, bm25=bm25_args,
                            extra=dict(extra or {}))
        return cls._lay_out(directory, manifest, {"vector_layout": LAYOUT, "vector_options": json.dumps(options),
                                                  "merge_policy": json.dumps(asdict(policy))})

    @classmethod
    def _lay_out(cls, directory: Path, manifest: Manifest, meta: Mapping[str, str],
                 tables: Callable[[DocStore], None] | None = None) -> IndexStore:
        """Write an empty index (generation 0: documents, BM25, lock, manifest) aside, move it into place, open it."""
        with _built_aside(directory) as tmp:
            with DocStore(tmp / DOCS_NAME) as docs, docs.transaction():
                if tables is not None:
                    tables(docs)
                for key, value in {"generation": "0", "next_segment": "0", "ids_digest": hex64(0),
                                   "docs_digest": hex64(0), **meta}.items():
                    docs.set_meta(key, value)
            if manifest.bm25 is not None:
                BM25(**manifest.bm25).save(tmp / bm25_name(0))
            (tmp / LOCK_NAME).touch()
            manifest.write(tmp / MANIFEST_NAME)
        return cls(directory, readonly=False, mmap=True)

    @classmethod
    def _create_milvus(cls, directory: Path, dim: int, factory: str | None, metric: Metric, *,
                       bm25: bool | Mapping[str, Any], extra: Mapping[str, Any] | None, spec: MilvusSpec,
                       **vector_options: Any) -> IndexStore:
        from twotower.indexing import milvus as mv

        if metric not in mv.METRICS:
            raise ValueError(f"metric must be one of {sorted(mv.METRICS)}, got {metric!r}")
        unknown = set(vector_options) - set(VECTOR_OPTIONS)
        if unknown:
            raise ValueError(f"IndexStore.create: unknown vector options {sorted(unknown)}")
        index_type = mv.check_index_type(factory)
        bm25_args = _bm25_args(bm25)
        if not spec.owner:
            spec = dataclasses.replace(spec, owner=os.path.abspath(directory))
        mv.check_target(spec, dim, metric, create=True, index_type=index_type)  # before any local file
        options = {key: vector_options.get(key) for key in VECTOR_OPTIONS}
        options.update(dim=dim, metric=metric, factory=index_type)
        manifest = Manifest(dim=dim, metric=metric, factory=index_type, bm25=bm25_args, extra=dict(extra or {}),
                            backend="milvus", milvus=spec.record())
        return cls._lay_out(directory, manifest, {"vector_layout": mv.LAYOUT, "vector_options": json.dumps(options),
                                                  "milvus": json.dumps(spec.record(), sort_keys=True),
                                                  "milvus_ids_digest": hex64(0)}, tables=mv.ensure_tables)

    @classmethod
    def open(cls, directory: str | os.PathLike, *, readonly: bool = False, mmap: bool = True,
             verify: Verify = "ids") -> IndexStore:
        """Open an existing directory at its last committed generation.

        A writer (``readonly=False``) takes an exclusive lock and deletes leftovers of an
        interrupted commit. A reader pins the SQLite snapshot it opened, so documents and
        vectors stay consistent until ``refresh()``. ``mmap`` maps the vector files.
        ``verify``: ``"ids"`` (default) checks that the documents' ids, the vector files' id
        maps and the commit record agree, and the SHA-256 of segment files up to 16 MiB;
        ``"full"`` hashes every file; ``"none"`` checks counts only.
        """
        directory = Path(path_argument(directory))
        if not directory.is_dir():
            raise FileNotFoundError(f"{directory}: index directory not found")
        return cls(directory, readonly=readonly, mmap=mmap, verify=verify)

    def _lock(self) -> None:
        try:
            fd = try_lock(self.directory / LOCK_NAME)
        except OSError as e:
            if e.errno not in _NOT_WRITABLE:
                raise
            raise IndexNotWritableError(self.directory, e) from None
        if fd is None:
            if self.directory.resolve() in _WRITING_HERE:  # flock conflicts between two descriptors of one process
                raise IndexLockedError(f"{self.directory}: already open for writing by another IndexStore of this "
                                       "process: close that one first, or open this one with readonly=True")
            raise IndexLockedError(f"{self.directory}: open for writing by another process")
        self._lock_fd = fd
        held = self.directory.resolve()
        _WRITING_HERE.add(held)
        # a writer dropped without close() must not keep the directory locked for the rest of the process
        self._unlock = weakref.finalize(self, _release_lock, fd, held)

    # ------------------------------------------------------------------ loading a commit
    def _hash_max(self) -> int | None:
        return None if self._verify == "full" else (HASH_ON_OPEN_MAX if self._verify == "ids" else 0)

    def _load_vectors(self, docs: DocStore, previous: Snapshot | None,
                      loaded: dict[str, Segment] | None = None) -> tuple[int, VectorBackend]:
        """The committed generation and its segments, as the (pinned) ``docs`` connection sees them.

        Segments of `previous` are reused, not read again; `loaded` collects every segment read, so a
        retry after a vanished file reads only the files that are new since (they are immutable).
        """
        gen = docs.get_meta("generation")
        if gen is None or not gen.isdigit():
            raise IndexFormatError(docs.path, f"missing or invalid 'generation' ({gen!r})")
        options = vector_options(docs, self.manifest, self.directory / MANIFEST_NAME)
        m = self.manifest
        if m.backend == "milvus" or docs.get_meta("milvus") is not None:
            return int(gen), self._load_milvus(docs, int(gen), options)
        policy = MergePolicy(**json.loads(docs.get_meta("merge_policy") or "{}"))
        reuse = {s.name: s for s in previous.vectors.segments} if previous is not None else {}
        if loaded is not None:
            reuse.update(loaded)
        if docs.get_meta("vector_layout") is None:  # one vectors-<gen>.faiss file (earlier versions)
            rows = [self._legacy_record(int(gen))]
        else:
            rows = docs.segment_rows() or []
        tombs = docs.tombstone_ids()
        segments = []
        for rec in rows:
            seg = load_segment(self.directory, rec, mmap=self._mmap, hash_max=self._hash_max(),
                               reuse=reuse.get(rec["name"]))
            if loaded is not None:
                loaded[rec["name"]] = seg
            hidden = tombs.pop(rec["name"], [])
            if seg.index.hide(hidden):
                raise IndexFormatError(docs.path, f"tombstones name ids that segment {rec['name']} does not hold")
            segments.append(seg)
        if tombs:
            raise IndexFormatError(docs.path, f"tombstones name segments that are not committed: {sorted(tombs)[:3]}")
        m = self.manifest
        for seg in segments:
            if (seg.base.dim, seg.base.metric) != (m.dim, m.metric):
                raise IndexFormatError(self.directory / seg.name, f"holds dim={seg.base.dim} metric={seg.base.metric}, "
                                                                  f"manifest says dim={m.dim} metric={m.metric}")
        if not options and segments:
            options = {key: getattr(segments[0].base, key, None) for key in VECTOR_OPTIONS}
        return int(gen), Segments(m.dim, m.factory, m.metric, options, segments, policy)  # type: ignore[arg-type]

    def _load_milvus(self, docs: DocStore, gen: int, options: dict[str, Any]) -> VectorBackend:
        """The Milvus collection the commit record names, checked against the manifest and the collection."""
        from twotower.indexing import milvus as mv

        m, where = self.manifest, self.directory / MANIFEST_NAME
        record = json.loads(docs.get_meta("milvus") or "null")
        if m.backend != "milvus" or record != m.milvus:
            raise IndexFormatError(where, f"manifest says backend={m.backend} milvus={m.milvus}, but {DOCS_NAME} "
                                          f"records milvus={record} (the manifest was edited or belongs to "
                                          "another index)")
        if self._milvus_uri is None:  # once per store: each refresh loads the collection again
            mv.hold(record["uri"])
            self._milvus_uri = record["uri"]
        client = mv.open_collection(record, m.dim, m.metric, where)
        return mv.MilvusVectors(client, record, m.dim, m.metric, m.factory, options, docs, gen,
                                writer=not self.readonly)

    def _legacy_record(self, gen: int) -> dict[str, Any]:
        """A commit record for the single vector file of the earlier layout (no checksum was recorded)."""
        name = vectors_name(gen)
        path = self.directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise SegmentVanished(name) from None
        from twotower.indexing.vector_file import read_state

        state = read_state(path)
        stored = sum(i is not None for i in state["ids_by_label"]) + len(state["tombstones"])
        return {"name": name, "seq": 0, "stored": stored, "bytes": size, "sha256": "", "ids_digest": ""}

    def _check_agreement(self, docs: DocStore, vectors: VectorBackend, scan: bool = True) -> None:
        """Documents and vectors hold the same ids, and the ones committed (raise naming the file otherwise).

        ``scan=False`` (a reader's ``refresh``) compares the vectors with the digest the writer recorded
        instead of re-reading every id from SQLite: O(change) rather than O(index) per refresh; a row
        changed outside twotower is still caught by the next ``open`` and by ``twotower index check``.
        """
        n_docs = docs.count()
        if n_docs != len(vectors):
            raise IndexFormatError(
                self.directory, f"the vector segments hold {len(vectors)} vectors but {DOCS_NAME} holds {n_docs} "
                                "documents"
            )
        if self._verify == "none":
            return
        recorded, _ = docs.recorded_digests()
        now = docs.ids_digest_now() if scan or recorded is None else recorded
        if recorded is not None and now != recorded:
            raise IndexFormatError(docs.path, "the document ids are not the ones committed (a row was replaced or "
                                              "renamed outside twotower); run `twotower index check`")
        if vectors.digest() != now:
            raise IndexFormatError(self.directory, f"the ids of the vector segments differ from the ids in "
                                                   f"{DOCS_NAME}; run `twotower index check`")

    def _open_snapshot(self, previous: Snapshot | None) -> Snapshot:
        """Reader: pin the newest commit and load it; retry when a writer removed a file meanwhile."""
        vanished: tuple[int, str] | None = None
        loaded: dict[str, Segment] = {}
        for _attempt in range(OPEN_ATTEMPTS):
            docs = DocStore(self.directory / DOCS_NAME, readonly=True)
            try:
                docs.begin(write=False)  # one snapshot for documents, generation and segment list
                raw = docs.get_meta("generation")
                gen = int(raw) if raw is not None and raw.isdigit() else -1  # an invalid one fails in _load_vectors
                if vanished is not None and vanished[0] == gen:
                    raise IndexFormatError(self.directory / vanished[1],
                                           "vector file of the committed generation is missing")
                gen, vectors = self._load_vectors(docs, previous, loaded)
                self._check_agreement(docs, vectors, scan=previous is None)
            except SegmentVanished as e:
                docs.close()
                vanished = (gen, str(e))
                logger.info("%s: %s of generation %d was removed by a newer commit; retrying on the newest",
                            self.directory, e, gen)
                continue
            except BaseException:
                docs.close()
                raise
            return Snapshot(self.directory, self.manifest, gen, vectors, docs, owns_docstore=True)
        raise IndexFormatError(self.directory, f"no consistent commit after {OPEN_ATTEMPTS} attempts: a writer "
                                               "replaced files faster than they could be opened")

    def _writer_snapshot(self, previous: Snapshot | None) -> Snapshot:
        docs = self._writer_docs
        assert docs is not None
        try:
            gen, vectors = self._load_vectors(docs, previous)
        except SegmentVanished as e:
            raise IndexFormatError(self.directory / str(e), "vector file of the committed generation is missing") from None
        self._check_agreement(docs, vectors)
        return Snapshot(self.directory, self.manifest, gen, vectors, docs, owns_docstore=False, writer=True)

    def _upgrade_layout(self) -> None:
        """Writer on a directory of the one-file layout: record its file as the first segment (one SQLite commit)."""
        docs = self._writer_docs
        assert docs is not None
        gen = docs.get_meta("generation")
        if gen is None or not gen.isdigit():
            raise IndexFormatError(docs.path, f"missing or invalid 'generation' ({gen!r})")
        try:
            rec = self._legacy_record(int(gen))
        except SegmentVanished as e:
            raise IndexFormatError(self.directory / str(e), "vector file of the committed generation is missing") from None
        path = self.directory / rec["name"]
        legacy = VectorIndex.load(path, mmap=True)
        rec.update(sha256=file_sha256(path), ids_digest=hex64(set_digest(legacy.ids())), seq=0)
        options = {key: getattr(legacy, key, None) for key in VECTOR_OPTIONS}
        options.update(dim=legacy.dim, metric=legacy.metric, factory=legacy.factory)
        with docs.transaction():
            if legacy.stored_count:
                docs.record_segments(add=[rec])
            ids_d, docs_d = docs.compute_digests()
            docs.set_meta("ids_digest", hex64(ids_d))
            docs.set_meta("docs_digest", hex64(docs_d))
            docs.set_meta("vector_options", json.dumps(options))
            docs.set_meta("merge_policy", json.dumps(asdict(MergePolicy())))
            docs.set_meta("next_segment", "1")
            docs.set_meta("vector_layout", LAYOUT)
        logger.info("%s: recorded %s as the first vector segment", self.directory, rec["name"])

    # ------------------------------------------------------------------ the current commit
    @property
    def generation(self) -> int:
        return self._current().generation

    @property
    def vectors(self) -> VectorBackend:
        """The vectors (FAISS segments or a Milvus collection, with staged changes for the writer)."""
        return self._current().vectors

    @property
    def docstore(self) -> DocStore:
        return self._current().docstore

    def _current(self) -> Snapshot:
        snap = self._snap
        if snap is None:
            raise ValueError(f"{self.directory}: store is closed")
        return snap

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Snapshot]:
        """The current commit, held for the block: its vectors and documents stay together.

        Searching threads use this so that a concurrent ``refresh()`` cannot give them the vectors of
        one commit and the documents of another; the snapshot is closed after its last user.
        """
        with self._swap_lock:  # refresh() swaps under this lock: a snapshot is never closed between get and acquire
            snap = self._current().acquire()
        try:
            yield snap
        finally:
            snap.release()

    def _sweep(self, grace: bool = False) -> None:
        """Delete files no committed generation names: interrupted commits, merged-away segments, temp files.

        With `grace`, segments this writer merged away and BM25 caches it superseded less than
        ``RETAIN_SECONDS`` ago are kept, so a reader still opening the previous generation finds them
        (readers retry, or rebuild BM25, anyway; this keeps a slow reader from having to while commits
        keep coming).
        """
        snap = self._current()
        keep = {s.name for s in snap.vectors.segments}
        now = time.monotonic()
        for p in self.directory.iterdir():
            vector_file = _SEGMENT_RE.match(p.name) or _VECTORS_RE.match(p.name)
            bm = _BM25_RE.match(p.name)
            if (vector_file or bm) and grace and now - self._retired.get(p.name, -RETAIN_SECONDS) < RETAIN_SECONDS:
                continue
            stale = (vector_file and p.name not in keep) or (bm and int(bm.group(1)) != snap.generation)
            if stale or TMP_MARKER in p.name:
                logger.info("removing stale %s", p)
                p.unlink(missing_ok=True)
                self._retired.pop(p.name, None)

    def _refresh_manifest(self, force: bool = False) -> None:
        vectors = self.vectors
        counts = {
            "documents": len(vectors),  # equal by construction (checked at open)
            "vectors": len(vectors),
            "tombstones": vectors.tombstone_count,
        }
        m = self.manifest
        if force or self._manifest_dirty or m.counts != counts or m.generation != self.generation:
            m.counts, m.generation = counts, self.generation
            m.write(self.directory / MANIFEST_NAME)
            self._manifest_dirty = False

    def newest_generation(self) -> int:
        """The generation committed now (may be newer than this store's, for a reader)."""
        if not self.readonly:
            return self.generation
        with self._refresh_lock:
            if self._probe is None:
                self._probe = DocStore(self.directory / DOCS_NAME, readonly=True)
            return int(self._probe.get_meta("generation") or -1)

    def refresh(self) -> bool:
        """Reader: move to the newest committed generation; returns whether it changed.

        Safe while other threads search: they finish on the snapshot they hold.
        """
        if not self.readonly:
            raise ValueError("refresh() is for readers; a writer always sees its own state")
        if self.newest_generation() == self.generation:
            return False
        with self._refresh_lock:
            old = self._current()
            new = self._open_snapshot(old)
            with self._swap_lock:
                self._snap = new
        old.retire()  # closed now, or when the last search holding it finishes
        return new.generation != old.generation

    # ------------------------------------------------------------------ staging
    def _check_writable(self) -> None:
        if self.readonly:
            raise ValueError(f"{self.directory}: opened read-only; to change it, open it with readonly=False "
                             "(SearchPipeline.load(..., readonly=False) or IndexStore.open(..., readonly=False))")
        if self._lock_fd is None or self._snap is None:
            raise ValueError(f"{self.directory}: store is closed")

    def _begin(self) -> None:
        if not self.docstore.in_transaction:
            self.docstore.begin()

    def _disk_full(self, what: str, exc: BaseException) -> IndexDiskFullError:
        """Roll back to the last commit and describe a full disk in the user's terms."""
        gen = self.generation
        with contextlib.suppress(Exception):
            self.rollback()
        return IndexDiskFullError(
            errno.ENOSPC,
            f"{self.directory}: no space left on device while {what}; nothing was committed: the index is "
            f"unchanged at generation {gen} (the staged changes were discarded). Free some space and run "
            f"the change again",
        )

    def add(
        self,
        docs: Iterable[Mapping[str, Any] | tuple],
        vectors: np.ndarray,
        *,
        on_duplicate: Literal["error", "skip", "replace"] = "error",
    ) -> int:
        """Stage documents and their vectors (N, D); visible to this store at once, durable at ``commit()``.

        `docs` are read as the pipeline reads them (`document_records`, `as_document`): mappings or ``(id, text[,
        metadata])`` tuples, every one checked here (the index layer does not check them again). A passage row
        read back from a passage index is refused: only the pipeline writes those (``SearchPipeline.add``).

        Returns how many documents were added (or replaced). Both parts change or neither.
        """
        self._check_writable()
        rows = [_checked_row(_not_passage_row(d, f"docs[{j}]"), f"docs[{j}]")
                for j, d in enumerate(document_records(docs, "docs", paths=False))]
        return self._add_rows(rows, vectors, on_duplicate=on_duplicate)

    def _add_rows(
        self,
        rows: Sequence[Mapping[str, Any]],
        vectors: np.ndarray,
        *,
        on_duplicate: Literal["error", "skip", "replace"] = "error",
    ) -> int:
        """`add` for rows the pipeline has checked already (its readers', its passage rows: ``_Row``), which get only
        `_row_types`'s cheap look. Why private: it is the one path past the document checks, and only the
        pipeline's build (``retrieval.build``) and ``SearchPipeline.add`` may take it."""
        self._check_writable()
        rows = _index_rows(rows)
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
        snap = self._current()
        # Loaded (or rebuilt from the documents) before anything is staged and kept up to date, so the commit
        # saves this generation's cache: otherwise every reader after a write rebuilt BM25 from all documents
        # (7.7 s for 50k abstracts) in every process that searched with it.
        bm25 = snap.bm25
        try:
            self._begin()
            with self.docstore.transaction():  # a savepoint: undone if the vectors are refused
                replaced = [
                    d["id"] for d, c in zip(rows, self.docstore.contains_many([d["id"] for d in rows])) if c
                ]
                self.docstore.add(rows, on_duplicate=on_duplicate)
                self.vectors.add([d["id"] for d in rows], vectors, on_duplicate=on_duplicate,
                                 metadata=[d["metadata"] for d in rows])
        except (sqlite3.OperationalError, OSError) as e:
            if is_disk_full(e):
                raise self._disk_full("staging the added documents", e) from None
            raise
        if bm25 is not None:
            bm25.delete(replaced)
            bm25.add([d["id"] for d in rows], [document_text(d) for d in rows])
        snap.pending = True
        snap.rows_changed()
        return len(rows)

    def delete(self, ids: Iterable[str]) -> list[str]:
        """Stage deletion of ``ids``; returns the ids that were not present (nothing else happens to them).

        A bare string is refused (`twotower.common.ids.id_list`): ``delete("ab")`` deleted "a" and "b".
        """
        self._check_writable()
        ids = list(dict.fromkeys(id_list(ids, "delete")))
        snap = self._current()
        bm25 = snap.bm25  # before staging, as in `add`: the commit saves the updated cache
        try:
            self._begin()
            with self.docstore.transaction():
                missing = self.docstore.delete(ids)
                vmissing = self.vectors.remove(ids)
                if set(missing) != set(vmissing):
                    raise IndexFormatError(self.directory, "documents and vectors disagree about which ids exist")
        except (sqlite3.OperationalError, OSError) as e:
            if is_disk_full(e):
                raise self._disk_full("staging the deletion", e) from None
            raise
        if bm25 is not None:
            bm25.delete(ids)
        if len(missing) < len(ids):
            snap.pending = True
            snap.rows_changed()
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
        return self._snap is not None and self._snap.pending

    # ------------------------------------------------------------------ commit / rollback
    def commit(self) -> int:
        """Make staged changes durable (protocol in the module docstring); returns the generation.

        If it fails before the commit point, nothing is committed and the staged changes are
        discarded (the store is back at its last commit); a full disk raises ``IndexDiskFullError``.
        """
        self._check_writable()
        snap = self._current()
        if snap.pending:
            written: list[Path] = []
            new_gen = snap.generation + 1
            try:
                new_segments = self._write_commit_files(written)
                _crash_point("files_written")
                self._begin()
                self._write_bm25(snap, new_gen, written)
                _crash_point("bm25_written")
                self.docstore.set_meta("generation", str(new_gen))
                self.docstore.commit()  # <- the commit point
                self.last_commit = new_gen
            except BaseException as e:
                if self._committed(new_gen):  # an interrupt that landed just after the commit point
                    self.last_commit = new_gen
                    raise
                for p in written:
                    p.unlink(missing_ok=True)
                if isinstance(e, Exception) and is_disk_full(e):
                    raise self._disk_full("committing", e) from None
                # Nothing was committed; the records of the files just deleted must not stay staged.
                with contextlib.suppress(Exception):
                    self.rollback()
                raise
            kept, now = {seg.name for seg in new_segments}, time.monotonic()
            self._retired.update((seg.name, now) for seg in snap.vectors.segments if seg.name not in kept)
            # The cache being superseded stays for readers of its generation; only that one: a cache is the size of
            # the index's text, and a busy writer commits many times in RETAIN_SECONDS.
            for name in [n for n in self._retired if _BM25_RE.match(n)]:
                del self._retired[name]
            if (self.directory / bm25_name(snap.generation)).exists():
                self._retired[bm25_name(snap.generation)] = now
            snap.vectors.apply(new_segments)
            snap.generation += 1
            snap.pending = False
            _crash_point("sqlite_committed")
            self._sweep(grace=True)
            _crash_point("old_files_removed")
        try:
            try:
                self._refresh_manifest()
            except OSError as e:  # descriptive only: the commit stands, the next open rewrites it
                if not is_disk_full(e):
                    raise
                logger.warning("%s: no space left to update manifest.json; it is repaired at the next open",
                               self.directory)
            _crash_point("manifest_written")
        finally:
            # A commit of changes wrote its cache before the commit point (`_write_bm25`); this saves one a writer
            # rebuilt without changing anything, or one a full disk refused then, even when Ctrl-C cut the manifest
            # short: without its cache every process rebuilt BM25 from all the documents at its first BM25 search.
            self._save_bm25(snap)
        return snap.generation

    def _write_bm25(self, snap: Snapshot, generation: int, written: list[Path]) -> None:
        """Before the commit point: save the BM25 cache of `generation` and stage its SHA-256 in the commit.

        A reader that sees `generation` then finds its cache at once. Saved after the commit point (as it
        was), a reader refreshing in between (the service's refreshes before every batch) found none and
        rebuilt BM25 from every document on its own thread. The file goes into `written`, so a failed commit
        deletes it; one a crash leaves is a stray of an uncommitted generation, swept by the next writable open.
        """
        bm = snap._bm25
        if bm is None:  # BM25 disabled (`add` and `delete` load it before they stage anything)
            return
        path = self.directory / bm25_name(generation)
        written.append(path)
        try:
            bm.save(path)  # atomic (temp, fsync, rename), replacing any stray of an interrupted commit
        except OSError as e:
            path.unlink(missing_ok=True)
            if not is_disk_full(e):
                raise
            return  # a derived cache: the commit goes on without it (`_save_bm25` tries again, and warns)
        self.docstore.set_meta("bm25_sha256", f"{generation}:{file_sha256(path)}")

    def _save_bm25(self, snap: Snapshot) -> None:
        """Save the BM25 cache of the writer's generation when it is loaded and not saved yet (after a commit)."""
        bm = snap._bm25
        path = self.directory / bm25_name(snap.generation)
        if bm is None or path.exists():
            return
        try:
            bm.save(path)
            self.docstore.set_meta("bm25_sha256", f"{snap.generation}:{file_sha256(path)}")
        except (OSError, sqlite3.OperationalError) as e:  # a derived cache: the commit stands without it
            path.unlink(missing_ok=True)
            if not is_disk_full(e):
                raise
            logger.warning("%s: no space left for the BM25 cache; it is rebuilt when needed", self.directory)

    def _committed(self, generation: int) -> bool:
        """Whether the database holds `generation` as committed (after a failure around the commit point)."""
        if self.docstore.in_transaction:
            return False
        try:
            return self.docstore.get_meta("generation") == str(generation)
        except sqlite3.Error:
            return False

    def _write_commit_files(self, written: list[Path]) -> list[Segment]:
        """Write the new segment (and any merges) before the commit point; stage their records in SQLite.

        Returns the segment list of the new generation. Every file written is appended to `written`
        (so a failure before the commit point can delete them).
        """
        seq = int(self.docstore.get_meta("next_segment") or "0")
        plan = self.vectors.prepare_commit(self.directory, seq, written, _crash_point)
        self._begin()
        self.docstore.record_segments(add=plan.added, drop=plan.dropped, tombstones=plan.tombstones)
        self.docstore.set_meta("next_segment", str(plan.next_seq))
        return plan.segments

    def rollback(self) -> None:
        """Discard staged changes and return to the last committed generation."""
        self._check_writable()
        self.docstore.rollback()
        snap = self._current()
        if snap.pending:
            fresh = self._writer_snapshot(snap)
            snap.vectors, snap.generation, snap._bm25 = fresh.vectors, fresh.generation, None
            snap.rows_changed()
        snap.pending = False

    # ------------------------------------------------------------------ copying
    def copy_to(self, target: str | os.PathLike) -> Path:
        """Write a complete copy of the last committed generation to a new directory `target`, atomically.

        Copies the manifest, the SQLite documents (with their write-ahead log), the segment files and
        the BM25 cache of this generation; staged changes are not copied (``commit()`` first).
        `target` must not exist or be empty; it is built beside itself and renamed into place.
        This store keeps working on its own directory.
        """
        target = Path(target)
        here, there = Path(os.path.realpath(self.directory)), Path(os.path.realpath(target))
        if there == here or here in there.parents:
            # a copy in a subdirectory was an index inside the index: `index check` passed, a rebuild or a
            # delete of one took the other along
            raise ValueError(f"{target}: inside the index {self.directory}; copy it to a directory outside it")
        if self.manifest.backend == "milvus":
            raise ValueError(f"{self.directory}: its vectors live in Milvus collection "
                             f"{self.manifest.milvus['collection']!r}, which a copy would share; build a new index "
                             "(twotower index build --backend milvus --collection NAME) instead of copying this one")
        with self.snapshot() as snap:
            names = [MANIFEST_NAME, DOCS_NAME, DOCS_NAME + "-wal", *(s.name for s in snap.vectors.segments),
                     bm25_name(snap.generation)]
            with _built_aside(target) as tmp:
                for name in names:
                    if (self.directory / name).exists():
                        shutil.copy2(self.directory / name, tmp / name)
                (tmp / LOCK_NAME).touch()
        return target

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return len(self.vectors)

    # Each call below reads one commit; to keep several calls on one commit, use ``snapshot()``.
    def contains_many(self, ids: Sequence[str]) -> list[bool]:
        """Whether each id is present (staged changes included for the writer); a list of ids: a bare string
        is refused, as in `delete`."""
        with self.snapshot() as snap:
            return snap.contains_many(ids)

    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """Documents by id, in order (``None`` for unknown ids, e.g. the ``""`` padding); a list of ids: a bare
        string is refused, as in `delete`."""
        with self.snapshot() as snap:
            return snap.get(ids)

    def search(self, queries: np.ndarray, k: int = 10, *, filter: Filter | str | None = None,
               **params: Any) -> SearchResult:
        """Dense search (see ``VectorIndex.search``); queries (Q, D); ``filter`` as in ``Snapshot.search``.

        params: ``ef_search`` (an HNSW index) or ``nprobe`` (IVF) for this call; any other keyword, or one the
        index kind does not use, is refused (`search_options`).
        """
        with self.snapshot() as snap:
            return snap.search(queries, k, filter=filter, **params)

    @property
    def bm25(self) -> BM25 | None:
        """The BM25 index (loaded or rebuilt from the documents on first use), or None when disabled."""
        with self.snapshot() as snap:
            return snap.bm25

    def search_bm25(self, queries: Sequence[str], k: int = 10, *,
                    filter: Filter | str | None = None) -> SearchResult:
        """Lexical search over title + text (``filter`` as in ``Snapshot.search``); ValueError if the
        store was created without BM25."""
        with self.snapshot() as snap:
            return snap.search_bm25(queries, k, filter=filter)

    def info(self) -> dict[str, Any]:
        """A JSON-able summary (for ``twotower index info``)."""
        with self.snapshot() as snap:
            return {
                "directory": str(self.directory),
                "generation": snap.generation,
                "documents": snap.docstore.count(),
                "vectors": len(snap.vectors),
                "tombstones": snap.vectors.tombstone_count,
                "segments": len(snap.vectors.segments),
                "dim": self.manifest.dim,
                "metric": self.manifest.metric,
                "factory": self.manifest.factory,
                # a bool, not the options given at build time: those are {} for a default BM25, which read as
                # false; the parameters in force are beside it
                "bm25": self.manifest.bm25 is not None,
                "bm25_params": BM25.params(self.manifest.bm25) if self.manifest.bm25 is not None else None,
                "bm25_cache": (self.directory / bm25_name(snap.generation)).exists()
                if self.manifest.bm25 is not None else None,
                "backend": self.manifest.backend,
                "milvus": ({k: self.manifest.milvus[k] for k in ("uri", "collection")}
                           if self.manifest.milvus else None),
                "extra": self.manifest.extra,
                "pending": snap.pending,
            }

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release the lock, the database and the Milvus client (the last store of a Milvus Lite file unlocks it);
        uncommitted changes are discarded."""
        if self._retired and self._snap is not None and not self.readonly:
            with contextlib.suppress(OSError):
                self._sweep()  # leave no merged-away file behind (a reader still opening one retries)
        snap, self._snap = self._snap, None
        if snap is not None and not self.readonly and not snap.pending:
            snap.vectors.close()  # Milvus: delete the rows commits superseded
        if snap is not None:
            if snap.pending:
                logger.warning("%s: closing with uncommitted changes; they are discarded", self.directory)
            snap.retire(now=not self.readonly)
        if self._writer_docs is not None and not self._writer_docs.closed:
            self._writer_docs.close()
        if self._probe is not None:
            self._probe.close()
            self._probe = None
        if self._milvus_uri is not None:
            from twotower.indexing import milvus as mv

            uri, self._milvus_uri = self._milvus_uri, None
            mv.release(uri)  # the last store of the process closes the client (Milvus Lite: unlocks its file)
        if self._lock_fd is not None:
            self._unlock()  # closes the descriptor: releases the flock
            self._lock_fd = None

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if exc_type is None and not self.readonly and self._lock_fd is not None and self._snap is not None:
                self.commit()
        finally:
            self.close()

    def __repr__(self) -> str:
        snap = self._snap
        state = f"generation={snap.generation}, docs={len(snap)}" if snap is not None else "closed"
        return f"IndexStore({str(self.directory)!r}, {state})"
