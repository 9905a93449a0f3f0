"""The model owner: one thread that holds the encoder, the reranker and a read-only view of the index.

Why one thread: on a 2-core machine, two torch forwards at once only fight over the
cores (and a ``SearchPipeline``'s SQLite connection may not cross threads anyway).  So
every request that needs a model or the index is a job for this thread:

* **searches are micro-batched**: the thread takes every search waiting in the queue
  (up to ``max_batch`` queries); when fewer are waiting than the last batch held, it
  waits up to ``max_wait_ms`` for the rest to arrive, so a steady load of N clients is
  served N queries per forward instead of one.  A single client never waits (its last
  batch held one query).  Queries asking for the same (recall_k, hybrid, bm25, rerank, rerank_k, ...) are
  encoded together and their candidates reranked in one cross-encoder call; ``k``
  differs freely (the batch searches for the largest and cuts each list).
* **other jobs** (a document lookup, encoding a chunk of documents for a write,
  picking up a new commit) run between batches, one per turn, so a long write cannot
  starve searches and searches cannot starve a write.  A write's encoding chunks are
  *background* jobs: a lookup or a move to a new commit queued after them runs first
  (a lookup waited for all of a 256-document add's chunks: 22 s, ad hoc, CPU-B), and a search waits for at
  most the one chunk running.
* **back-pressure**: at most ``max_queued`` queries wait (default `QUEUE_BATCHES` full
  batches); a search above that is refused at once (503 with ``Retry-After``), and so is a
  lookup above ``max_queued`` waiting lookups.  A job whose future is cancelled while it
  waits (its client went away, or gave up at its deadline) leaves the queue's count at once
  and is never run.  Every future is settled through `_settle`, which leaves an already
  cancelled one alone: nothing a client does can raise in, and so stop, this thread.

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
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, TypeVar

from twotower.retrieval.rerank import DEFAULT_RECALL_K
from twotower.serve.errors import ApiError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Queries that may wait for the model owner, in full batches (`ModelOwner.max_queued`): 4 x 64 = 256 by default.
# Dense, 2 cores answer ~160 queries/s (CPU-A) or ~110 (CPU-B; docs/results.md, HTTP service), so a full queue
# is answered in about 2 s, while the 32-client benchmark never has more than 32 queries waiting; a reranked
# queue (~2.5 queries/s, CPU-A) is the slow end, and the request deadline (ServeConfig.request_timeout_s) bounds it.
QUEUE_BATCHES = 4
RETRY_AFTER_BUSY = "1"  # seconds, in the 503 of a full queue: a full queue drains in about that on 2 cores (dense)


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
    """What a search asks for; queries with equal (recall_k, hybrid, bm25, rerank, rerank_k, filter, aggregate)
    share one batch."""

    k: int = 10
    recall_k: int = DEFAULT_RECALL_K
    hybrid: bool = False
    bm25: bool = False  # recall by BM25 alone (not with hybrid: `SearchService.params` refuses both)
    rerank: bool = False
    rerank_k: int | None = None  # candidates the cross-encoder scores (None: the pipeline's default)
    filter: Any = None  # a parsed metadata filter (twotower.indexing.filters.Filter), or None
    aggregate: str | None = None  # an index with passages: a document's score from its passages' (None: max)

    @property
    def group(self) -> tuple[int, bool, bool, bool, int | None, Any, str | None]:
        return (self.recall_k, self.hybrid, self.bm25, self.rerank, self.rerank_k if self.rerank else None,
                self.filter, self.aggregate)


@dataclass(frozen=True)
class IndexView:
    """What the owner's read-only store holds now (read by the event loop without touching SQLite)."""

    generation: int
    documents: int
    info: dict[str, Any]
    # dotted metadata paths a filter may name (a superset after deletes): the page lists them by its filter box
    metadata_fields: tuple[str, ...] = ()


