"""The model owner: one thread that holds the encoder, the reranker and a read-only view of the index.

Why one thread: on a 2-core machine, two torch forwards at once only fight over the
cores (and a ``SearchPipeline``'s SQLite connection may not cross threads anyway).  So
every request that needs a model or the index is a job for this thread:

* **searches are micro-batched**: the thread takes every search waiting in the queue
  (up to ``max_batch`` queries); when fewer are waiting than the last batch held, it
  waits up to ``max_wait_ms`` for the rest to arrive, so a steady load of N clients is
  served N queries per forward instead of one.  A single client never waits (its last
  batch held one query).  Queries asking for the same (recall_k, hybrid, rerank, rerank_k, ...) are
  encoded together and their candidates reranked in one cross-encoder call; ``k``
  differs freely (the batch searches for the largest and cuts each list).
* **other jobs** (a document lookup, encoding a chunk of documents for a write,
  picking up a new commit) run between batches, one per turn, so a long write cannot
  starve searches and searches cannot starve a write.

Consistency: the read-only store pins one committed generation (documents, vectors
and BM25 of one commit).  Before each batch the thread reads the newest committed
generation (one SQLite row) and, if another process or the server's own writer has
committed, moves to it (`IndexStore.refresh`).  So every batch answers from exactly one
commit, reported with its hits, never from a half-written state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from twotower.serve.errors import ApiError

logger = logging.getLogger(__name__)

T = TypeVar("T")


def default_threads(bf16: bool | None = None) -> int:
    """Threads for torch and FAISS: all cores in fp32; with bf16, all cores but one.

    bf16: whether the models run in bf16 (None: what "auto" picks on this CPU, `TWOTOWER_BF16` included).

    Measured on 2 cores (docs/results.md, "HTTP service"): the event loop needs only ~0.6 ms of
    CPU per query, and in fp32 torch on both cores gave 50-60 % more dense queries/s at 32 clients
    than one (AMD EPYC with AVX512-BF16, CPU-A: 149.9 vs 99.7; Xeon with AMX, CPU-C: 163-173 vs
    106-109) with p99 within 2.2x p50 at 8 clients.  With AMX bf16, two threads stalled the owner for 0.5-1 s now and
    then (p99 17-20x p50 at 8 clients in 2 of 3 runs) and were no faster, so bf16 keeps one core
    for the event loop; ``--threads`` overrides either choice.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    if bf16 is None:
        from twotower.common.device import bf16_supported

        bf16 = bf16_supported("cpu")
    return max(1, cores - 1) if bf16 else cores


@dataclass(frozen=True)
class SearchParams:
    """What a search asks for; queries with equal (recall_k, hybrid, rerank, rerank_k, filter, aggregate) share
    one batch."""

    k: int = 10
    recall_k: int = 100
    hybrid: bool = False
    rerank: bool = False
    rerank_k: int | None = None  # candidates the cross-encoder scores (None: the pipeline's default)
    filter: Any = None  # a parsed metadata filter (twotower.indexing.filters.Filter), or None
    aggregate: str = "max"  # an index with passages: a document's score from its passages' (SearchPipeline.search)

    @property
    def group(self) -> tuple[int, bool, bool, int | None, Any, str]:
        return (self.recall_k, self.hybrid, self.rerank, self.rerank_k if self.rerank else None, self.filter,
                self.aggregate)


@dataclass(frozen=True)
class IndexView:
    """What the owner's read-only store holds now (read by the event loop without touching SQLite)."""

    generation: int
    documents: int
    info: dict[str, Any]


@dataclass
class SearchAnswer:
    hits: list[list[Any]]  # one list of Hit per query
    generation: int


class _SearchJob:
    __slots__ = ("queries", "params", "future")

    def __init__(self, queries: list[str], params: SearchParams) -> None:
        self.queries = queries
        self.params = params
        self.future: Future[SearchAnswer] = Future()


class _CallJob:
    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()


def _loading_error(state: str, error: str | None) -> ApiError:
    if state == "failed":
        return ApiError(503, f"the index could not be loaded: {error}")
    if state == "stopped":
        return ApiError(503, "the server is shutting down")
    return ApiError(503, "the index and models are still loading; retry shortly", headers={"Retry-After": "2"})


