"""SciFact (BEIR) test: BM25, dense all-MiniLM-L6-v2 and hybrid (RRF) retrieval through SearchPipeline.

The published reference for all-MiniLM-L6-v2 on SciFact is nDCG@10 = 0.645 (MTEB
leaderboard / sentence-transformers model card; documents are "title text",
max 256 tokens); our goal is to be within 0.01 of it with the same weights loaded
into our encoder.  BEIR's published BM25 is 0.665 (Anserini); ours uses bm25s
(Lucene variant, k1=0.9, b=0.4, English stemming and stop words).

Metrics come from ``twotower.eval.metrics`` (trec_eval semantics) and are cross-checked
against pytrec_eval on the same runs.

    .venv/bin/python benchmarks/scifact_dense.py [--data ../shared/data/beir-scifact] [--index runs/scifact-minilm]

The index is built once (``twotower index build --bm25`` equivalent) and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PUBLISHED = {"dense": 0.645, "bm25": 0.665}


def _run_from(results, qids) -> dict[str, dict[str, float]]:
    return {q: {h.id: float(h.score) for h in hits} for q, hits in zip(qids, results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "beir-scifact"))
    ap.add_argument("--index", default=os.path.join(REPO, "runs", "scifact-minilm"))
    ap.add_argument("--split", default="test")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()

    import pytrec_eval

    from twotower.eval.io import load_beir
    from twotower.eval.metrics.retrieval import evaluate
    from twotower.retrieval import SearchPipeline

    ds = load_beir(args.data, args.split, corpus=False)
    queries = ds.split_queries()
    qids, texts = list(queries), list(queries.values())
    if not os.path.isdir(args.index):
        t = time.perf_counter()
        SearchPipeline.build(os.path.join(args.data, "corpus.jsonl"), args.index, bm25=True,
                             batch_size=args.batch_size).close()
        print(f"built {args.index} in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    runs = {}
    with SearchPipeline.load(args.index, use_default_reranker=False) as pipe:
        t = time.perf_counter()
        runs["dense"] = _run_from(pipe.search(texts, k=100, recall_k=100, rerank=False), qids)
        dense_s = time.perf_counter() - t
        lex = pipe.store.search_bm25(texts, 100)
        runs["bm25"] = {q: {d: float(s) for d, s in zip(ids, sc) if d} for q, ids, sc in zip(qids, lex.ids,
                                                                                            lex.scores)}
        runs["hybrid (RRF k=60)"] = _run_from(pipe.search(texts, k=100, recall_k=100, rerank=False, hybrid=True),
                                              qids)
        info = pipe.info()
    qrels = {q: dict(d) for q, d in ds.qrels.items()}
    rows = {}
    for name, run in runs.items():
        ours = evaluate(run, qrels, "ndcg@10,recall@100").means
        ref = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run)
        n = len(qrels)  # every judged query is in the run, so the two averages agree
        ref_means = {"ndcg@10": sum(v["ndcg_cut_10"] for v in ref.values()) / n,
                     "recall@100": sum(v["recall_100"] for v in ref.values()) / n}
        for key in ours:
            assert abs(ours[key] - ref_means[key]) < 1e-9, (name, key, ours[key], ref_means[key])
        rows[name] = ours
    print(json.dumps({"index": {k: info[k] for k in ("documents", "factory", "metric", "dim")},
                      "queries": len(qids), "dense_search_seconds": round(dense_s, 2), "metrics": rows}))
    print()
    print(f"| system (SciFact {args.split}, {len(qids)} queries) | nDCG@10 | Recall@100 | published nDCG@10 |")
    print("|---|---|---|---|")
    for name, m in rows.items():
        pub = PUBLISHED.get(name.split()[0], None)
        print(f"| {name} | {m['ndcg@10']:.4f} | {m['recall@100']:.4f} | {pub if pub is not None else '—'} |")


if __name__ == "__main__":
    main()
