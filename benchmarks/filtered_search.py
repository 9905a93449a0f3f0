"""Filtered dense search on 200k real MiniLM vectors: latency and recall@10 against exact filtered search.

The vectors are the all-MiniLM-L6-v2 Gutenberg sentences cached by ``benchmarks/ann_recall.py encode``
(run that first; this script only reads its ``--cache``). Each document gets one synthetic metadata
field, ``bucket``: a random permutation of 0..99 repeated, so ``bucket < 1`` matches exactly 1 % of
the documents, ``bucket < 10`` 10 % and ``bucket < 50`` 50 %, independently of the vectors.

For each index type (``Flat``, ``HNSW32``) an ``IndexStore`` is built once (kept under ``--out``)
and opened read-only; each of ``--queries`` queries is searched alone (one query per call, what a
service sees) with ``IndexStore.search(q, k, filter=...)``. Reported per filter: the path the
search takes (exact scan over the matching vectors, or the FAISS id selector), p50 / p95 latency
of a query once the filter's allowed ids are cached by the reader, the first query's latency
(which resolves the filter in SQLite and maps ids to labels), and recall@10 against brute force
over exactly the matching vectors. ``--forced`` adds rows with the other path forced, to show why
the threshold sits where it does.

    .venv/bin/python benchmarks/filtered_search.py --cache runs/idxbench/ann --n 200000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from ann_recall import load_corpus, recall_against  # noqa: E402  (the cache reader of the encode step)


def cpu_line() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in out.splitlines() if ln.startswith("Flags")), [])
    have = [f for f in ("avx2", "avx512f", "amx_tile", "amx_bf16") if f in flags]
    return f"{model}, {os.cpu_count()} CPUs, flags: {' '.join(have) or 'none of avx2/avx512f/amx'}"


def build(out: str, factory: str, vecs: np.ndarray, buckets: np.ndarray) -> float:
    """The index directory (built once; returns the build seconds, 0 when it already existed)."""
    from twotower.indexing import IndexStore

    if os.path.isdir(out):
        return 0.0
    t = time.perf_counter()
    st = IndexStore.create(out, vecs.shape[1], factory, "cosine")
    step = 50_000
    for s in range(0, len(vecs), step):
        docs = [{"id": f"s{i}", "text": "", "metadata": {"bucket": int(buckets[i])}}
                for i in range(s, min(len(vecs), s + step))]
        st.add(docs, vecs[s:s + step])
    st.commit()
    st.close()
    return time.perf_counter() - t


def exact_truth(vecs: np.ndarray, keep: np.ndarray, queries: np.ndarray, k: int) -> list[list[str]]:
    """Brute force over exactly the matching vectors (cosine: the cached vectors are unit length)."""
    x = vecs[keep]  # (m, D)
    q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    scores = q @ xn.T  # (Q, m)
    top = np.argsort(-scores, axis=1)[:, :k]
    return [[f"s{keep[j]}" for j in row] for row in top]


def timed_queries(store, queries: np.ndarray, k: int, flt) -> tuple[list[float], list[list[str]]]:
    lat, ids = [], []
    for q in queries:
        t = time.perf_counter()
        res = store.search(q[None, :], k, filter=flt)
        lat.append((time.perf_counter() - t) * 1000)
        ids.append(res.ids[0])
    return lat, ids



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=os.path.join(REPO, "runs", "idxbench", "ann"),
                    help="embedding cache of `benchmarks/ann_recall.py encode`")
    ap.add_argument("--n", type=int, default=200_000, help="documents (the first n cached vectors)")
    ap.add_argument("--queries", type=int, default=200, help="queries timed per filter")
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--factories", default="Flat,HNSW32")
    ap.add_argument("--fractions", default="0.01,0.1,0.5", help="fractions of the documents the filters match")
    ap.add_argument("--threads", type=int, default=2, help="FAISS threads")
    ap.add_argument("--forced", action="store_true", help="also time each filter with the other path forced")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "filtered"), help="where the indexes are kept")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()

    import faiss

    import twotower.indexing.vector_index as vi
    from twotower.indexing import IndexStore
    from twotower.indexing.filters import parse_filter

    faiss.omp_set_num_threads(args.threads)
    vecs = load_corpus(args.cache, args.n)
    queries = np.load(os.path.join(args.cache, "queries.npy"))[: args.queries]
    buckets = np.random.default_rng(0).permutation(args.n) % 100  # exactly n/100 documents per bucket
    print(f"CPU: {cpu_line()}; FAISS {faiss.__version__}, {args.threads} threads, fp32", flush=True)
    rows = []
    defaults = (vi.EXACT_SCAN_MAX, vi.EXACT_SCAN_FRACTION, vi.FLAT_EXACT_FRACTION)
    for factory in args.factories.split(","):
        out = os.path.join(args.out, f"{factory}-{args.n}")
        secs = build(out, factory, vecs, buckets)
        print(f"{factory}: " + (f"built in {secs:.1f}s" if secs else f"reusing {out}"), flush=True)
        store = IndexStore.open(out, readonly=True)
        lat, _ = timed_queries(store, queries, args.k, None)
        rows.append({"index": factory, "filter": "(none)", "fraction": 1.0, "path": "unfiltered",
                     "p50_ms": statistics.median(lat), "p95_ms": float(np.percentile(lat, 95)),
                     "first_ms": lat[0], "recall": None})
        for frac in (float(f) for f in args.fractions.split(",")):
            text = f"bucket < {round(frac * 100)}"
            keep = np.flatnonzero(buckets < round(frac * 100))
            truth = exact_truth(vecs, keep, queries, args.k)
            fraction = vi.FLAT_EXACT_FRACTION if store.vectors.kind == "flat" else vi.EXACT_SCAN_FRACTION
            default_exact = len(keep) <= max(vi.EXACT_SCAN_MAX, fraction * args.n)
            paths = [default_exact] + ([not default_exact] if args.forced else [])
            for exact in paths:
                if exact != default_exact:  # force the other path for this row
                    vi.EXACT_SCAN_MAX, vi.EXACT_SCAN_FRACTION, vi.FLAT_EXACT_FRACTION = (
                        (10**12, 1.0, 1.0) if exact else (0, 0.0, 0.0))
                try:
                    # a filter not seen before (the reader caches allowed ids per filter): the first query resolves it
                    flt = parse_filter(f"{text} and bucket >= {-1 if exact != default_exact else 0}")
                    lat, found = timed_queries(store, queries, args.k, flt)
                finally:
                    vi.EXACT_SCAN_MAX, vi.EXACT_SCAN_FRACTION, vi.FLAT_EXACT_FRACTION = defaults
                row = {"index": factory, "filter": text, "fraction": frac, "matching": int(len(keep)),
                       "path": ("exact scan" if exact else "id selector") + ("" if exact == default_exact else
                                                                            " (forced)"),
                       "p50_ms": statistics.median(lat[1:]), "p95_ms": float(np.percentile(lat[1:], 95)),
                       "first_ms": lat[0], "recall": recall_against(found, truth)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        store.close()
    print("\n| index | filter (matching) | path | p50 ms | p95 ms | first query ms | recall@10 vs exact |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        match = f" ({r['fraction']:.0%})" if r["filter"] != "(none)" else ""
        rec = "—" if r["recall"] is None else f"{r['recall']:.4f}"
        print(f"| {r['index']} | `{r['filter']}`{match} | {r['path']} | {r['p50_ms']:.2f} | {r['p95_ms']:.2f} | "
              f"{r['first_ms']:.1f} | {rec} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_line(), "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
