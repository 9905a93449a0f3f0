"""BM25 (indexing.BM25) on BEIR SciFact: nDCG@10 and Recall@100 on the test split.

    .venv/bin/python benchmarks/bm25_scifact.py --data ../shared/data/beir-scifact [--tune]

Default parameters are the Anserini BEIR defaults (Lucene BM25, k1=0.9, b=0.4). With
``--tune`` a small k1×b grid is scored on a *dev* split carved from the SciFact
*train* qrels (a seeded half of the train queries); the best dev setting is then
reported on test next to the defaults. Test qrels are never used for choosing.

Metrics come from our ``twotower.eval.metrics.evaluate`` (trec_eval semantics); when
``pytrec_eval`` is installed the same run is scored by it as well and both are printed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from twotower.eval.io import load_beir
from twotower.eval.metrics import evaluate
from twotower.indexing import BM25

METRICS = ("ndcg@10", "recall@100")
GRID_K1 = (0.6, 0.9, 1.2, 1.5)
GRID_B = (0.3, 0.4, 0.6, 0.75)


def run_bm25(bm: BM25, queries: dict[str, str], k: int = 100) -> dict[str, dict[str, float]]:
    qids = list(queries)
    res = bm.search([queries[q] for q in qids], k=k)
    return {q: {d: float(s) for d, s in zip(ids, sc) if d} for q, ids, sc in zip(qids, res.ids, res.scores)}


def score(run, qrels) -> dict[str, float]:
    means = evaluate(run, qrels, list(METRICS)).means
    try:
        import pytrec_eval
    except ImportError:
        return means
    per_query = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut.10", "recall.100"}).evaluate(run)
    n = len(qrels)  # every judged query is answered, so this is trec_eval -c averaging too
    means["pytrec_eval ndcg@10"] = sum(v["ndcg_cut_10"] for v in per_query.values()) / n
    means["pytrec_eval recall@100"] = sum(v["recall_100"] for v in per_query.values()) / n
    return means


def build(corpus, **params) -> tuple[BM25, float]:
    start = time.perf_counter()
    bm = BM25(**params)
    bm.add(list(corpus), [f"{d.title} {d.text}" if d.title else d.text for d in corpus.values()])
    bm.search(["warm up"], 1)  # the sparse index is built lazily at the first search
    return bm, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "beir-scifact")
    ap.add_argument("--tune", action="store_true", help="grid-search k1, b on a dev split of train")
    ap.add_argument("--dev-seed", type=int, default=0)
    args = ap.parse_args(argv)

    test = load_beir(args.data, "test")
    corpus = test.corpus
    bm, seconds = build(corpus)
    test_queries = test.split_queries()
    start = time.perf_counter()
    run = run_bm25(bm, test_queries)
    qps = len(test_queries) / (time.perf_counter() - start)
    print(
        f"corpus {len(corpus)} docs indexed in {seconds:.2f}s; {len(test_queries)} test queries at {qps:.0f} q/s"
    )
    print(
        "default k1=0.9 b=0.4 (lucene) test: "
        + "  ".join(f"{k}={v:.4f}" for k, v in score(run, test.qrels).items())
    )

    if args.tune:
        train = load_beir(args.data, "train", corpus=False)
        qids = sorted(train.qrels)
        random.Random(args.dev_seed).shuffle(qids)
        dev_qrels = {q: train.qrels[q] for q in qids[: len(qids) // 2]}
        dev_queries = {q: train.queries[q] for q in dev_qrels}
        results = []
        for k1 in GRID_K1:
            for b in GRID_B:
                tuned, _ = build(corpus, k1=k1, b=b)
                dev = evaluate(run_bm25(tuned, dev_queries), dev_qrels, ["ndcg@10"]).means["ndcg@10"]
                results.append((dev, k1, b))
                print(f"  dev ({len(dev_qrels)} train queries) k1={k1} b={b}: ndcg@10={dev:.4f}")
        dev, k1, b = max(results)
        tuned, _ = build(corpus, k1=k1, b=b)
        scores = score(run_bm25(tuned, test_queries), test.qrels)
        print(
            f"tuned on dev: k1={k1} b={b} (dev ndcg@10={dev:.4f}) test: "
            + "  ".join(f"{k}={v:.4f}" for k, v in scores.items())
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
