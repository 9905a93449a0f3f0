"""Building an index from a corpus file: bounded memory, resumable, optionally spread over torchrun ranks.

The story of a build (``build_index``):

0. **Lock** ``<out>.build/LOCK`` (`BuildLock`, an ``flock`` held until the build ends):
   a second build into the same ``--out`` stops at once, naming the first one's
   pid, instead of deleting or mixing its shards.  The kernel drops the lock of
   a killed process, so a build killed with ``kill -9`` is taken over and resumed.
1. **Validate** the whole corpus first (`twotower.retrieval.corpus.validate_corpus`): a bad
   line, a duplicate id or an empty document (unless ``on_empty="skip"`` leaves such
   documents out, counted in a warning) stops the build in seconds, naming file and line,
   before any model runs and before anything is written; so does a disk without
   room for the estimated size (`check_disk_space`).  A build that stops here
   leaves nothing of ``<out>`` or ``<out>.build`` it created.
2. **Plan**: shard ``i`` is documents ``[i*S, (i+1)*S)`` of the (de-duplicated)
   corpus.  ``plan.json`` in the work directory pins the corpus bytes (sha256),
   the duplicate policy, the shard size and the encoder fingerprint.
3. **Encode** shard by shard, each written atomically as ``shards/shard-NNNNNN.npy``
   (float32, (n, D)).  Memory holds one shard of texts and vectors at a time.
   Rerunning after a crash finds the same plan and skips every shard already on
   disk; a plan that changed (other corpus, other model) starts over.  Under
   ``torchrun`` rank ``r`` encodes shards ``r, r+W, ...``.
4. **Assemble** (rank 0, after a barrier): create an `indexing.IndexStore` in the
   work directory, add the shards in order with their documents, commit, and
   rename it to the output path.  The output path therefore either does not
   exist or holds a complete index; a crash leaves only the work directory
   (``<out>.build``), which the next run resumes from.  A directory someone
   put at the output path while the build ran is never touched: the rename
   fails rather than replace it, and `OutAppearedError` says so, keeping the shards.

A disk that fills up during steps 3-4 stops the build with `DiskFullError`
naming the directory; the half-assembled index is removed, and the finished
shards are kept (the message says how many and how large) so that rerunning the
same command after freeing space resumes instead of encoding them again.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from twotower.common.atomic import atomic_path, atomic_write_text, fsync_dir
from twotower.common.distributed import from_main
from twotower.common.file_lock import lock_note, try_lock
from twotower.common.paths import working_directory_refusal
from twotower.indexing import IndexFormatError, IndexLockedError, IndexStore, document_text
from twotower.indexing.integrity import file_sha256
from twotower.indexing.milvus import MilvusSpec, check_target
from twotower.indexing.search_result import is_count
from twotower.indexing.store import Occupant, is_disk_full, occupant
from twotower.indexing.vector_index import VECTOR_METRICS, check_factory
from twotower.retrieval.corpus import CorpusPlan, duplicates_note, empty_note, iter_chunks, validate_corpus
from twotower.retrieval.dual_encoder import DualEncoder
from twotower.retrieval.passages import PassageSplitter, longer_than_model, title_warning, truncation_warning
from twotower.retrieval.sharding import DistInfo, barrier, init_build_group, owns_shard

logger = logging.getLogger(__name__)

PLAN_NAME = "plan.json"
SHARDS_DIR = "shards"
LOCK_NAME = "LOCK"
PLAN_FORMAT = 1
DEFAULT_SHARD_SIZE = 8192
MB = 1 << 20
NEARLY_FULL = MB  # free bytes under which a failed write is taken to be a full disk


class BuildLockedError(IndexLockedError):
    """Another process is building into the same output directory."""


class DiskFullError(OSError):
    """The disk holding a build has (or will have) no room for it; the message names the directory."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


