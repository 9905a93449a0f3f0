"""Search overhead of SearchPipeline (dense only) over raw FAISS on the same index, queries pre-encoded.

Both sides search the same vector file: "raw" is ``faiss.read_index`` on it
(stock FAISS reads our file; the id trailer is ignored), opened memory-mapped as
the pipeline opens it, and one batched ``index.search(queries, k)`` (a plain
heap-loaded copy is timed too, ``raw_faiss_heap_ms``); "pipeline" is ``SearchPipeline.search_vectors``,
which adds the string-id mapping and `Hit` construction, measured twice: with
``fetch_documents=False`` (ids and scores, what evaluation runs need: the
like-for-like comparison with FAISS, which returns only labels and scores) and
with the default SQLite fetch of title and text (I/O raw FAISS does not do).  Query encoding is excluded on both
sides (pre-encoded, normalised).  Best of ``--repeats`` timings, same thread count.

    .venv/bin/python benchmarks/pipeline_overhead.py --index runs/scifact-minilm --queries 1000

The queries are the first 1,000 SciFact queries (train + test) encoded with the
index's own model; ``--query-vectors FILE.npy`` takes pre-encoded ones instead (e.g.
the Gutenberg queries of ``ann_recall.py`` for its 200k index), ``--random-queries``
random unit vectors.

    .venv/bin/python benchmarks/ann_recall.py pipeline-index --n 200000
    .venv/bin/python benchmarks/pipeline_overhead.py --index runs/ann/pipeline-200000 \
        --query-vectors runs/ann/queries.npy --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


CLOCK = time.perf_counter


MEANS: dict[str, float] = {}


def best_of(fn, repeats: int, name: str | None = None) -> float:
    """Best repetition; with `name`, the mean is kept in MEANS too.  The mean matters for the pipeline: its
    result objects are tracked by the cyclic garbage collector, whose passes land in some repetitions only,
    so the best repetition hides them (raw FAISS returns untracked arrays)."""
    times = []
    for _ in range(repeats):
        t = CLOCK()
        fn()
        times.append(CLOCK() - t)
    if name:
        MEANS[name] = sum(times) / len(times)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", default=os.path.join(REPO, "runs", "scifact-minilm"))
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "beir-scifact"))
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--random-queries", action="store_true")
    ap.add_argument("--query-vectors", help="pre-encoded queries (.npy, (Q, D)) instead of SciFact queries")
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall time, or this process's CPU time (steadier on a machine shared with other jobs)")
    ap.add_argument("--no-gc-pause", action="store_true",
                    help="build hits with the cyclic collector running (what retrieval.hit.gc_paused saves)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.perf_counter if args.clock == "wall" else time.process_time

    import faiss

    from twotower.retrieval import SearchPipeline

    faiss.omp_set_num_threads(args.threads)
    if args.no_gc_pause:
        import contextlib

        import twotower.retrieval.pipeline

        twotower.retrieval.pipeline.gc_paused = contextlib.nullcontext
    with SearchPipeline.load(args.index, use_default_reranker=False) as pipe:
        if args.query_vectors:
            q = np.load(args.query_vectors)[: args.queries]
        elif args.random_queries:
            q = np.random.default_rng(0).standard_normal((args.queries, pipe.encoder.dim)).astype(np.float32)
        else:
            with open(os.path.join(args.data, "queries.jsonl"), encoding="utf-8") as f:
                texts = [json.loads(line)["text"] for line in f][: args.queries]
            q = pipe.encoder.encode_queries(texts, batch_size=128)  # (Q, D)
        q = np.ascontiguousarray(q, dtype=np.float32)
        faiss.normalize_L2(q)
        # Raw FAISS opens the file the way the pipeline does (memory-mapped storage), so both search the
        # same bytes the same way; the default efSearch stored in the file (128) applies to both.
        (segment,) = pipe.store.vectors.segments  # a freshly built index is one vector segment
        path = os.path.join(pipe.directory, segment.name)
        raw = faiss.read_index(path, faiss.IO_FLAG_MMAP_IFC if segment.index.is_mmapped else 0)
        raw_s = best_of(lambda: raw.search(q, args.k), args.repeats, "raw")
        raw_heap = faiss.read_index(path)
        raw_heap_s = best_of(lambda: raw_heap.search(q, args.k), args.repeats)
        pipe_s = best_of(lambda: pipe.search_vectors(q, k=args.k, fetch_documents=False), args.repeats, "pipe")
        docs_s = best_of(lambda: pipe.search_vectors(q, k=args.k), args.repeats)
        # Where the pipeline's time goes: the vector search alone (string ids) and the document fetch.
        vec_s = best_of(lambda: pipe.store.search(q, args.k), args.repeats)
        res = pipe.store.search(q, args.k)
        ids = list(dict.fromkeys(i for row in res.ids for i in row if i))
        fetch_s = best_of(lambda: pipe.store.get(ids), args.repeats)
        info = pipe.info()
    out = {
        "index": info["factory"], "documents": info["documents"], "queries": len(q), "k": args.k,
        "threads": args.threads, "clock": args.clock, "raw_faiss_ms": round(raw_s * 1e3, 2),
        "raw_faiss_heap_ms": round(raw_heap_s * 1e3, 2),
        "pipeline_ids_scores_ms": round(pipe_s * 1e3, 2), "overhead_pct": round(100 * (pipe_s / raw_s - 1), 1),
        "raw_faiss_mean_ms": round(MEANS["raw"] * 1e3, 2), "pipeline_ids_scores_mean_ms": round(MEANS["pipe"] * 1e3, 2),
        "overhead_mean_pct": round(100 * (MEANS["pipe"] / MEANS["raw"] - 1), 1),
        "pipeline_with_documents_ms": round(docs_s * 1e3, 2),
        "overhead_with_documents_pct": round(100 * (docs_s / raw_s - 1), 1),
        "vector_index_ms": round(vec_s * 1e3, 2),
        "docstore_fetch_ms": round(fetch_s * 1e3, 2), "unique_docs_fetched": len(ids),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
