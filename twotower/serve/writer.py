"""Serialised writes: one at a time, each on a short-lived writable store, committed atomically.

Each write opens the index directory for writing (taking its lock), stages the change,
commits (the store's crash-safe protocol) and closes again, so that between the
server's writes another process (``twotower index add``) can take the lock and commit
too; the model owner picks either up before its next batch.  A write answers only after
the model owner has moved to the new commit, so every document an add returned is
searchable by the next request.

A write that committed is answered as committed (200, with the commit's generation), even
when the model owner then fails to move to it: the answer then says ``"searchable": false``
with a ``warning``, and the failure is logged; the owner tries again before its next batch.
(It used to be a 500, and the client's retry of the add a 409.)  A write waits at most
``lock_wait_s`` for the write in progress before a 503 with ``Retry-After``, counted from its submission
(`SearchService.write` sets the deadline): for a thread, for its turn and for another process's lock together.

A server stopping past its graceful deadline calls `IndexWriter.stop`: a write still waiting for its turn or for
another process's lock stops at once, an add still encoding at its next chunk of documents, before its commit,
rolled back (`WriteStopped`, a 503 "nothing was written"); a delete, or an add past its encoding (its commit, a
Milvus flush, a FAISS segment merge), finishes and is answered as committed.  The route waits for the write either
way, so no client is told "nothing was written" about a write that then commits.  A request cancelled for another
reason stops its own write the same way (`IndexWriter.stop_write`), and the other writes go on.

Documents are encoded by the model owner (`OwnerEncoder`), a chunk at a time between
search batches: one torch forward at a time on the machine, and searches keep being
answered from the previous commit while a large add is encoded.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from twotower.common.file_lock import LOCK_WAIT_S, check_lock_wait
from twotower.indexing.docstore import Document
from twotower.indexing.store import IndexLockedError, IndexNotWritableError, IndexStore, wait_for_lock
from twotower.retrieval.passages import contains_documents
from twotower.serve.batcher import ModelOwner
from twotower.serve.errors import ApiError

logger = logging.getLogger(__name__)

# Documents per owner job: a search (or lookup) arriving during an add waits for at most the chunk being encoded.
# On 2 CPU cores (all-MiniLM-L6-v2, 256-token documents) 256 documents took 11-13 s in chunks of 8, 16 or 32
# alike, while one chunk took ~0.35 s at 8 and ~1.4 s at 32 (ad hoc, 2 shared cores of CPU-B): the searches'
# wait, for nothing gained.
ENCODE_CHUNK = 8


class WriteStopped(ApiError):
    """The server is stopping: the write stopped before its commit, so nothing of it was written."""

    def __init__(self) -> None:
        super().__init__(503, "the server is stopping; nothing was written (retry once it is back)",
                         headers={"Retry-After": "5"})


class OwnerEncoder:
    """The served dual encoder as seen from a writer thread: `encode_documents` runs in the model owner.

    Passed to `SearchPipeline` in place of the `DualEncoder`, so `SearchPipeline.add` works as
    it does everywhere else while its forwards happen in the one thread that owns the model.
    """

    def __init__(self, owner: ModelOwner, chunk: int = ENCODE_CHUNK,
                 stopped: Callable[[], bool] = lambda: False) -> None:
        self._owner = owner
        self._chunk = chunk
        self._stopped = stopped

    def describe(self) -> dict[str, Any]:
        return dict(self._owner.encoder_describe)

    def __getattr__(self, name: str) -> Any:
        """The tokenizer side of the served encoder (splitting long documents into passages needs it).

        Tokenizing is thread-safe and runs no model; forwards go through `encode_documents`.
        """
        if name in ("document_tower", "document_prefix", "document_max_length"):
            return getattr(self._owner.encoder, name)
        raise AttributeError(name)

    def encode_documents(self, texts: Sequence[str], batch_size: int | None = None, progress: bool = False,
                         out: np.ndarray | None = None) -> np.ndarray:
        """(N,) texts -> (N, D) float32, encoded by the owner in chunks queued all at once (they keep their order).

        Once the write is stopped (`IndexWriter.stop`, `IndexWriter.stop_write`), `WriteStopped` at the next chunk
        boundary: the chunks still queued are withdrawn, and the add (not committed yet) is rolled back.  Stopped
        already: nothing is queued (the owner would encode at least a chunk for nothing).
        """
        if self._stopped():
            raise WriteStopped()
        texts = list(texts)
        # background: a lookup, or a move to a commit, queued after these chunks runs before the next of them
        futures = [self._owner.call(lambda pipe, part=texts[s:s + self._chunk]:
                                    pipe.encoder.encode_documents(part, batch_size=batch_size), background=True)
                   for s in range(0, len(texts), self._chunk)]
        dim = int(self._owner.encoder_describe["dim"])
        parts = []
        for j, f in enumerate(futures):
            parts.append(f.result())
            if self._stopped():
                for rest in futures[j + 1:]:
                    rest.cancel()  # withdrawn: the owner never runs a job cancelled before it started
                raise WriteStopped()
        vecs = np.concatenate(parts, axis=0) if parts else np.zeros((0, dim), dtype=np.float32)  # (N, D)
        if out is not None:
            out[...] = vecs
            return out
        return vecs


class IndexWriter:
    """Adds and deletes documents of one index directory, one write at a time.

    Args:
        directory: the index directory the model owner serves.
        owner: the model owner (encodes documents; refreshed after each commit).
        lock_wait_s: how long a write waits for the write in progress (this server's, or another process's
            lock on the index) before a 503 with Retry-After; a finite number >= 0 (ValueError).
    """

    def __init__(self, directory: str, owner: ModelOwner, lock_wait_s: float = LOCK_WAIT_S) -> None:
        self.directory = directory
        self.owner = owner
        self.lock_wait_s = check_lock_wait(lock_wait_s)
        # this server's writes take turns here: a condition, not a lock, so that a stop wakes the writes waiting
        self._turns = threading.Condition()
        self._busy = False
        self._stopping = threading.Event()
        self.writes = 0

    def stop(self) -> None:
        """The server is stopping: every write stops before its commit where it still can (`stop_write`), and no
        write starts any more; a commit already under way finishes."""
        self._stopping.set()
        with self._turns:
            self._turns.notify_all()

    def stop_write(self, cut: threading.Event) -> None:
        """Stop the one write given `cut` (its request was cancelled), as `stop` stops all; later writes still run.

        Why not `stop`: a cancel that is not a shutdown (a client's deadline, a timeout middleware) turned writes
        off until the server restarted.
        """
        cut.set()
        with self._turns:
            self._turns.notify_all()

    @property
    def stopping(self) -> bool:
        """Whether `stop` was called (writes are answered 503 "nothing was written" from then on)."""
        return self._stopping.is_set()

    def collect_garbage(self) -> None:
        """Once the model owner has stopped: delete the Milvus rows this server's writes superseded, if it wrote.

        Why: each write's close keeps them while the owner's store of the same Milvus Lite file may still search
        them, and no reader deletes them: after the server's last write they stayed until some writer opened the
        index.  A writer opened and closed alone in the process deletes them all (`MilvusVectors.close`).  Skipped
        on a FAISS index (no such rows), on a Milvus server (a writer deletes only rows retired more than
        `RETAIN_SECONDS` ago there: other processes may search the rest), when the garbage table is empty (opening a
        writer restarts Milvus Lite, loads the collection and checks it: seconds of shutdown for nothing) and while
        another process holds the index's lock; a failure is logged.
        """
        from twotower.indexing.docstore import DocStore
        from twotower.indexing.manifest import MANIFEST_NAME, Manifest
        from twotower.indexing.milvus import is_local
        from twotower.indexing.store import DOCS_NAME

        if not self.writes:
            return
        try:
            manifest = Manifest.read(f"{self.directory}/{MANIFEST_NAME}")
            if manifest.backend != "milvus" or not is_local((manifest.milvus or {}).get("uri", "")):
                return
            with DocStore(f"{self.directory}/{DOCS_NAME}", readonly=True) as docs:
                if not docs.query("SELECT 1 FROM vector_garbage LIMIT 1"):
                    return
            IndexStore.open(self.directory, readonly=False).close()
        except IndexLockedError:  # another process writes: its close (or the next writer's open) deletes them
            return
        except Exception as exc:  # noqa: BLE001 - the rows stay for the next writer, as before
            logger.warning("could not delete the Milvus rows the writes superseded (the next writer will): %s: %s",
                           type(exc).__name__, exc)

    def _stopped(self, cut: threading.Event | None) -> Callable[[], bool]:
        """Whether the write given `cut` is to stop: the server is stopping, or its request was cancelled."""
        return lambda: self._stopping.is_set() or (cut is not None and cut.is_set())

    def check_stopped(self, cut: threading.Event | None = None) -> None:
        """`WriteStopped` when the server is stopping or the write given `cut` was told to stop.

        Why: a write that waited for a thread while the server stopped parsed its documents for nothing, and one
        submitted once the writes' threads had shut down was a plain 500 (the executor's RuntimeError).
        """
        if self._stopped(cut)():
            raise WriteStopped()

    def deadline(self) -> float:
        """The `time.monotonic()` by which a write submitted now must have its turn and the lock (`lock_wait_s`)."""
        return time.monotonic() + self.lock_wait_s

    def _open(self, stopped: Callable[[], bool], deadline: float) -> IndexStore:
        try:
            store = wait_for_lock(lambda: IndexStore.open(self.directory, readonly=False),
                                  max(0.0, deadline - time.monotonic()), stop=stopped)
        except IndexNotWritableError as e:  # storage or permissions, not this request: refused like --read-only
            raise ApiError(403, f"writes are refused: {e}") from None
        except IndexLockedError:
            if stopped():
                raise WriteStopped() from None
            raise ApiError(503, f"the index is being written by another process (waited {self.lock_wait_s:g} s "
                                "for its lock); retry", headers={"Retry-After": "5"}) from None
        if store.manifest.bm25 is not None:
            _ = store.bm25  # load it now so the change updates it and the commit saves it for readers
        return store

    @contextlib.contextmanager
    def _turn(self, stopped: Callable[[], bool], deadline: float | None = None) -> Iterator[None]:
        """This server's writes one at a time; a write that cannot start by `deadline` (default: lock_wait_s from
        now) is a 503, one stopped while it waits (`stop`, `stop_write`) a `WriteStopped` at once."""
        deadline = self.deadline() if deadline is None else deadline
        with self._turns:
            while self._busy and not stopped():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(503, f"another write is in progress (waited {self.lock_wait_s:g} s for it); "
                                        "retry", headers={"Retry-After": "5"})
                self._turns.wait(left)
            if stopped():
                raise WriteStopped()
            self._busy = True
        try:
            yield
        finally:
            with self._turns:
                self._busy = False
                self._turns.notify_all()

    def _caught_up(self, generation: int, documents: int) -> dict[str, Any]:
        """The answer's commit fields once the model owner has moved to `generation` (committed, with `documents`).

        The owner's failure to move does not undo the commit: the answer says so instead of failing the write.
        """
        try:
            view = self.owner.refresh().result()
        except Exception as exc:
            logger.error("generation %d is committed, but the searches could not move to it: %s: %s",
                         generation, type(exc).__name__, exc, exc_info=not isinstance(exc, ApiError))
            return {"generation": generation, "documents": documents, "searchable": False,
                    "warning": f"the change is committed (generation {generation}), but searches still answer from "
                               "an earlier commit: the server could not load the new one (its log says why); it "
                               "tries again before its next search"}
        return {"generation": view.generation, "documents": view.documents}

    def _pipeline(self, store: IndexStore, stopped: Callable[[], bool]):
        from twotower.retrieval.pipeline import SearchPipeline

        return SearchPipeline(store, OwnerEncoder(self.owner, stopped=stopped), None)

    def add(self, docs: list[Document], replace: bool, cut: threading.Event | None = None,
            deadline: float | None = None) -> dict[str, Any]:
        """Add (or with `replace`, add or replace) validated documents; 409 naming the ids already present.

        `cut`: set by `stop_write` to stop this write (before its commit, where it still can).  `deadline`: the
        `time.monotonic()` by which it must have its turn and the lock (`deadline()` when it was submitted;
        default: lock_wait_s from now), so that waiting for a write thread counts too.
        """
        ids = [d["id"] for d in docs]
        stopped = self._stopped(cut)
        deadline = self.deadline() if deadline is None else deadline
        with self._turn(stopped, deadline):
            store = self._open(stopped, deadline)
            try:
                if stopped():  # told while it waited for the lock: before anything is staged
                    raise WriteStopped()
                present = {i for i, c in zip(ids, contains_documents(store.docstore, ids)) if c}
                if present and not replace:
                    first = next(j for j, i in enumerate(ids) if i in present)
                    raise ApiError(
                        409, f"{len(present)} document id(s) are already in the index, e.g. {ids[first]!r}; "
                             "send \"replace\": true to replace them", f"documents[{first}]._id",
                        details={i: "already in the index" for i in ids if i in present})
                pipe = self._pipeline(store, stopped)
                pipe.add(docs, on_duplicate="replace" if replace else "error")
                generation, documents = store.generation, len(pipe)  # the commit's
            finally:
                store.close()
            self.writes += 1
            commit = self._caught_up(generation, documents)
        return {"added": len(ids) - len(present), "replaced": len(present), "ids": ids, **commit}

    def delete(self, ids: list[str], cut: threading.Event | None = None,
               deadline: float | None = None) -> dict[str, Any]:
        """Delete documents by id, all or none: 404 naming every unknown id leaves the index unchanged.

        `cut`: as for `add`; a delete stops only before it starts staging (it encodes nothing: it then commits).
        `deadline`: as for `add`.
        """
        ids = list(dict.fromkeys(ids))
        stopped = self._stopped(cut)
        deadline = self.deadline() if deadline is None else deadline
        with self._turn(stopped, deadline):
            store = self._open(stopped, deadline)
            try:
                if stopped():  # told while it waited for the lock
                    raise WriteStopped()
                missing = [i for i, c in zip(ids, contains_documents(store.docstore, ids)) if not c]
                if missing:
                    unknown = set(missing)
                    raise ApiError(404, f"{len(missing)} of {len(ids)} id(s) are not in the index, e.g. "
                                        f"{missing[0]!r}; nothing was deleted", "ids",
                                   details={i: "not found" if i in unknown else "not deleted" for i in ids})
                pipe = self._pipeline(store, stopped)
                pipe.delete(ids)
                generation, documents = store.generation, len(pipe)  # the commit's
            finally:
                store.close()
            self.writes += 1
            commit = self._caught_up(generation, documents)
        return {"deleted": ids, **commit}