class OutOccupiedError(FileExistsError):
    """The build's output path holds something it must not replace: `kind` is `occupant`'s case.

    The message is in Python's words; `out` and `kind` let the command line say it with flags instead (the
    check runs again under the build's lock, where a message of its own showed command-line users Python advice).
    """

    def __init__(self, out: str, kind: Occupant) -> None:
        why = {
            "file": "a file; give the name of a new directory for the index",
            "index": (f"already an index; add the documents to it with SearchPipeline.load({out!r}, "
                      "readonly=False).add(docs), or remove it first"),
            "empty index": ("an empty index, at generation 0 (nothing was ever committed to it, as when the with "
                            "block of an IndexStore.create raised before its first commit); remove the directory, "
                            "or give a new one"),
            "empty milvus index": (f"an empty index, at generation 0, whose vectors go to a Milvus collection; open "
                                   f"it with IndexStore.open({out!r}), or give a new directory (removing this one "
                                   "would leave its staged rows in the collection, which a new index then refuses)"),
            "being written": ("an index another writer holds open and is writing its first commit to; leave it to "
                              "that writer and give a new directory for the index"),
            "directory": "a directory that is not empty; give a new or empty directory for the index",
        }[kind]
        super().__init__(errno.EEXIST, f"{out}: {why}")
        self.out, self.kind = out, kind

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self) -> tuple[type, tuple[str, Occupant]]:
        """Pickle by (out, kind). Why: an OSError pickles as (errno, strerror), which this constructor took for
        (out, kind) and failed on (KeyError), e.g. when the error crossed a process boundary."""
        return type(self), (self.out, self.kind)


class OutAppearedError(FileExistsError):
    """The output path was created by someone else while the build ran; it is left as it is.

    The message says so, and that the encoded shards are kept in the work directory for the rerun.
    Attributes: `out`, `work_dir`.
    """

    def __init__(self, out: str, work_dir: str) -> None:
        super().__init__(errno.EEXIST, f"{out}: appeared while the index was being built; nothing in it was "
                                       f"touched, and the encoded shards are kept in {work_dir}: remove or move "
                                       f"{out} away, or choose another output, and build again (the rerun "
                                       f"resumes from {work_dir} when it is named after the output)")
        self.out, self.work_dir = out, work_dir

    def __str__(self) -> str:
        return self.strerror