@dataclass
class SearchAnswer:
    hits: list[list[Any]]  # one list of Hit per query
    generation: int


class _SearchJob:
    __slots__ = ("queries", "params", "future", "queued")

    def __init__(self, queries: list[str], params: SearchParams) -> None:
        self.queries = queries
        self.params = params
        self.future: Future[SearchAnswer] = Future()
        self.queued = False  # counted in ModelOwner._queued_queries (guarded by its condition)


class _CallJob:
    __slots__ = ("fn", "future", "bounded", "queued")

    def __init__(self, fn: Callable[[Any], Any], bounded: bool = False) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()
        self.bounded = bounded  # a client's lookup: counted against max_queued (a write's jobs are not)
        self.queued = False  # counted in ModelOwner._queued_calls


def _settle(future: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Give `future` its result or exception, unless it is already done (cancelled by its waiter): a
    `set_result` on a cancelled future raises `InvalidStateError`, which would end the owner thread."""
    if future.done():
        return
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled between the check and the call
        pass


def _busy(what: str, waiting: int, limit: int) -> ApiError:
    return ApiError(503, f"the server is busy: {waiting:,} {what} are waiting for the model (the limit is "
                         f"{limit:,}); retry shortly", headers={"Retry-After": RETRY_AFTER_BUSY})


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
        max_queued: most queries waiting, and most lookups waiting (None: `QUEUE_BATCHES` x max_batch); a
            search that would pass it is refused with a 503 (one always fits an empty queue).
    """

    def __init__(self, load: Callable[[], Any], *, threads: int | None = None, max_batch: int = 64,
                 max_wait_ms: float = 3.0, max_queued: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if max_queued is not None and max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued}")
        self._load = load
        self.threads = threads or default_threads()
        self.max_batch = max_batch
        self.max_queued = max_queued if max_queued is not None else QUEUE_BATCHES * max_batch
        self.max_wait = max_wait_ms / 1000.0
        self.state = "loading"
        self.error: str | None = None
        self.view: IndexView | None = None
        self.encoder_describe: dict[str, Any] = {}  # DualEncoder.describe(), for writers' encoder check
        self.encoder_source: str | None = None
        self.encoder_name: str | None = None  # what /stats and the page call it (`model_name`), worked out once
        self.reranker_loaded = False
        self.rerank_weights: dict[str, dict[str, Any]] = {}  # {"dense"|"hybrid"|"bm25": {"alpha", "chosen_over"}}
        self.has_bm25 = False
        self.has_passages = False
        self._cond = threading.Condition()
        self._searches: deque[_SearchJob] = deque()
        self._queued_queries = 0
        self._calls: deque[_CallJob] = deque()
        self._background: deque[_CallJob] = deque()  # writes' encoding chunks: after every other job
        self._queued_calls = 0  # bounded (lookup) jobs waiting
        self._stopping = False
        self._last_batch = 1
        self._thread = threading.Thread(target=self._run, name="twotower-model-owner", daemon=True)
        self._ready = threading.Event()
        self._pipe: Any = None
        self._generation_probe: Any = None
        self._probe_lock = threading.Lock()  # `newest_generation` (any thread) against `_close` (the owner's)
        # the newest commit's generation when moving to it last failed (None: it did not): /stats does not try again
        self.failed_generation: int | None = None
        self._saved_threads: tuple[int, int] | None = None
        self.batches = 0
        self.batched_queries = 0
        self.max_batch_seen = 0
        self.refreshes = 0
        self.refused = 0  # searches and lookups refused because too many were waiting
        self.abandoned = 0  # jobs cancelled while they waited (client gone, deadline passed): never run
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
        """Queue a search; the future gets a `SearchAnswer` (or the pipeline's exception).

        An `ApiError` 503 (``Retry-After``) when the queued queries would pass `max_queued`.  Cancelling the
        future before the owner takes the job withdraws it: it is never run.
        """
        self.check_ready()
        job = _SearchJob(list(queries), params)
        n = len(job.queries)
        with self._cond:
            if self._stopping:
                raise _loading_error("stopped", None)
            if self._queued_queries and self._queued_queries + n > self.max_queued:
                self.refused += 1
                raise _busy("queries", self._queued_queries, self.max_queued)
            if len(self._searches) >= self.max_queued:  # withdrawn jobs wait here until taken: drop them now
                self._searches = deque(j for j in self._searches if j.queued)
            self._searches.append(job)
            job.queued = True
            self._queued_queries += n
            self._cond.notify()
        job.future.add_done_callback(lambda f: self._withdraw(job))
        return job.future

    def call(self, fn: Callable[[Any], T], *, bounded: bool = False, background: bool = False) -> Future[T]:
        """Run ``fn(pipeline)`` in the owner thread between batches (lookups, encoding for writes).

        bounded: a client's request (a lookup): refused with a 503 when `max_queued` such jobs wait.  A write's
            jobs are not bounded (a write half encoded must be able to finish).
        background: a write's encoding chunk: it runs only when no other job waits (searches still get a batch
            between two chunks).
        """
        self.check_ready()
        job = _CallJob(fn, bounded)
        with self._cond:
            if self._stopping:
                raise _loading_error("stopped", None)
            if bounded:
                if self._queued_calls >= self.max_queued:
                    self.refused += 1
                    raise _busy("lookups", self._queued_calls, self.max_queued)
                job.queued = True
                self._queued_calls += 1
            (self._background if background else self._calls).append(job)
            self._cond.notify()
        if bounded:
            job.future.add_done_callback(lambda f: self._withdraw(job))
        return job.future

    def _withdraw(self, job: _SearchJob | _CallJob) -> None:
        """A job's future is done: if it was cancelled while queued, it stops counting against the limit."""
        if not job.future.cancelled():
            return
        with self._cond:
            if job.queued:
                job.queued = False
                if isinstance(job, _SearchJob):
                    self._queued_queries -= len(job.queries)
                else:
                    self._queued_calls -= 1
                self.abandoned += 1

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
            if self.encoder_source:
                from twotower.retrieval.manifest import model_name

                self.encoder_name = model_name(self.encoder_source)
            self.encoder = enc  # writers read its tokenizer (passages); its forwards stay in this thread
            self.reranker_loaded = self._pipe.reranker is not None
            if self.reranker_loaded:  # the stored weight each first stage's searches apply, and where it was chosen
                from twotower.retrieval.interpolation import FIRST_STAGES, first_stage_switches

                self.rerank_weights = {stage: {
                    "alpha": self._pipe.rerank_alpha(None, **first_stage_switches(stage)),
                    "chosen_over": self._pipe.rerank_alpha_chosen_over(**first_stage_switches(stage))}
                    for stage in FIRST_STAGES}
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

    def newest_generation(self) -> int | None:
        """The generation of the newest commit in the directory (one SQLite read: call it off the event loop);
        None before loading and once the owner has stopped (its probe is closed)."""
        with self._probe_lock:
            probe = self._generation_probe
            if probe is None or probe.closed:
                return None
            value = probe.get_meta("generation")
        return int(value) if value is not None and value.isdigit() else -1

    def _set_view(self) -> None:
        store = self._pipe.store
        self.view = IndexView(store.generation, len(self._pipe), self._pipe.info(),  # documents, not passages
                              tuple(sorted(store.docstore.metadata_fields())))

    def _refresh(self, force: bool = False) -> IndexView:
        store = self._pipe.store
        newest = self.newest_generation()
        if force or newest != store.generation:
            try:
                moved = store.refresh()
            except Exception:
                self.failed_generation = newest
                raise
            self.failed_generation = None
            if moved:
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
                    _settle(job.future, exc=exc)
                batch = None
            if batch:
                try:
                    self._run_batch(batch)
                except Exception as exc:  # a defect: its clients get a 500, the owner keeps serving
                    logger.exception("a search batch failed")
                    for job in batch:
                        _settle(job.future, exc=exc)
            if call is not None:
                self._run_call(call)

    def _take(self) -> tuple[list[_SearchJob] | None, _CallJob | None]:
        """The next batch of searches and/or one other job, each already RUNNING (its waiter can no longer
        cancel it, so its answer is always taken); (None, None) when stopping.  Withdrawn jobs are dropped."""
        with self._cond:
            while True:
                while not (self._searches or self._calls or self._background or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    return None, None
                batch = self._take_batch() if self._searches else None
                call = self._take_call()
                if batch or call is not None:
                    return batch, call

    def _take_batch(self) -> list[_SearchJob] | None:
        """Up to max_batch queries of the queued searches (`_take`, holding the condition)."""
        target = min(self.max_batch, self._last_batch)
        deadline = time.monotonic() + self.max_wait
        while 0 < self._queued_queries < target and not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cond.wait(left)
        batch: list[_SearchJob] = []
        n = 0
        while self._searches and (not batch or n + len(self._searches[0].queries) <= self.max_batch):
            job = self._searches.popleft()
            if not job.queued:  # withdrawn (cancelled) while it waited, and counted as abandoned then
                continue
            job.queued = False
            self._queued_queries -= len(job.queries)
            if not job.future.set_running_or_notify_cancel():  # cancelled a moment ago, not yet withdrawn
                self.abandoned += 1
                continue
            batch.append(job)
            n += len(job.queries)
        if not batch:
            return None
        self._last_batch = n
        return batch

    def _take_call(self) -> _CallJob | None:
        """The next other job, a background one only when no other waits (`_take`, holding the condition)."""
        while self._calls or self._background:
            job = (self._calls or self._background).popleft()
            if job.bounded:
                if not job.queued:  # withdrawn while it waited
                    continue
                job.queued = False
                self._queued_calls -= 1
            if not job.future.set_running_or_notify_cancel():
                self.abandoned += 1
                continue
            return job
        return None

    def _run_batch(self, batch: list[_SearchJob]) -> None:
        groups: dict[tuple, list[_SearchJob]] = {}
        for job in batch:  # every job is RUNNING (`_take`)
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
                                     hybrid=params.hybrid, bm25=params.bm25, rerank_k=params.rerank_k,
                                     filter=params.filter, aggregate=params.aggregate)
        except Exception as exc:
            if len(jobs) == 1:
                _settle(jobs[0].future, exc=exc)
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
            _settle(job.future, SearchAnswer([row[:job.params.k] for row in rows], generation))

    def _run_call(self, call: _CallJob) -> None:
        start = time.perf_counter()  # the job is RUNNING (`_take`)
        try:
            result = call.fn(self._pipe)
        except BaseException as exc:
            _settle(call.future, exc=exc)
        else:
            _settle(call.future, result)
        finally:
            self.busy_s += time.perf_counter() - start

    def _drain(self, exc: Exception) -> None:
        with self._cond:
            jobs = list(self._searches) + list(self._calls) + list(self._background)
            self._searches.clear()
            self._calls.clear()
            self._background.clear()
            self._queued_queries = 0
            self._queued_calls = 0
            for job in jobs:
                job.queued = False
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                _settle(job.future, exc=exc)

    def _close(self) -> None:
        for obj in (self._generation_probe, self._pipe):
            if obj is not None:
                try:
                    if obj is self._generation_probe:
                        with self._probe_lock:
                            obj.close()
                    else:
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
                "busy_s": round(self.busy_s, 3), "queued_queries": self._queued_queries,
                "max_queued": self.max_queued, "refused": self.refused, "abandoned": self.abandoned,
                "threads": self.threads, "max_batch": self.max_batch, "max_wait_ms": self.max_wait * 1000}
