"""ANN benchmark: the automatically chosen FAISS index vs exact (Flat) search on real sentence embeddings.

Data: English sentences (6-60 words) split from the Project Gutenberg paragraphs in
``gutenberg-en-mlm/train.txt.gz`` (public domain); a seeded random sample of up to
200,000 is the corpus, 1,000 sentences from ``valid.txt.gz`` (other books) are the
queries.  Both are encoded once with all-MiniLM-L6-v2 through our `DualEncoder`
(mean pooling, normalised, max 128 tokens) and cached under ``--cache``
(``runs/ann`` by default; gitignored); encoding is resumable chunk by chunk.

For each corpus size (default 50k, 100k, 200k) the script builds
``indexing.VectorIndex`` with ``factory=None`` (= ``auto_factory(n, dim)``) and with
``"Flat"``, and reports: factory, build seconds, resident memory growth during the
build, serialized size, queries/s (1,000 queries, k=10) and recall@10 of the auto
index against Flat's top 10.  Queries/s is measured two ways, because they favour
different indexes: *batch* (all 1,000 queries in one call: Flat becomes one BLAS
matrix product, its best case) and *single* (one call per query, the ann-benchmarks
protocol and what an online search service sees: Flat must stream the whole matrix
for every query).  For an HNSW auto index efSearch is swept (``--ef``).

    .venv/bin/python benchmarks/ann_recall.py encode            # ~1-2 h on 2 busy CPU cores
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/ann_recall.py run --sizes 50000,100000,200000
    .venv/bin/python benchmarks/ann_recall.py pipeline-index --n 200000   # for pipeline_overhead.py
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

DATA = os.path.join(REPO, "..", "shared", "data", "gutenberg-en-mlm")
_SPLIT = re.compile(r'(?<=[.!?])["\')\]]?\s+(?=["\'(\[]?[A-Z])')
CHUNK = 10_000


def sentences(path: str, lo: int = 6, hi: int = 60) -> list[str]:
    """Sentences of lo..hi words from a one-paragraph-per-line .txt.gz, in file order, de-duplicated."""
    out, seen = [], set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            for s in _SPLIT.split(line.strip()):
                if lo <= len(s.split()) <= hi and s not in seen:
                    seen.add(s)
                    out.append(s)
    return out


def rss_mb() -> float:
    """Current resident set size (MB) from /proc (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cmd_encode(args: argparse.Namespace) -> None:
    from twotower.retrieval import DualEncoder
    from twotower.retrieval.manifest import default_model_dir

    os.makedirs(os.path.join(args.cache, "chunks"), exist_ok=True)
    corpus = sentences(os.path.join(args.data, "train.txt.gz"))
    random.Random(0).shuffle(corpus)
    corpus = corpus[: args.n]
    queries = sentences(os.path.join(args.data, "valid.txt.gz"))
    random.Random(1).shuffle(queries)
    queries = queries[: args.queries]
    print(f"{len(corpus)} corpus sentences, {len(queries)} queries", flush=True)
    with open(os.path.join(args.cache, "meta.json"), "w") as f:
        json.dump({"n": len(corpus), "queries": len(queries), "max_length": args.max_length,
                   "model": "all-MiniLM-L6-v2"}, f)
    de = DualEncoder.from_pretrained(default_model_dir(), max_length=args.max_length)
    qpath = os.path.join(args.cache, "queries.npy")
    if not os.path.isfile(qpath):
        np.save(qpath, de.encode_queries(queries, batch_size=128))
    t0 = time.time()
    for c, start in enumerate(range(0, len(corpus), CHUNK)):
        path = os.path.join(args.cache, "chunks", f"chunk-{c:04d}.npy")
        if os.path.isfile(path):
            continue
        vecs = de.encode_documents(corpus[start:start + CHUNK], batch_size=128)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            np.save(f, vecs)
        os.replace(tmp, path)
        print(f"chunk {c}: {start + len(vecs)} / {len(corpus)} encoded ({time.time() - t0:.0f}s)", flush=True)


def load_corpus(cache: str, n: int) -> np.ndarray:
    chunks = sorted(os.listdir(os.path.join(cache, "chunks")))
    parts, have = [], 0
    for name in chunks:
        if have >= n:
            break
        parts.append(np.load(os.path.join(cache, "chunks", name)))
        have += len(parts[-1])
    if have < n:
        raise SystemExit(f"only {have} vectors encoded in {cache}; run `encode` first (wanted {n})")
    return np.concatenate(parts)[:n]


CLOCK = time.perf_counter


def _qps(index, queries: np.ndarray, k: int, repeats: int, single: bool, **params) -> tuple[float, list[list[str]]]:
    """Queries per second, best of `repeats`: one batched call, or one call per query (ann-benchmarks style)."""
    best, ids = float("inf"), None
    for _ in range(repeats):
        t = CLOCK()
        if single:
            ids = [index.search(queries[i:i + 1], k, **params).ids[0] for i in range(len(queries))]
        else:
            ids = index.search(queries, k, **params).ids
        best = min(best, CLOCK() - t)
    return len(queries) / best, ids


def recall_against(approx: list[list[str]], exact: list[list[str]]) -> float:
    """Mean over queries of |approx & exact| / |exact|: recall@k of a search against the exact top k
    (shared by the index benchmarks)."""
    return float(np.mean([len(set(a) & set(e)) / len(e) for a, e in zip(approx, exact)]))


def cmd_run(args: argparse.Namespace) -> None:
    import faiss

    from twotower.indexing import VectorIndex

    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time
    faiss.omp_set_num_threads(args.threads)
    queries = np.load(os.path.join(args.cache, "queries.npy"))
    sizes = [int(s) for s in args.sizes.split(",")]
    all_vecs = load_corpus(args.cache, max(sizes))
    ids_all = [f"s{i}" for i in range(len(all_vecs))]
    rows, sweeps = [], []
    for n in sizes:
        vecs, ids = all_vecs[:n], ids_all[:n]
        out: dict = {"n": n}
        for name, factory in (("flat", "Flat"), ("auto", args.factory)):
            before = rss_mb()
            t = time.perf_counter()
            index = VectorIndex.build(ids, vecs, factory=factory, metric="cosine")
            build_s = time.perf_counter() - t
            mem = rss_mb() - before
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "v.faiss")
                index.save(path)
                size_mb = os.path.getsize(path) / 2**20
            qps_b, found = _qps(index, queries, args.k, args.repeats, single=False)
            qps_s, found_s = _qps(index, queries, args.k, args.single_repeats, single=True)
            out[name] = {"factory": index.factory, "build_s": round(build_s, 2), "rss_growth_mb": round(mem, 1),
                         "size_mb": round(size_mb, 1), "qps_batch": round(qps_b, 1), "qps_single": round(qps_s, 1),
                         "ids": found, "ids_single": found_s}
            if name == "auto" and index.kind in ("hnsw", "ivf"):
                knob = "ef_search" if index.kind == "hnsw" else "nprobe"
                for ef in [int(e) for e in (args.ef if index.kind == "hnsw" else args.nprobe).split(",")]:
                    qb, got = _qps(index, queries, args.k, args.repeats, single=False, **{knob: ef})
                    qs, _ = _qps(index, queries, args.k, args.single_repeats, single=True, **{knob: ef})
                    sweeps.append({"n": n, "factory": index.factory, knob: ef,
                                   "recall_at_10": round(recall_against(got, out["flat"]["ids"]), 4),
                                   "qps_batch": round(qb, 1), "speedup_batch": round(qb / out["flat"]["qps_batch"], 2),
                                   "qps_single": round(qs, 1),
                                   "speedup_single": round(qs / out["flat"]["qps_single"], 2)})
                    print(json.dumps(sweeps[-1]), flush=True)
            del index
        exact = out["flat"].pop("ids")
        out["flat"].pop("ids_single")
        approx = out["auto"].pop("ids")
        approx_single = out["auto"].pop("ids_single")
        out["recall_at_10"] = round(recall_against(approx, exact), 4)
        out["recall_at_10_single"] = round(recall_against(approx_single, exact), 4)
        out["speedup_batch"] = round(out["auto"]["qps_batch"] / out["flat"]["qps_batch"], 2)
        out["speedup_single"] = round(out["auto"]["qps_single"] / out["flat"]["qps_single"], 2)
        rows.append(out)
        print(json.dumps(out), flush=True)
    print()
    print(f"QPS: k={args.k}, {len(queries)} queries, {args.threads} FAISS thread(s), {args.clock} clock; "
          "batch = one call with all queries, single = one call per query")
    print()
    print("| n | index | build s | RSS growth MB | file MB | QPS batch | QPS single | recall@10 vs Flat "
          "| speed-up batch | speed-up single |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for name in ("flat", "auto"):
            x = r[name]
            rec = "1 (exact)" if name == "flat" else f"{r['recall_at_10']:.4f}"
            sb = "1" if name == "flat" else f"{r['speedup_batch']:.2f}x"
            ss = "1" if name == "flat" else f"{r['speedup_single']:.2f}x"
            print(f"| {r['n']:,} | {name}: {x['factory']} | {x['build_s']} | {x['rss_growth_mb']} | {x['size_mb']} "
                  f"| {x['qps_batch']:,} | {x['qps_single']:,} | {rec} | {sb} | {ss} |")
    if sweeps:
        print()
        print("| n | index | efSearch / nprobe | recall@10 vs Flat | QPS batch | speed-up batch | QPS single "
              "| speed-up single |")
        print("|---|---|---|---|---|---|---|---|")
        for w in sweeps:
            knob = w.get("ef_search", w.get("nprobe"))
            print(f"| {w['n']:,} | {w['factory']} | {knob} | {w['recall_at_10']:.4f} | {w['qps_batch']:,} "
                  f"| {w['speedup_batch']:.2f}x | {w['qps_single']:,} | {w['speedup_single']:.2f}x |")


def cmd_pipeline_index(args: argparse.Namespace) -> None:
    """A SearchPipeline index over the first --n encoded sentences, reusing the cached embeddings.

    The cached chunks are exactly the shards a build would write (same model, same
    corpus order, 10k per shard), so they are placed in the build's work directory
    with a matching plan and the build *resumes* instead of re-encoding.  This gives
    `pipeline_overhead.py` a realistic large HNSW index.
    """
    import shutil

    from twotower.indexing.integrity import file_sha256
    from twotower.retrieval import DualEncoder, SearchPipeline
    from twotower.retrieval.build import BuildPlan, prepare_work_dir, shard_path
    from twotower.retrieval.manifest import default_model_dir

    corpus = sentences(os.path.join(args.data, "train.txt.gz"))
    random.Random(0).shuffle(corpus)
    corpus = corpus[: args.n]
    path = os.path.join(args.cache, f"corpus-{args.n}.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i, text in enumerate(corpus):
            f.write(json.dumps({"_id": f"s{i}", "title": "", "text": text}) + "\n")
    de = DualEncoder.from_pretrained(default_model_dir(), max_length=128)
    plan = BuildPlan(corpus_sha256=file_sha256(path), on_duplicate="error", shard_size=CHUNK,
                     encoder_fingerprint=de.fingerprint(), num_documents=len(corpus), dim=de.dim)
    out = os.path.join(args.cache, f"pipeline-{args.n}")
    prepare_work_dir(out + ".build", plan)
    for c in range(plan.num_shards):
        src = os.path.join(args.cache, "chunks", f"chunk-{c:04d}.npy")
        arr = np.load(src, mmap_mode="r")
        if arr.shape[0] < plan.shard_rows(c):
            raise SystemExit(f"{src} holds {arr.shape[0]} rows, need {plan.shard_rows(c)}: encode more first")
        np.save(shard_path(out + ".build", c), np.asarray(arr[: plan.shard_rows(c)]))
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    SearchPipeline.build(path, out, de, shard_size=CHUNK).close()
    print(f"{out}: built from cached shards in {time.perf_counter() - t:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("encode", help="encode the Gutenberg sentences and queries (cached, resumable)")
    e.add_argument("--n", type=int, default=200_000)
    e.add_argument("--queries", type=int, default=1000)
    e.add_argument("--max-length", type=int, default=128)
    r = sub.add_parser("run", help="build Flat and auto indexes and compare")
    r.add_argument("--sizes", default="50000,100000,200000")
    r.add_argument("--k", type=int, default=10)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--single-repeats", type=int, default=1, help="repeats of the one-query-at-a-time timing")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="time QPS by wall clock or by this process's CPU seconds (steadier on a shared machine)")
    r.add_argument("--ef", default="32,64,128,256", help="efSearch values to sweep for an HNSW auto index")
    r.add_argument("--factory", default=None,
                   help="compare this factory string instead of the automatic choice (e.g. IVF2048,Flat)")
    r.add_argument("--nprobe", default="8,16,32,64", help="nprobe values to sweep for an IVF index")
    pi = sub.add_parser("pipeline-index", help="a SearchPipeline index over the cached embeddings")
    pi.add_argument("--n", type=int, default=200_000)
    for p in (e, r, pi):
        p.add_argument("--data", default=DATA, help="gutenberg-en-mlm directory")
        p.add_argument("--cache", default=os.path.join(REPO, "runs", "ann"), help="embedding cache directory")
    args = ap.parse_args()
    {"encode": cmd_encode, "run": cmd_run, "pipeline-index": cmd_pipeline_index}[args.cmd](args)


if __name__ == "__main__":
    main()
