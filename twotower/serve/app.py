"""The HTTP routes of ``twotower serve`` (FastAPI): search, documents, health, stats, and the page.

    GET    /search?q=&k=&recall_k=&hybrid=&bm25=&rerank=&rerank_k=&filter=&aggregate=   one query
    POST   /search            {"queries": [...], "k", "recall_k", "hybrid", "bm25", "rerank", "rerank_k",
                               "filter", "aggregate"}
    POST   /documents         {"documents": [{"_id", "title", "text", "metadata"}], "replace": false}
    DELETE /documents         {"ids": [...]}
    GET    /documents/{id}
    GET    /health            public: loading / ok / failed, and what the index can do
    GET    /stats             documents, model and index fingerprints, request counts and latency percentiles
    GET    /                  the search page;  GET /docs the API reference (from /openapi.json)

Hits have the fields of ``twotower search --json`` (`Hit.to_dict`).  Every answer to a
search names the index generation (commit) it was answered from.  The routes only check
input and wait: the model owner (`twotower.serve.batcher`) does the searching, the
writer (`twotower.serve.writer`) the writing.  A route waits for the owner at most
``request_timeout_s`` and withdraws its job when its client disconnects (`SearchService.answer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote_to_bytes

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from twotower import __version__
from twotower.common.file_lock import LOCK_WAIT_S
from twotower.common.lines import RepeatedKeyError, json_problem, no_repeated_keys, query_problem
from twotower.indexing.filters import FilterError, parse_filter
from twotower.retrieval.hit import Hit
from twotower.retrieval.passages import AGGREGATIONS
from twotower.retrieval.rerank import DEFAULT_RECALL_K, DEFAULT_RERANK_K, recall_depth
from twotower.serve.auth import Access
from twotower.serve.batcher import ModelOwner, SearchParams
from twotower.serve.errors import ApiError, install_handlers
from twotower.serve.limits import BodyLimitMiddleware, Limits
from twotower.serve.stats import RequestStats, StatsMiddleware
from twotower.serve.writer import IndexWriter

logger = logging.getLogger(__name__)
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
SEARCH_PARAMS = ("q", "k", "recall_k", "hybrid", "bm25", "rerank", "rerank_k", "filter", "aggregate")
FILTER_HELP = 'metadata filter, e.g. lang == "en" and year >= 2010 (the filter language of the docs)'
AGGREGATE_HELP = ("an index built with --passages: a document's score from its passages' first-stage scores: max "
                  "(its best passage), sum (of its passages among the fetched rows) or first (its first passage)")
T = TypeVar("T")
# /stats lists at most this many metadata fields (sorted), with their count: an index whose metadata keys are
# data (one per tag, say) would otherwise make every /stats answer as large as that set
MAX_LISTED_FIELDS = 100
# The page's answers (/, /docs and /static): it loads nothing from elsewhere and runs no inline script or style,
# so the browser may refuse anything else; no site may frame it (clickjacking the token box); files are what
# their Content-Type says.  /docs keeps its inline script and style: it gets the last two only.
FRAME_HEADERS = {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff"}
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'", **FRAME_HEADERS}
# Threads of the writes (their own, not asyncio's default pool): a write waiting for its turn holds one up to
# lock_wait_s, and the default pool (6 threads on 2 cores) also runs the shutdown's `ModelOwner.stop`.  Writes run
# one at a time; writes past these wait for a thread (a stop still answers them at once).
WRITE_THREADS = 4
# A stopping server says in its log when the writes it waits for are not done by then (a commit, a Milvus flush or
# a segment merge finishing): it waits for them to the end, since the process could not exit before them anyway.
STOP_NOTE_S = 2.0
# ... and then waits at most this long for those writes' answers to be sent: a client that does not read its
# answer (one over the socket's buffer) held the shutdown for ever, though nothing was left to write.
STOP_ANSWERS_S = 5.0
# /stats after another process's commit: how long it waits for the server to move to that commit before answering
# from the one in hand (with `newest_generation` larger than `generation`) rather than a 503 or a minute's wait.
STATS_MOVE_WAIT_S = 1.0
RERANK_K_HELP = ("candidates the cross-encoder scores, the first stage's top rerank_k (1..recall_k); "
                 f"default min({DEFAULT_RERANK_K}, recall_k)")


@dataclass
class ServeConfig:
    """Everything a server needs; `twotower serve` fills it from its flags.

    Args:
        index: the index directory.
        model: query encoder directory (None: the one the manifest names).
        reranker: cross-encoder directory (None: the index's default when `use_default_reranker`).
        token: the bearer token (None: reads are open, writes refused).
        threads: torch/FAISS threads of the model owner (None: `default_threads`: all cores in fp32, all but one with bf16).
        max_batch / max_wait_ms: micro-batching bounds (`ModelOwner`).
        max_queued: most queries waiting for the model owner, and most lookups (None: 4 x max_batch); a search
            past it is answered 503 with Retry-After at once (`ModelOwner`).
        request_timeout_s: longest a search or lookup waits for its answer; then it is withdrawn (never run if
            it had not started) and answered 503 with Retry-After.  A client that disconnects withdraws it too.
        body_timeout_s: longest a request may take to send its body (from its arrival); then 408
            (`BodyLimitMiddleware`): a client trickling a body cannot hold a connection, or a shutdown, open.
        default_recall_k: recall_k when a request gives none (raised to k when smaller).
    """

    index: str
    model: str | None = None
    reranker: str | None = None
    use_default_reranker: bool = True
    read_only: bool = False
    token: str | None = None
    limits: Limits = field(default_factory=Limits)
    threads: int | None = None
    max_batch: int = 64
    max_wait_ms: float = 3.0
    max_queued: int | None = None
    request_timeout_s: float = 60.0
    body_timeout_s: float = 30.0
    default_recall_k: int = DEFAULT_RECALL_K
    lock_wait_s: float = LOCK_WAIT_S
    bf16: bool | str = "auto"


# ---------------------------------------------------------------------- request and response bodies
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BatchSearchBody(_Strict):
    # strict: JSON has types, so `"k": true` or `"k": "3"` is a client's mistake, not 1 and 3 (pydantic's lax
    # mode read them so); query-string parameters are text and keep the lax reading.
    queries: list[str] = Field(description="query texts, answered in order")
    k: int = Field(10, description="hits per query", strict=True)
    recall_k: int | None = Field(None, description="first-stage candidates (reranked); default max(100, k)",
                                 strict=True)
    hybrid: bool = Field(False, description="fuse dense and BM25 recall (index built with --bm25)", strict=True)
    bm25: bool = Field(False, description="recall by BM25 alone, no dense recall (index built with --bm25; not "
                                          "with hybrid)", strict=True)
    rerank: bool | None = Field(None, description="rerank with the cross-encoder; default: when one is loaded",
                                strict=True)
    rerank_k: int | None = Field(None, description=RERANK_K_HELP, strict=True)
    filter: str | None = Field(None, description=FILTER_HELP)
    aggregate: str | None = Field(None, description=AGGREGATE_HELP)


class AddDocumentsBody(_Strict):
    documents: list[dict[str, Any]] = Field(description="BEIR-style documents: _id, text, optional title/metadata")
    replace: bool = Field(False, description="replace documents whose _id is already in the index", strict=True)


class DeleteDocumentsBody(_Strict):
    # an integer is an id as in POST /documents and corpus files ({"_id": 42} is stored as "42")
    ids: list[StrictStr | StrictInt] = Field(description="ids to delete; all must exist, else nothing is deleted")


class SearchOut(BaseModel):
    query: str
    hits: list[Hit]  # the `twotower search --json` record
    generation: int
    reranked: bool
    hybrid: bool
    bm25: bool
    took_ms: float


class BatchSearchOut(BaseModel):
    results: list[dict[str, Any]]
    generation: int
    reranked: bool
    hybrid: bool
    bm25: bool
    took_ms: float


# ---------------------------------------------------------------------- the service
class SearchService:
    """The model owner, the writer, the access policy and the counters of one server."""

    def __init__(self, config: ServeConfig) -> None:
        from twotower.retrieval.pipeline import SearchPipeline

        self.config = config
        self.limits = config.limits
        self.access = Access(config.token, config.read_only)
        self.stats = RequestStats()

        def load() -> Any:
            return SearchPipeline.load(config.index, config.model, reranker=config.reranker,
                                       use_default_reranker=config.use_default_reranker, readonly=True,
                                       bf16=config.bf16)

        self.owner = ModelOwner(load, threads=config.threads, max_batch=config.max_batch,
                                max_wait_ms=config.max_wait_ms, max_queued=config.max_queued)
        self.writer = IndexWriter(config.index, self.owner, config.lock_wait_s)
        self._writing: set[asyncio.Task] = set()  # the requests a write runs for, until each has answered
        self._running: set[asyncio.Future] = set()  # the writes' threads' work, until each has returned
        self._write_threads = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="twotower-write")
        # the owner's job that moves it to the newest commit for /stats: one, shared by the /stats waiting for it,
        # never withdrawn nor bounded (each /stats queued its own, counted "abandoned" at its timeout and "refused"
        # when the lookups' queue was full)
        self._move: Future[None] | None = None

    async def write(self, job: Callable[[threading.Event, float], T]) -> T:
        """The answer of `job` (a write, blocking: run in a write thread, given the event that stops it and its
        deadline for its turn, `IndexWriter.deadline`), even when this handler is cancelled, once or many times.

        The deadline is set here, at submission: set when a thread took the job, a write behind `WRITE_THREADS`
        others waited lock_wait_s for each round of them before its 503.  A write submitted once the server is
        stopping is `WriteStopped` at once (the writes' threads may be shut down: that was a plain 500).

        Why: past the graceful shutdown's deadline uvicorn cancels the requests in flight; a write's was answered
        a plain-text 500 while its thread went on, and could still commit. Now a cancel stops this write
        (`IndexWriter.stop_write`: before its commit, where it still can) and the handler waits for it, so the
        client hears what happened: 503 "nothing was written", or the commit it made; a cancel that lands once
        the write has returned is answered with what it returned. `stop_writes` waits for the writes, and at most
        `STOP_ANSWERS_S` for these answers, before the model owner stops.
        """
        self.writer.check_stopped()
        deadline = self.writer.deadline()
        task = asyncio.current_task()
        if task is not None:
            self._writing.add(task)
            task.add_done_callback(self._writing.discard)  # once the answer is sent (the task is uvicorn's)
        cut = threading.Event()
        call = functools.partial(contextvars.copy_context().run, job, cut, deadline)
        running = asyncio.get_running_loop().run_in_executor(self._write_threads, call)
        self._running.add(running)
        running.add_done_callback(self._running.discard)
        while not running.done():
            try:
                await asyncio.shield(running)  # a cancel cancels this wait, never the write
            except asyncio.CancelledError:
                self.writer.stop_write(cut)
        return running.result()

    async def stop_writes(self) -> None:
        """Before the model owner stops: every write stops where it still can (or finishes its commit) and returns;
        they need the owner to the end (encoding, the move to their commit).  Their answers then get
        `STOP_ANSWERS_S` to be sent: they need nothing more, and a client that does not read its answer must not
        hold the shutdown (it waited for the requests without a bound)."""
        self.writer.stop()
        running = {f for f in self._running if not f.done()}
        if running:
            _, pending = await asyncio.wait(running, timeout=STOP_NOTE_S)
            if pending:
                logger.warning("stopping: waiting for the write in progress to finish its commit")
                await asyncio.wait(pending)
        me = asyncio.current_task()
        answering = {t for t in self._writing if t is not me and not t.done()}
        if answering:
            await asyncio.wait(answering, timeout=STOP_ANSWERS_S)
        self._write_threads.shutdown(wait=False)

    # ---- input checks (the request's own names in every message)
    def query(self, q: str, name: str) -> str:
        problem = query_problem(q, name)
        if problem:
            raise ApiError(400, problem, name)
        if len(q) > self.limits.max_query_chars:
            raise ApiError(413, f"{name}: the query has {len(q):,} characters; the limit is "
                                f"{self.limits.max_query_chars:,}", name)
        return q

    def params(self, k: int, recall_k: int | None, hybrid: bool, rerank: bool | None,
               rerank_k: int | None = None, filter: str | None = None, aggregate: str | None = None, *,
               bm25: bool = False) -> SearchParams:
        lim, owner = self.limits, self.owner
        flt = None
        if filter is not None and filter.strip():  # blank (an empty form field): no filter
            try:
                flt = parse_filter(filter)
            except FilterError as e:
                raise ApiError(400, e.line, "filter", details={"column": e.column}) from None
        if not 1 <= k <= lim.max_k:
            raise ApiError(400, f"k must be between 1 and {lim.max_k}, got {k}", "k")
        recall_k = recall_depth(recall_k, k, self.config.default_recall_k)
        if not k <= recall_k <= lim.max_recall_k:
            raise ApiError(400, f"recall_k must be between k ({k}) and {lim.max_recall_k}, got {recall_k}",
                           "recall_k")
        if rerank_k is not None and not 1 <= rerank_k <= recall_k:
            raise ApiError(400, f"rerank_k must be between 1 and recall_k ({recall_k}), got {rerank_k}", "rerank_k")
        if hybrid and bm25:
            from twotower.retrieval.interpolation import both_recalls

            raise ApiError(400, both_recalls("bm25=true", "hybrid=true"), "bm25")
        owner.check_ready()
        if hybrid and not owner.has_bm25:
            raise ApiError(400, "hybrid: this index has no BM25 (build it with `twotower index build --bm25`)",
                           "hybrid")
        if bm25 and not owner.has_bm25:
            raise ApiError(400, "bm25: this index has no BM25 (build it with `twotower index build --bm25`)", "bm25")
        if rerank is None:
            rerank = owner.reranker_loaded
        elif rerank and not owner.reranker_loaded:
            raise ApiError(400, "rerank: no reranker is loaded (start the server with --reranker DIR)", "rerank")
        if rerank_k is not None and not rerank:  # it was ignored without a word
            why = ("rerank=false turns reranking off" if owner.reranker_loaded else
                   "no reranker is loaded (start the server with --reranker DIR)")
            raise ApiError(400, f"rerank_k sets how many candidates the reranker scores, but {why}", "rerank_k")
        if aggregate is not None:
            if aggregate not in AGGREGATIONS:
                raise ApiError(400, f"aggregate must be one of {', '.join(AGGREGATIONS)}, got {aggregate!r}",
                               "aggregate")
            if not owner.has_passages:  # it would be ignored without a word
                raise ApiError(400, "aggregate: this index stores documents whole (built without --passages); "
                                    "leave aggregate out", "aggregate")
        if aggregate is None and owner.has_passages:  # the default, spelled out: one batch with those saying "max"
            aggregate = "max"
        return SearchParams(k=k, recall_k=recall_k, hybrid=hybrid, bm25=bm25, rerank=rerank, rerank_k=rerank_k,
                            filter=flt, aggregate=aggregate)

    async def answer(self, request: Request, future: Future[T], what: str) -> T:
        """The owner's answer to `future`, awaited while watching the client: if it disconnects, or the answer
        takes longer than `request_timeout_s`, the job is withdrawn (the owner never runs a job withdrawn before
        it started) and the request is answered 499 (nobody reads it) or 503 with Retry-After.

        Starlette does not cancel a handler whose client went away, so the handler watches ``receive`` for
        ``http.disconnect`` itself (the body, if any, was read before the handler ran).
        """
        waiting = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            done, _ = await asyncio.wait((waiting, gone), timeout=self.config.request_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this handler was cancelled (a shutdown past its grace period)
            future.cancel()
            waiting.cancel()
            raise
        finally:
            gone.cancel()
        if waiting in done:
            return waiting.result()
        future.cancel()  # withdrawn if still queued; a job already running finishes and its answer is dropped
        waiting.cancel()
        if gone in done:
            raise ApiError(499, f"the client closed the connection before the {what} was answered")
        raise ApiError(503, f"the {what} was not answered within {self.config.request_timeout_s:g} s (the server "
                            "is overloaded); retry later", headers={"Retry-After": "5"})

    async def search(self, request: Request, queries: list[str],
                     params: SearchParams) -> tuple[list[list[dict]], int]:
        try:
            answer = await self.answer(request, self.owner.search(queries, params), "search")
        except FilterError as e:  # a field no document of the index has (checked against the commit searched)
            raise ApiError(400, e.line, "filter", details={"column": e.column}) from None
        return [[h.to_dict() for h in row] for row in answer.hits], answer.generation

    def health(self) -> tuple[int, dict[str, Any]]:
        o = self.owner
        body: dict[str, Any] = {"status": {"ready": "ok"}.get(o.state, o.state), "version": __version__,
                                "auth_required": self.access.auth_required, "read_only": self.access.read_only,
                                "writable": self.access.writable}
        if o.state == "ready":
            body.update(reranker=o.reranker_loaded, hybrid=o.has_bm25, bm25=o.has_bm25, passages=o.has_passages,
                        limits=asdict(self.limits))
        if o.error:
            body["error"] = o.error
        return (200 if o.state == "ready" else 503), body

    async def stats_answer(self) -> dict[str, Any]:
        """The /stats body, of the newest commit when the server can move there within `STATS_MOVE_WAIT_S`.

        Why: /stats showed the commit before another process's until a search moved the server; waiting for the
        move as a job of the owner then answered 503 "busy" or waited up to `request_timeout_s`, and retried (with
        a traceback in the log) a commit that had failed to load on every call.  Now the wait is short, a failed
        commit is not retried here (searches retry it), and otherwise the body is the current one, with
        `newest_generation` saying that a newer commit exists.
        """
        owner = self.owner
        owner.check_ready()
        newest = await asyncio.to_thread(owner.newest_generation)  # one SQLite read: off the event loop
        if newest is not None and newest != owner.view.generation and newest != owner.failed_generation:
            future = self._move
            if future is None or future.done():
                try:  # any job of the owner moves it there first
                    future = self._move = owner.call(lambda pipe: None)
                except ApiError:  # the owner is stopping: the body in hand
                    future = None
            if future is not None:
                with contextlib.suppress(Exception):  # a timeout, or the owner stopped: the body in hand
                    await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), STATS_MOVE_WAIT_S)
        body = self.stats_body()
        body["newest_generation"] = max(newest if newest is not None else -1, body["generation"])
        return body

    def stats_body(self) -> dict[str, Any]:
        o = self.owner
        o.check_ready()
        view = o.view
        info = view.info
        pipeline = (info.get("extra") or {}).get("pipeline") or {}
        corpus = pipeline.get("corpus") or {}
        return {
            "documents": view.documents,
            "generation": view.generation,
            "index": {"directory": info.get("directory"), "type": info.get("factory"), "metric": info.get("metric"),
                      "dim": info.get("dim"), "bm25": bool(info.get("bm25")),
                      "tombstones": info.get("tombstones"),
                      "metadata_fields": list(view.metadata_fields[:MAX_LISTED_FIELDS]),
                      "metadata_field_count": len(view.metadata_fields),
                      "encoder_fingerprint": (pipeline.get("encoder") or {}).get("fingerprint"),
                      "corpus_sha256": corpus.get("sha256")},
            "model": {"source": o.encoder_source, "name": o.encoder_name,
                      "fingerprint": o.encoder_describe.get("fingerprint"),
                      "dim": o.encoder_describe.get("dim"),
                      "query_max_length": o.encoder_describe.get("query_max_length")},
            "reranker": {"loaded": o.reranker_loaded,
                         "source": (self.config.reranker or pipeline.get("reranker")) if o.reranker_loaded else None,
                         "weights": o.rerank_weights},
            "requests": self.stats.snapshot(),
            "batching": o.batch_stats(),
            "writes": self.writer.writes,
            "limits": asdict(self.limits),
        }


def _reject_unknown(request: Request, allowed: tuple[str, ...]) -> None:
    """Refuse a query parameter the endpoint does not read, one given twice (the last one won, silently), and
    one whose bytes are not UTF-8 (Starlette replaces them with U+FFFD: `q=caf%E9` searched "caf\ufffd")."""
    for part in request.scope.get("query_string", b"").split(b"&"):
        name, _, value = part.partition(b"=")
        try:
            unquote_to_bytes(name.replace(b"+", b" ")).decode("utf-8")
            unquote_to_bytes(value.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            field = unquote_to_bytes(name).decode("utf-8", "replace")
            raise ApiError(400, f"{field}: not UTF-8 text; percent-encode the UTF-8 bytes of the text "
                                "(caf%C3%A9 for café)", field) from None
    names = [p for p, _ in request.query_params.multi_items()]
    unknown = [p for p in names if p not in allowed]
    if unknown:
        takes = f"takes {', '.join(allowed)}" if allowed else "takes no query parameters (send JSON in the body)"
        raise ApiError(400, f"unknown parameter {unknown[0]!r}; this endpoint {takes}", unknown[0])
    twice = next((p for i, p in enumerate(names) if p in names[:i]), None)
    if twice is not None:
        raise ApiError(400, f"parameter {twice!r} is given {names.count(twice)} times; give it once", twice)


class _StrictJSONRequest(Request):
    """A request whose JSON body refuses repeated keys, as the query string refuses repeated parameters."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = json.loads(await self.body(), object_pairs_hook=no_repeated_keys)
            except RepeatedKeyError as exc:
                raise ApiError(400, str(exc), exc.key) from None
        return self._json


class _StrictJSONRoute(APIRoute):
    """Hands every endpoint a `_StrictJSONRequest` (FastAPI parses bodies with ``request.json()``)."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Any:
            return await handler(_StrictJSONRequest(request.scope, request.receive))

        return strict


def create_app(config: ServeConfig) -> FastAPI:
    """The FastAPI application; the model owner starts (and loads the index) with the app's lifespan."""
    service = SearchService(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.owner.start()
        try:
            yield
        finally:
            await service.stop_writes()
            await asyncio.to_thread(service.owner.stop)
            await asyncio.to_thread(service.writer.collect_garbage)  # alone now: the owner's store is closed

    app = FastAPI(title="twotower search", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url="/openapi.json",
                  description="Dense, BM25 and hybrid search with cross-encoder reranking over one twotower index.")
    app.router.route_class = _StrictJSONRoute  # before the routes below are declared
    app.state.service = service
    install_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.limits.max_body_bytes,
                       timeout_s=config.body_timeout_s)
    app.add_middleware(StatsMiddleware, stats=service.stats)  # outermost: times the 413s too
    reader, writer = Depends(service.access.reader), Depends(service.access.writer)

    @app.get("/search", response_model=SearchOut, dependencies=[reader], summary="Search with one query")
    async def search_one(
        request: Request,
        q: str = Query(description="the query text"),
        k: int = Query(10, description="hits to return"),
        recall_k: int | None = Query(None, description="first-stage candidates (reranked); default max(100, k)"),
        hybrid: bool = Query(False, description="fuse dense and BM25 recall"),
        bm25: bool = Query(False, description="recall by BM25 alone, no dense recall (not with hybrid)"),
        rerank: bool | None = Query(None, description="rerank with the cross-encoder; default: when loaded"),
        rerank_k: int | None = Query(None, description=RERANK_K_HELP),
        filter: str | None = Query(None, description=FILTER_HELP),
        aggregate: str | None = Query(None, description=AGGREGATE_HELP),
    ) -> JSONResponse:
        start = time.perf_counter()
        _reject_unknown(request, SEARCH_PARAMS)
        q = service.query(q, "q")
        params = service.params(k, recall_k, hybrid, rerank, rerank_k, filter, aggregate, bm25=bm25)
        rows, generation = await service.search(request, [q], params)
        return JSONResponse({"query": q, "hits": rows[0], "generation": generation, "reranked": _cross_encoder_ran(rows),
                             "hybrid": params.hybrid, "bm25": params.bm25,
                             "took_ms": round((time.perf_counter() - start) * 1000, 3)})

    @app.post("/search", response_model=BatchSearchOut, dependencies=[reader], summary="Search with a batch of queries")
    async def search_batch(request: Request, body: BatchSearchBody) -> JSONResponse:
        start = time.perf_counter()
        _reject_unknown(request, ())
        if not body.queries:
            raise ApiError(400, "queries: give at least one query", "queries")
        if len(body.queries) > service.limits.max_batch_queries:
            raise ApiError(413, f"queries: {len(body.queries)} queries; the limit is "
                                f"{service.limits.max_batch_queries} per request", "queries")
        queries = [service.query(q, f"queries[{i}]") for i, q in enumerate(body.queries)]
        params = service.params(body.k, body.recall_k, body.hybrid, body.rerank, body.rerank_k, body.filter,
                                body.aggregate, bm25=body.bm25)
        rows, generation = await service.search(request, queries, params)
        return JSONResponse({"results": [{"query": q, "hits": r} for q, r in zip(queries, rows)],
                             "generation": generation, "reranked": _cross_encoder_ran(rows), "hybrid": params.hybrid,
                             "bm25": params.bm25, "took_ms": round((time.perf_counter() - start) * 1000, 3)})

    @app.post("/documents", dependencies=[writer], summary="Add documents (or replace them with replace=true)")
    async def add_documents(request: Request, body: AddDocumentsBody) -> dict[str, Any]:
        return await service.write(lambda cut, deadline: _add_documents(request, body, cut, deadline))

    def _add_documents(request: Request, body: AddDocumentsBody, cut: threading.Event,
                       deadline: float) -> dict[str, Any]:
        from twotower.retrieval.corpus import parse_document

        service.writer.check_stopped(cut)  # stopped while it waited for a thread: parse nothing
        _reject_unknown(request, ())
        lim = service.limits
        if not body.documents:
            raise ApiError(400, "documents: give at least one document", "documents")
        if len(body.documents) > lim.max_documents:
            raise ApiError(413, f"documents: {len(body.documents)} documents; the limit is {lim.max_documents} "
                                "per request", "documents")
        docs, first = [], {}
        for i, raw in enumerate(body.documents):
            try:
                doc = parse_document(raw, f"documents[{i}]")
            except ValueError as exc:
                sub = getattr(exc, "field", None)  # DataError names the document's field at fault
                raise ApiError(400, str(exc), f"documents[{i}]" + (f".{sub}" if sub else "")) from None
            if doc["id"] in first:
                raise ApiError(400, f"documents[{i}]: _id {doc['id']!r} repeats documents[{first[doc['id']]}]",
                               f"documents[{i}]._id")
            first[doc["id"]] = i
            docs.append(doc)
        service.owner.check_ready()
        return service.writer.add(docs, body.replace, cut, deadline)

    @app.delete("/documents", dependencies=[writer], summary="Delete documents by id (all or none)")
    async def delete_documents(request: Request, body: DeleteDocumentsBody) -> dict[str, Any]:
        return await service.write(lambda cut, deadline: _delete_documents(request, body, cut, deadline))

    def _delete_documents(request: Request, body: DeleteDocumentsBody, cut: threading.Event,
                          deadline: float) -> dict[str, Any]:
        service.writer.check_stopped(cut)  # stopped while it waited for a thread
        _reject_unknown(request, ())
        if not body.ids:
            raise ApiError(400, "ids: give at least one id", "ids")
        if len(body.ids) > service.limits.max_ids:
            raise ApiError(413, f"ids: {len(body.ids)} ids; the limit is {service.limits.max_ids} per request",
                           "ids")
        ids = [str(doc_id) for doc_id in body.ids]
        for i, doc_id in enumerate(ids):
            problem = "empty id" if not doc_id.strip() else json_problem(doc_id, "the id")
            if problem:
                raise ApiError(400, f"ids[{i}]: {problem}", f"ids[{i}]")
        service.owner.check_ready()
        return service.writer.delete(ids, cut, deadline)

    @app.get("/documents/{doc_id:path}", dependencies=[reader], summary="One document by id")
    async def get_document(request: Request, doc_id: str) -> dict[str, Any]:
        _reject_unknown(request, ())
        if len(doc_id) > service.limits.max_query_chars:
            raise ApiError(413, f"id: {len(doc_id):,} characters; the limit is {service.limits.max_query_chars:,}",
                           "id")
        # pipe.get: a document split into passages comes back whole (with its passages' offsets)
        fut = service.owner.call(lambda pipe: (pipe.get([doc_id])[0], pipe.store.generation), bounded=True)
        doc, generation = await service.answer(request, fut, "lookup")
        if doc is None:
            raise ApiError(404, f"no document with id {doc_id!r}", "id")
        return {**doc, "generation": generation}

    @app.get("/health", summary="Liveness and readiness (public)")
    @app.head("/health", include_in_schema=False)  # uptime probes (one operation in the API reference)
    async def health() -> JSONResponse:
        status, body = service.health()
        # loading: as searches say; a failed load does not mend by retrying
        retry = {"Retry-After": "2"} if body["status"] == "loading" else None
        return JSONResponse(body, status_code=status, headers=retry)

    @app.get("/stats", dependencies=[reader], summary="Documents, fingerprints, request counts and latency")
    async def stats(request: Request) -> dict[str, Any]:
        return await service.stats_answer()

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)  # HEAD: uptime probes
    async def page() -> FileResponse:
        return FileResponse(os.path.join(STATIC, "index.html"), media_type="text/html", headers=PAGE_HEADERS)

    @app.api_route("/docs", methods=["GET", "HEAD"], include_in_schema=False)
    async def docs() -> FileResponse:
        return FileResponse(os.path.join(STATIC, "docs.html"), media_type="text/html", headers=FRAME_HEADERS)

    app.mount("/static", _PageFiles(directory=STATIC), name="static")
    return app


class _PageFiles(StaticFiles):
    """The page's static files, with the page's security headers (`PAGE_HEADERS`)."""

    async def get_response(self, path: str, scope: Any) -> Any:
        response = await super().get_response(path, scope)
        response.headers.update(PAGE_HEADERS)
        return response


async def _disconnected(receive: Any) -> None:
    """Return when the client has disconnected (ASGI ``http.disconnect``); never, if ``receive`` fails."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # pragma: no cover - a server that cannot say: then the request deadline alone applies
        await asyncio.Event().wait()


def _cross_encoder_ran(rows: list[list[dict[str, Any]]]) -> bool:
    """Whether any hit carries a cross-encoder score: a reranker whose interpolation weight is 0 is skipped."""
    return any(h.get("rerank_score") is not None for hits in rows for h in hits)