class ModelOwner:
    """Owns the models and the read-only pipeline in one thread; searches are micro-batched.

    Args:
        load: builds the read-only `SearchPipeline` (called in the owner thread, so its
            SQLite connection belongs there).
        threads: torch and FAISS threads (None: `default_threads`).
        max_batch: most queries per batch.
        max_wait_ms: longest wait for more queries when fewer than the last batch are waiting.
    """

    def __init__(self, load: Callable[[], Any], *, threads: int | None = None, max_batch: int = 64,
                 max_wait_ms: float = 3.0) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self._load = load
        self.threads = threads or default_threads()
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.state = "loading"
        self.error: str | None = None
        self.view: IndexView | None = None
        self.encoder_describe: dict[str, Any] = {}  # DualEncoder.describe(), for writers' encoder check
        self.encoder_source: str | None = None
        self.reranker_loaded = False
        self.rerank_weights: dict[str, dict[str, Any]] = {}  # {"dense"|"hybrid": {"alpha", "chosen_over"}}
        self.has_bm25 = False
        self.has_passages = False
        self._cond = threading.Condition()
        self._searches: deque[_SearchJob] = deque()
        self._queued_queries = 0
        self._calls: deque[_CallJob] = deque()
        self._stopping = False
        self._last_batch = 1
        self._thread = threading.Thread(target=self._run, name="twotower-model-owner", daemon=True)
        self._ready = threading.Event()
        self._pipe: Any = None
        self._generation_probe: Any = None
        self._saved_threads: tuple[int, int] | None = None
        self.batches = 0
        self.batched_queries = 0
        self.max_batch_seen = 0
        self.refreshes = 0
        self.busy_s = 0.0  # time spent searching and in other jobs: busy_s / uptime is the owner's load

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ModelOwner:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until loading finished (True when it succeeded)."""
        self._ready.wait(timeout)
        return self.state == "ready"

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the batch in hand, refuse what is still queued, close the pipeline (in its thread)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ submitting
    def check_ready(self) -> None:
        if self.state != "ready":
            raise _loading_error(self.state, self.error)

    def search(self, queries: list[str], params: SearchParams) -> Future[SearchAnswer]:
        """Queue a search; the future gets a `SearchAnswer` (or the pipeline's exception)."""
        self.check_ready()
        job = _SearchJob(list(queries), params)
        with self._cond:
            if self._stopping:
                raise _loading_error("stopped", None)
            self._searches.append(job)
            self._queued_queries += len(job.queries)
            self._cond.notify()
        return job.future

    def call(self, fn: Callable[[Any], T]) -> Future[T]:
        """Run ``fn(pipeline)`` in the owner thread between batches (lookups, encoding for writes)."""
        self.check_ready()
        job = _CallJob(fn)
        with self._cond:
            if self._stopping:
                raise _loading_error("stopped", None)
            self._calls.append(job)
            self._cond.notify()
        return job.future

    def refresh(self) -> Future[IndexView]:
        """Move the read-only view to the newest commit now (the writer calls this before answering)."""
        return self.call(lambda pipe: self._refresh(force=True))

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._setup_threads()
            self._pipe = self._load()
            self._open_probe()
            enc = self._pipe.encoder
            self.encoder_describe = dict(enc.describe())
            self.encoder_source = getattr(enc, "source", None)
            self.encoder = enc  # writers read its tokenizer (passages); its forwards stay in this thread
            self.reranker_loaded = self._pipe.reranker is not None
            if self.reranker_loaded:  # the stored weight each first stage's searches apply, and where it was chosen
                self.rerank_weights = {name: {"alpha": self._pipe.rerank_alpha(None, hybrid=hybrid),
                                              "chosen_over": self._pipe.rerank_alpha_chosen_over(hybrid)}
                                       for name, hybrid in (("dense", False), ("hybrid", True))}
            self.has_bm25 = self._pipe.store.manifest.bm25 is not None
            self.has_passages = self._pipe.passages is not None
            self._set_view()
            self.state = "ready"
        except Exception as exc:  # reported by /health, every 503 and the CLI
            self.error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, (ValueError, OSError)):  # the index or a model as given: damaged, missing, mismatched
                logger.info("loading the index failed: %s", self.error, exc_info=logger.isEnabledFor(logging.DEBUG))
            else:  # a defect: its traceback goes to the log
                logger.exception("loading the index failed")
            self.state = "failed"
            self._ready.set()
            self._drain(_loading_error("failed", self.error))
            self._close()
            return
        self._ready.set()
        try:
            self._loop()
        finally:
            self.state = "stopped"
            self._drain(_loading_error("stopped", None))
            self._close()

    def _setup_threads(self) -> None:
        """Torch and FAISS thread counts for the forwards and searches of this thread.

        With OpenMP (the Linux CPU builds) the count is a setting of the calling thread; where a
        build makes it process-wide, the previous values are restored when the owner stops.
        """
        import faiss
        import torch

        self._saved_threads = (torch.get_num_threads(), faiss.omp_get_max_threads())
        torch.set_num_threads(self.threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # already set, or parallel work has started: keep what is there
            pass
        faiss.omp_set_num_threads(self.threads)

    def _open_probe(self) -> None:
        """A second read-only connection in autocommit mode: it sees each new commit's generation at once."""
        from twotower.indexing.docstore import DocStore
        from twotower.indexing.store import DOCS_NAME

        self._generation_probe = DocStore(self._pipe.store.directory / DOCS_NAME, readonly=True)

    def newest_generation(self) -> int:
        value = self._generation_probe.get_meta("generation")
        return int(value) if value is not None and value.isdigit() else -1

    def _set_view(self) -> None:
        store = self._pipe.store
        self.view = IndexView(store.generation, len(self._pipe), self._pipe.info())  # documents, not passages

    def _refresh(self, force: bool = False) -> IndexView:
        store = self._pipe.store
        if force or self.newest_generation() != store.generation:
            if store.refresh():
                self.refreshes += 1
                logger.info("moved to generation %d (%d documents)", store.generation, len(store))
            self._set_view()
        return self.view

    def _loop(self) -> None:
        while True:
            batch, call = self._take()
            if batch is None and call is None:
                return
            try:
                self._refresh()
            except Exception as exc:
                logger.exception("picking up a new commit failed")
                for job in batch or []:
                    job.future.set_exception(exc)
                batch = None
            if batch:
                self._run_batch(batch)
            if call is not None:
                self._run_call(call)

    def _take(self) -> tuple[list[_SearchJob] | None, _CallJob | None]:
        """The next batch of searches and/or one other job; (None, None) when stopping."""
        with self._cond:
            while not (self._searches or self._calls or self._stopping):
                self._cond.wait()
            if self._stopping:
                return None, None
            batch = None
            if self._searches:
                target = min(self.max_batch, self._last_batch)
                deadline = time.monotonic() + self.max_wait
                while self._queued_queries < target and not self._stopping:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch, n = [], 0
                while self._searches and (not batch or n + len(self._searches[0].queries) <= self.max_batch):
                    job = self._searches.popleft()
                    batch.append(job)
                    n += len(job.queries)
                self._queued_queries -= n
                self._last_batch = max(1, n)
            call = self._calls.popleft() if self._calls else None
            return batch, call

    def _run_batch(self, batch: list[_SearchJob]) -> None:
        groups: dict[tuple, list[_SearchJob]] = {}
        for job in batch:
            if job.future.set_running_or_notify_cancel():
                groups.setdefault(job.params.group, []).append(job)
        generation = self._pipe.store.generation
        for jobs in groups.values():
            try:
                self._search_group(jobs, generation)
            except Exception:
                if len(jobs) == 1:
                    continue  # its future holds the exception
                # One request's queries failed the batch: answer each request alone, so the error reaches
                # only the client that sent it (a lone surrogate made every search batched with it a 500).
                for job in jobs:
                    try:
                        self._search_group([job], generation)
                    except Exception:
                        pass

    def _search_group(self, jobs: list[_SearchJob], generation: int) -> None:
        """Answer `jobs` (equal `SearchParams.group`) with one pipeline call; on failure, a one-job group's
        future gets the exception and the exception is raised again."""
        params = jobs[0].params
        queries = [q for job in jobs for q in job.queries]
        k = max(job.params.k for job in jobs)
        start = time.perf_counter()
        try:
            hits = self._pipe.search(queries, k=k, recall_k=params.recall_k, rerank=params.rerank,
                                     hybrid=params.hybrid, rerank_k=params.rerank_k, filter=params.filter,
                                     aggregate=params.aggregate)
        except Exception as exc:
            if len(jobs) == 1:
                jobs[0].future.set_exception(exc)
            raise
        finally:
            self.busy_s += time.perf_counter() - start
        self.batches += 1
        self.batched_queries += len(queries)
        self.max_batch_seen = max(self.max_batch_seen, len(queries))
        pos = 0
        for job in jobs:
            rows = hits[pos:pos + len(job.queries)]
            pos += len(job.queries)
            job.future.set_result(SearchAnswer([row[:job.params.k] for row in rows], generation))

    def _run_call(self, call: _CallJob) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        start = time.perf_counter()
        try:
            call.future.set_result(call.fn(self._pipe))
        except BaseException as exc:
            call.future.set_exception(exc)
        finally:
            self.busy_s += time.perf_counter() - start

    def _drain(self, exc: Exception) -> None:
        with self._cond:
            jobs = list(self._searches) + list(self._calls)
            self._searches.clear()
            self._calls.clear()
            self._queued_queries = 0
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(exc)

    def _close(self) -> None:
        for obj in (self._generation_probe, self._pipe):
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # pragma: no cover - closing on shutdown
                    logger.exception("closing failed")
        if self._saved_threads is not None:
            import faiss
            import torch

            torch.set_num_threads(self._saved_threads[0])
            faiss.omp_set_num_threads(self._saved_threads[1])

    # ------------------------------------------------------------------ numbers
    def batch_stats(self) -> dict[str, Any]:
        return {"batches": self.batches, "queries": self.batched_queries,
                "mean_queries_per_batch": round(self.batched_queries / self.batches, 2) if self.batches else None,
                "max_queries_per_batch": self.max_batch_seen, "refreshes": self.refreshes,
                "busy_s": round(self.busy_s, 3),
                "threads": self.threads, "max_batch": self.max_batch, "max_wait_ms": self.max_wait * 1000}