class BuildLock:
    """An exclusive ``flock`` on ``work_dir/LOCK``, held for a whole build (a context manager).

    The flock is `twotower.common.file_lock`'s, as for the index writer; the file keeps
    the holder's pid for the message of the build that is refused.
    Because the lock file may be unlinked while held (the work directory is removed
    after a successful build), a process that got the lock checks that the path
    still names the file it locked, and tries again if not.

    Attributes:
        created: this lock created `work_dir` (so a build that stops before
            encoding removes the whole directory, not just what it wrote).
    """

    def __init__(self, work_dir: str, out: str) -> None:
        self.work_dir, self.out = work_dir, out
        self.path = os.path.join(work_dir, LOCK_NAME)
        self.created = False
        self._fd: int | None = None

    def acquire(self) -> BuildLock:
        while True:
            if not os.path.isdir(self.work_dir):
                os.makedirs(self.work_dir, exist_ok=True)
                self.created = True
            try:
                fd = try_lock(self.path)
            except FileNotFoundError:  # the directory was removed between the two calls
                continue
            if fd is None:
                holder = lock_note(self.path) or "unknown"
                raise BuildLockedError(
                    f"another build of {self.out} is running (pid {holder}); wait for it to finish, or stop it "
                    "and rerun this command to resume it"
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # we locked a file that its holder unlinked on the way out: lock the new one
        old = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        if old and old != str(os.getpid()):
            logger.warning("%s: taking over from an earlier build that stopped (pid %s)", self.work_dir, old)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None

    def __enter__(self) -> BuildLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class BuildPlan:
    """What the shards on disk were computed from; a resumed build must match it exactly."""

    corpus_sha256: str
    on_duplicate: str
    shard_size: int
    encoder_fingerprint: str
    num_documents: int
    dim: int
    format: int = PLAN_FORMAT
    # Long documents split into passages (`twotower.retrieval.passages`): the settings, and the rows
    # (vectors) of each shard, counted before encoding so that a resumed build can check its shards.
    passage_window: int | None = None
    passage_stride: int | None = None
    rows: list[int] | None = None

    @property
    def num_shards(self) -> int:
        return -(-self.num_documents // self.shard_size)

    @property
    def num_rows(self) -> int:
        """Vectors the index will hold: one per document, or one per passage of a split document."""
        return sum(self.rows) if self.rows is not None else self.num_documents

    def shard_rows(self, shard: int) -> int:
        if self.rows is not None:
            return self.rows[shard]
        return min(self.shard_size, self.num_documents - shard * self.shard_size)

    def shard_offset(self, shard: int) -> int:
        """The index row where `shard`'s vectors start."""
        if self.rows is not None:
            return sum(self.rows[:shard])
        return shard * self.shard_size


def shard_path(work_dir: str, shard: int) -> str:
    return os.path.join(work_dir, SHARDS_DIR, f"shard-{shard:06d}.npy")


def _shard_done(path: str, rows: int, dim: int) -> bool:
    """A shard counts as finished only if it loads with the expected shape and dtype."""
    if not os.path.isfile(path):
        return False
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError):
        return False
    return arr.shape == (rows, dim) and arr.dtype == np.float32


def _save_shard(path: str, vectors: np.ndarray) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.save(f, np.ascontiguousarray(vectors, dtype=np.float32))


def _empty_work_dir(work_dir: str) -> None:
    """Remove everything in the work directory except the lock file, which this build holds."""
    for name in os.listdir(work_dir):
        if name == LOCK_NAME:
            continue
        path = os.path.join(work_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def prepare_work_dir(work_dir: str, plan: BuildPlan) -> int:
    """Create or reuse the work directory; returns how many finished shards it already holds."""
    plan_file = os.path.join(work_dir, PLAN_NAME)
    if os.path.isfile(plan_file):
        try:
            with open(plan_file, encoding="utf-8") as f:
                old = json.load(f)
        except (OSError, json.JSONDecodeError):
            old = None
        if old != asdict(plan):
            logger.warning("%s: an earlier build used another corpus, model or shard size; starting over", work_dir)
            _empty_work_dir(work_dir)
    os.makedirs(os.path.join(work_dir, SHARDS_DIR), exist_ok=True)
    if not os.path.isfile(plan_file):
        atomic_write_text(plan_file, json.dumps(asdict(plan), indent=2) + "\n")
    return sum(_shard_done(shard_path(work_dir, i), plan.shard_rows(i), plan.dim) for i in range(plan.num_shards))


def encode_shards(
    plan: BuildPlan,
    corpus: CorpusPlan,
    encoder: DualEncoder,
    work_dir: str,
    info: DistInfo,
    batch_size: int | None = None,
    progress: bool = True,
    splitter: PassageSplitter | None = None,
) -> int:
    """Encode this rank's unfinished shards; returns how many documents it encoded."""
    mine = [i for i in range(plan.num_shards) if owns_shard(i, info)]
    todo = {i for i in mine if not _shard_done(shard_path(work_dir, i), plan.shard_rows(i), plan.dim)}
    if len(todo) < len(mine):
        logger.warning("resuming: %d of %d shards of rank %d already encoded", len(mine) - len(todo), len(mine),
                       info.rank)
    total = sum(plan.shard_rows(i) for i in todo)
    unit = "passage" if splitter is not None else "doc"
    bar = tqdm(total=total, desc=f"encode {unit}s", unit=unit, disable=not progress or info.rank != 0)
    encoded = 0
    for i, chunk in enumerate(iter_chunks(corpus.path, plan.shard_size, corpus.skip_lines)):
        if i not in todo:
            continue
        rows = splitter.rows(chunk) if splitter is not None else chunk
        vecs = encoder.encode_documents([document_text(d) for d in rows], batch_size=batch_size)  # (n, D)
        _save_shard(shard_path(work_dir, i), vecs)
        encoded += len(chunk)
        bar.update(len(rows))
    bar.close()
    return encoded


def _training_sample(store: IndexStore, plan: BuildPlan, work_dir: str, seed: int = 0) -> np.ndarray:
    """Rows drawn (seeded) from all shards, for IVF/PQ training, without loading every shard at once."""
    n = store.vectors.train_sample_size(plan.num_rows)
    rows = np.sort(np.random.default_rng(seed).choice(plan.num_rows, size=n, replace=False))
    parts = []
    for i in range(plan.num_shards):
        lo = plan.shard_offset(i)
        sel = rows[(rows >= lo) & (rows < lo + plan.shard_rows(i))] - lo
        if len(sel):
            parts.append(np.asarray(np.load(shard_path(work_dir, i), mmap_mode="r")[sel]))
    return np.concatenate(parts)  # (n, D)


def assemble(
    plan: BuildPlan,
    corpus: CorpusPlan,
    work_dir: str,
    out: str,
    *,
    factory: str | None,
    metric: str,
    bm25: bool,
    extra: dict[str, Any],
    progress: bool = True,
    splitter: PassageSplitter | None = None,
    milvus: MilvusSpec | None = None,
) -> None:
    """Rank 0: shards + documents -> a committed IndexStore, renamed into place at `out`.

    With `milvus` the vectors go to that collection (``IndexStore.create(..., milvus=...)``): the
    local directory holds the documents and the commit record, and is renamed into place the same way.
    """
    staging = os.path.join(work_dir, "index")
    if os.path.exists(staging):
        shutil.rmtree(staging)  # an interrupted assembly: cheap to redo
    try:
        store = IndexStore.create(staging, plan.dim, factory, metric, expected_size=plan.num_rows, bm25=bm25,
                                  extra=extra, milvus=milvus)
        try:
            if not store.vectors.is_trained:
                store.train(_training_sample(store, plan, work_dir))
            bar = tqdm(total=plan.num_rows, desc="assemble index", unit="row", disable=not progress)
            for i, chunk in enumerate(iter_chunks(corpus.path, plan.shard_size, corpus.skip_lines)):
                rows = splitter.rows(chunk) if splitter is not None else chunk
                store._add_rows(rows, np.load(shard_path(work_dir, i), mmap_mode="r"))  # checked by iter_chunks
                bar.update(len(rows))
            bar.close()
            store.commit()
            if bm25:
                _ = store.bm25  # build the lexical index now and save it with the commit, not at first search
                store.commit()
        finally:
            store.close()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a half-assembled index is cheap to redo: free its space now
        raise
    _move_into_place(staging, out, work_dir, milvus)


def _move_into_place(staging: str, out: str, work_dir: str, milvus: MilvusSpec | None) -> None:
    """Rename the assembled index to `out`, which must still be absent or an empty directory.

    Why a rename and nothing else: it is atomic, and it fails (ENOTEMPTY, EEXIST, ENOTDIR) rather than
    touch a directory or file that appeared at `out` while the build ran; that failure becomes
    `OutAppearedError`, with the encoded shards kept for the rerun.
    """
    try:
        os.rename(staging, out)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR) or not os.path.lexists(out):
            raise
        _discard_assembly(staging, milvus)
        raise OutAppearedError(out, work_dir) from exc
    fsync_dir(os.path.dirname(os.path.abspath(out)))


def _discard_assembly(staging: str, milvus: MilvusSpec | None) -> None:
    """Remove an assembled index that cannot be moved into place, and the Milvus collection it filled.

    Why: the rerun assembles again from the shards (cheap next to encoding); the collection was created by
    this assembly, and a rerun into another ``--out`` would otherwise find it full and refuse it.
    """
    shutil.rmtree(staging, ignore_errors=True)
    if milvus is None:
        return
    from twotower.indexing.milvus import connect

    try:
        connect(milvus.uri).drop_collection(milvus.collection)
    except Exception as exc:  # noqa: BLE001 - the error to report is OutAppearedError; a rerun of this --out drops it
        logger.warning("could not drop the Milvus collection %r at %s: %s", milvus.collection, milvus.uri, exc)


def _check_out_still_free(out: str, work_dir: str) -> None:
    """Raise `OutAppearedError` if something was put at `out` since the build checked it (before assembling)."""
    if occupant(out) is not None:
        raise OutAppearedError(out, work_dir)


def _existing_dir(path: str) -> str:
    """`path` or its nearest existing ancestor: where a directory about to be created will live."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _bytes_in(directory: str) -> int:
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def estimated_bytes(plan: BuildPlan, corpus: CorpusPlan) -> tuple[int, int]:
    """(bytes the finished index needs, bytes the shards need): a lower bound, for `check_disk_space`.

    Vectors are ``n * dim * 4`` bytes of float32, once in the shards and once in the index;
    the document store holds about the texts of the corpus (SQLite adds its pages and the
    metadata on top, FAISS graph indexes their links, so the real size is larger).
    """
    vectors = plan.num_rows * plan.dim * 4
    return vectors + corpus.content_bytes, vectors


def check_disk_space(out: str, work_dir: str, plan: BuildPlan, corpus: CorpusPlan) -> None:
    """Refuse a build whose estimated size (`estimated_bytes`) exceeds the free space, before encoding.

    Shards already in `work_dir` (a build being resumed) are counted as written.
    """
    index_bytes, shard_bytes = estimated_bytes(plan, corpus)
    shards_dir = os.path.join(work_dir, SHARDS_DIR)
    shard_bytes = max(0, shard_bytes - (_bytes_in(shards_dir) if os.path.isdir(shards_dir) else 0))
    places = {}  # device -> [directory, bytes needed]
    for where, need in ((_existing_dir(out), index_bytes), (_existing_dir(work_dir), shard_bytes)):
        dev = os.stat(where).st_dev
        places.setdefault(dev, [where, 0])[1] += need
    for where, need in places.values():
        free = shutil.disk_usage(where).free
        if free < need:
            raise DiskFullError(
                f"not enough free disk space in {where}: this build needs at least {_size(need)} "
                f"({plan.num_rows} vectors of {plan.dim} floats, in the shards and in the index, and "
                f"{_size(corpus.content_bytes)} of documents) but {_size(free)} are free; free some "
                "space or build somewhere else"
            )


def _out_of_space(exc: BaseException, directory: str) -> bool:
    """`is_disk_full`, or an I/O failure on a disk that has (almost) no room left.

    SQLite reports a write that fails for lack of space as "disk I/O error" when the failing
    write is to its WAL index (a mapped file), so the message alone does not tell; the free
    space does.
    """
    if is_disk_full(exc):
        return True
    io_error = False
    e: BaseException | None = exc
    for _ in range(20):  # the chain: OSError, sqlite3.Error, or the store's wrapping of either
        if e is None:
            break
        io_error = io_error or isinstance(e, (OSError, sqlite3.Error, IndexFormatError))
        e = e.__cause__ or e.__context__
    if not io_error:
        return False
    try:
        return shutil.disk_usage(_existing_dir(directory)).free < NEARLY_FULL
    except OSError:
        return False


def _size(n: int) -> str:
    return f"{n / MB:.1f} MB" if n >= MB // 10 else f"{-(-n // 1024)} KB"


def _clean_up_after_disk_full(work_dir: str, plan: BuildPlan, info: DistInfo) -> str:
    """Keep the finished shards (hours of encoding, perhaps) or remove a work directory without any;
    returns what was kept and how to resume, for the message of the `DiskFullError`."""
    done = [i for i in range(plan.num_shards) if _shard_done(shard_path(work_dir, i), plan.shard_rows(i), plan.dim)]
    if done:
        size = sum(os.path.getsize(shard_path(work_dir, i)) for i in done)
        return (f"the {len(done)} finished shards ({_size(size)}) are kept in {work_dir}: free some space on that "
                f"disk and rerun the same command to resume from them, or remove {work_dir} to give the space back")
    if info.is_main:
        shutil.rmtree(work_dir, ignore_errors=True)
    return "nothing was kept; free some space and rerun the command"


def build_index(
    corpus_path: str,
    out: str,
    encoder: DualEncoder,
    *,
    factory: str | None = None,
    metric: str | None = None,
    bm25: bool = False,
    on_duplicate: str = "error",
    batch_size: int | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
    progress: bool = True,
    keep_shards: bool = False,
    work_dir: str | None = None,
    extra: Callable[[CorpusPlan, BuildPlan, dict[str, Any]], dict[str, Any]] | None = None,
    splitter: PassageSplitter | None = None,
    milvus: MilvusSpec | None = None,
    on_empty: str = "error",
) -> bool:
    """Build the index at `out` from a corpus file; returns True on the rank that assembled it (rank 0).

    See the module docstring for the steps.  `extra(corpus_plan, build_plan, run)`
    supplies the manifest's ``extra`` object (the pipeline block); `run` says how the
    build ran (world_size, shard_size, batch_size, encode_seconds, and ``long_documents``: how
    many documents are longer than the model reads, split by `splitter` or else truncated).

    Raises:
        BuildLockedError: another build into `out` is running.
        FileExistsError: `out` exists and is not an empty directory.
        OutAppearedError: `out` was created (not empty) while the build ran; it is left untouched and the
            shards are kept in the work directory.
        FactoryError: FAISS cannot build `factory`, or the corpus has too few vectors to train it (before encoding).
        DataError: a bad corpus line (file and line named), before anything is encoded; with `on_empty`
            "error" (the default) a document whose text and title are both blank is one.
        DiskFullError: the estimated size does not fit (before encoding), or the disk filled up.
        MilvusUnavailableError / ValueError: with `milvus`, the URI cannot be reached or the collection
            cannot take this index (another dimension or encoder, another index's vectors); checked
            first, before the work directory or anything else is written.
    """
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    # Before anything is encoded or written: a metric typo failed after the whole corpus was encoded, and
    # left a work directory that a second call resumed from, past these checks.
    if metric is not None and metric not in VECTOR_METRICS:
        raise ValueError(f"metric must be one of {', '.join(VECTOR_METRICS)}, got {metric!r}")
    if batch_size is not None and (not is_count(batch_size) or batch_size < 1):  # numpy's integers too
        raise ValueError(f"batch_size must be a positive int or None (batches of about 2,048 tokens on a CPU), got {batch_size!r}")
    batch_size = None if batch_size is None else int(batch_size)  # recorded in the manifest's JSON
    if problem := working_directory_refusal(out, f"directory={os.fspath(out)!r}", "the index", "'my-index'"):
        raise ValueError(problem)
    _refuse_existing(out)
    if milvus is not None:
        milvus = replace(milvus, owner=os.path.abspath(out))
    started = time.perf_counter()
    work_dir = work_dir or f"{os.path.abspath(out)}.build"  # beside --out: "." gave "..build", inside it
    import torch.distributed as dist

    created_group = not dist.is_initialized()
    info = init_build_group()
    lock = BuildLock(work_dir, out)
    encoding = False
    failed = False
    try:
        if milvus is not None:  # before the work directory or anything else is written (see `Raises`)
            from_main(info, lambda: check_target(milvus, encoder.dim, metric or encoder.metric))
        from_main(info, lambda: (lock.acquire(), _refuse_existing(out)))  # the check again: `out` may be new now
        corpus = validate_corpus(corpus_path, on_duplicate, on_empty=on_empty)
        if corpus.num_documents == 0:
            raise ValueError(f"{corpus_path}: no documents to index")
        if corpus.duplicates_dropped and info.is_main:
            logger.warning("%s", duplicates_note(corpus.duplicates_dropped, on_duplicate))
        if corpus.num_empty and info.is_main:
            logger.warning("%s", empty_note(corpus.num_empty, corpus.empty_ids))
        rows, long_docs, cut_rows = count_rows(corpus, int(shard_size), encoder, splitter)
        plan = BuildPlan(
            corpus_sha256=file_sha256(corpus_path),
            on_duplicate=on_duplicate,
            shard_size=int(shard_size),
            encoder_fingerprint=encoder.fingerprint(),
            num_documents=corpus.num_documents,
            dim=encoder.dim,
            passage_window=splitter.settings.window if splitter is not None else None,
            passage_stride=splitter.settings.stride if splitter is not None else None,
            rows=rows,
        )
        if factory is not None and milvus is None:  # a typo or an IVF too large: now, not after the encoding
            check_factory(factory, encoder.dim, metric or encoder.metric, plan.num_rows)
        if long_docs and splitter is None and info.is_main:
            logger.warning("%s", truncation_warning(long_docs, corpus.num_documents, encoder))
        if cut_rows and info.is_main:
            logger.warning("%s", title_warning(cut_rows, encoder))
        from_main(info, lambda: check_disk_space(out, work_dir, plan, corpus))
        encoding = True
        stage = f"preparing the work directory {work_dir}"
        try:
            if info.is_main:
                done = prepare_work_dir(work_dir, plan)
                if done:
                    logger.warning("%s: resuming a build, %d of %d shards already encoded", work_dir, done,
                                   plan.num_shards)
            barrier(info)
            stage = f"writing embedding shards to {os.path.join(work_dir, SHARDS_DIR)}"
            encode_shards(plan, corpus, encoder, work_dir, info, batch_size=batch_size, progress=progress,
                          splitter=splitter)
            barrier(info)
            if info.is_main:
                run = {"world_size": info.world_size, "shard_size": plan.shard_size, "batch_size": batch_size,
                       "encode_seconds": round(time.perf_counter() - started, 1), "long_documents": long_docs}
                meta = extra(corpus, plan, run) if extra is not None else {}
                _check_out_still_free(out, work_dir)  # appeared during the encoding: say so before assembling
                stage = f"assembling the index in {os.path.join(work_dir, 'index')}"
                assemble(plan, corpus, work_dir, out, factory=factory, metric=metric or encoder.metric, bm25=bm25,
                         extra=meta, progress=progress, splitter=splitter, milvus=milvus)
                if not keep_shards:
                    shutil.rmtree(work_dir, ignore_errors=True)
            barrier(info)
        except Exception as exc:
            if not isinstance(exc, OutAppearedError) and _out_of_space(exc, work_dir):
                kept = _clean_up_after_disk_full(work_dir, plan, info)
                raise DiskFullError(f"no space left on device while {stage}; {kept}") from exc
            raise
    except BaseException:
        failed = True
        if not encoding and lock.created:  # stopped before any work: leave nothing behind
            shutil.rmtree(work_dir, ignore_errors=True)
        raise
    finally:
        lock.release()
        if created_group and info.enabled:
            from twotower.retrieval.sharding import cleanup

            cleanup(info, failed=failed)  # no barrier after a failure: the other ranks may never reach it
    return info.is_main


def count_rows(corpus: CorpusPlan, shard_size: int, encoder: DualEncoder,
               splitter: PassageSplitter | None) -> tuple[list[int] | None, int, int]:
    """(rows of each shard, or None without passages; documents longer than the model reads; passages the
    encoder will cut all the same, `title_warning`).

    One tokenizer pass over the corpus (no model): a few seconds per 10,000 documents, next to
    minutes of encoding; splitting is deterministic, so every rank and every resume counts alike.
    """
    rows: list[int] = []
    long_docs = cut_rows = 0
    for chunk in iter_chunks(corpus.path, shard_size, corpus.skip_lines):
        if splitter is None:
            long_docs += longer_than_model(encoder, chunk)
            continue
        spans = splitter.spans(chunk)
        rows.append(sum(len(s) for s in spans))
        long_docs += sum(len(s) > 1 for s in spans)
        cut_rows += splitter.cut_rows(chunk)
    return (rows if splitter is not None else None), long_docs, cut_rows


def _refuse_existing(out: str) -> None:
    """Refuse an occupied `out` (`occupant`) with `OutOccupiedError`, which says the case and the way on in
    Python's words; the command line catches it and says it with flags (``twotower.cli.index_cmd``)."""
    kind = occupant(out)
    if kind is not None:
        raise OutOccupiedError(out, kind)

