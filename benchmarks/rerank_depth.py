"""How deep to rerank: nDCG@10 and ms/query against `rerank_k` (the first-stage candidates the cross-encoder scores).

Over BEIR SciFact (5,183 abstracts, test claims), dense recall of 100 with all-MiniLM-L6-v2, a
cross-encoder directory (`--reranker`) scoring the first stage's top `rerank_k` for rerank_k in
`--depths`:

* latency: `SearchPipeline.search` of one query at a time (as a person searching would), median
  ms/query over `--latency-queries` claims, per depth, and without reranking;
* quality: every test claim's top 100 is scored once (`search(..., rerank_k=100, k=100)`, raw
  cross-encoder scores), and each shallower depth is rebuilt from those scores with the pipeline's
  merge rule (top rerank_k reordered by the final score, the rest in first-stage order below); the
  rebuilt rankings are checked against the pipeline's own on the latency claims.  nDCG@10 at the
  reranker's stored interpolation weight and at weight 1 (pure reranking).

The index is built once into `--index` (about a minute on 2 cores) and reused.

    .venv/bin/python benchmarks/rerank_depth.py --reranker runs/rr-diag/ours/best --out runs/rerank_depth.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from twotower.common.device import cpu_description  # noqa: E402
from twotower.eval.io.beir import read_beir_qrels, read_beir_queries  # noqa: E402
from twotower.eval.metrics import evaluate  # noqa: E402
from twotower.retrieval import SearchPipeline  # noqa: E402
from twotower.retrieval.interpolation import interpolate  # noqa: E402

DEFAULT_DATA = os.path.join(REPO, "..", "shared", "data", "beir-scifact")


def merged(first: list, raw: dict[str, float], depth: int, alpha: float, k: int = 10) -> dict[str, float]:
    """The pipeline's merge rule on one query: first-stage hits `first`, raw cross-encoder scores `raw`."""
    head = first[:depth]
    final = interpolate(np.array([raw[h.id] for h in head]), np.array([h.first_stage_score for h in head]), alpha)
    order = sorted(range(len(head)), key=lambda j: (-final[j], j))[:k]
    out = {head[j].id: float(final[j]) for j in order}
    floor = min(out.values()) if out else 0.0
    for i, h in enumerate(first[depth:depth + max(0, k - len(order))], 1):
        out[h.id] = floor - i
    return out


def parse_search_args(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, bool | str]:
    """Add --bf16 / --threads / --out (the settings of a search benchmark), parse, set the threads; (args, bf16)."""
    ap.add_argument("--bf16", choices=["auto", "0", "1"], default="0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args, {"auto": "auto", "0": False, "1": True}[args.bf16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reranker", required=True)
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--index", default="runs/scifact-index")
    ap.add_argument("--depths", default="10,20,50,100")
    ap.add_argument("--latency-queries", type=int, default=20)
    ap.add_argument("--quality-queries", type=int, default=None, help="first N test claims (default all)")
    args, bf16 = parse_search_args(ap)
    depths = [int(x) for x in args.depths.split(",")]
    recall_k = max(depths)
    if not os.path.isfile(os.path.join(args.index, "manifest.json")):
        SearchPipeline.build(os.path.join(args.data, "corpus.jsonl"), args.index, progress=False).close()
    queries = read_beir_queries(os.path.join(args.data, "queries.jsonl"))
    qrels = read_beir_qrels(os.path.join(args.data, "qrels", "test.tsv"))
    qids = sorted(qrels)[:args.quality_queries]
    qrels = {q: qrels[q] for q in qids}
    texts = [queries[q] for q in qids]
    out = {"cpu": cpu_description(), "torch": torch.__version__, "threads": args.threads, "bf16": args.bf16,
           "reranker": os.path.abspath(args.reranker), "recall_k": recall_k, "quality_queries": len(qids)}
    with SearchPipeline.load(args.index, reranker=args.reranker, bf16=bf16) as pipe:
        stored = pipe.rerank_alpha()
        out["stored_alpha"] = stored
        lat_q = texts[:args.latency_queries]
        pipe.search(lat_q[0], k=10, recall_k=recall_k)  # warm-up
        latency = {}
        for depth in [0, *depths]:
            times = []
            for q in lat_q:
                t0 = time.perf_counter()
                if depth == 0:
                    pipe.search(q, k=10, recall_k=recall_k, rerank=False, fetch_documents=False)
                else:
                    pipe.search(q, k=10, recall_k=recall_k, rerank_k=depth, rerank_alpha=1.0, fetch_documents=False)
                times.append(time.perf_counter() - t0)
            latency[depth] = round(1000 * statistics.median(times), 1)
            print(f"rerank_k {depth or 'none'}: {latency[depth]} ms/query", flush=True)
        first = pipe.search(texts, k=recall_k, recall_k=recall_k, rerank=False, fetch_documents=False)
        full = pipe.search(texts, k=recall_k, recall_k=recall_k, rerank_k=recall_k, rerank_alpha=1.0,
                           fetch_documents=False)
        raw = [{h.id: h.rerank_score for h in row} for row in full]
        for depth in depths:  # the rebuilt rankings must be the pipeline's own
            for i, q in enumerate(lat_q[:5]):
                got = [h.id for h in pipe.search(q, k=10, recall_k=recall_k, rerank_k=depth, rerank_alpha=stored,
                                                 fetch_documents=False)]
                want = list(merged(first[i], raw[i], depth, stored))
                assert got == want, (depth, q, got, want)
    first_run = {q: {h.id: h.first_stage_score for h in row[:10]} for q, row in zip(qids, first)}
    rows = [{"rerank_k": 0, "ms_per_query": latency[0],
             "ndcg@10": evaluate(first_run, qrels, ["ndcg@10"]).means["ndcg@10"]}]
    for depth in depths:
        row = {"rerank_k": depth, "ms_per_query": latency[depth]}
        for name, alpha in (("stored_alpha", stored), ("alpha_1", 1.0)):
            run = {q: merged(f, r, depth, alpha) for q, f, r in zip(qids, first, raw)}
            row[f"ndcg@10_{name}"] = evaluate(run, qrels, ["ndcg@10"]).means["ndcg@10"]
        rows.append(row)
    out["rows"] = rows
    print(f"| rerank_k | ms/query | nDCG@10 at the stored weight {stored} | nDCG@10 reranker alone |")
    print("|---|---|---|---|")
    print(f"| none (first stage) | {rows[0]['ms_per_query']} | {rows[0]['ndcg@10']:.4f} | |")
    for r in rows[1:]:
        print(f"| {r['rerank_k']} | {r['ms_per_query']} | {r['ndcg@10_stored_alpha']:.4f} | {r['ndcg@10_alpha_1']:.4f} |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
