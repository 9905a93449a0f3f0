"""First-stage runs on SciFact without training: BM25, all-MiniLM-L6-v2 (dense) and their RRF hybrid.

Writes ``OUT/runs/{train,dev,test}_{bm25,dense,hybrid}.trec`` and ``OUT/results.json`` in the layout
`benchmarks/scifact_train_reranker.py --dual-out OUT` reads, so a reranker can be trained and
measured over the untrained default first stage (dense) or the best one (picked on dev):

    .venv/bin/python benchmarks/scifact_first_stage.py --out runs/scifact_first_stage

About a minute on 2 cores (encoding the 5,183 abstracts).
"""

from __future__ import annotations

import argparse
import os

from scifact_train_common import (
    DEFAULT_DATA,
    bm25_runs,
    dense_runs,
    evaluate,
    load_splits,
    minilm_path,
    rrf_run,
    write_json,
    write_run,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    corpus, dev_q, dev_qrels, test_q, test_qrels, train_q, train_qrels = load_splits(args.data, with_train=True)
    sets = {"dev": dev_q, "test": test_q, "train": train_q}
    qrels = {"dev": dev_qrels, "test": test_qrels, "train": train_qrels}
    runs = {"bm25": bm25_runs(corpus, sets), "dense": dense_runs(minilm_path(), corpus, sets, progress=False)}
    runs["hybrid"] = {s: rrf_run(runs["dense"][s], runs["bm25"][s]) for s in sets}
    table = {}
    for name, by_split in runs.items():
        for split, run in by_split.items():
            write_run(run, os.path.join(args.out, "runs", f"{split}_{name}.trec"), tag=name)
            table[f"{split}/{name}"] = evaluate(run, qrels[split])
    write_json(os.path.join(args.out, "results.json"),
               {"command": "benchmarks/scifact_first_stage.py", "args": vars(args), "metrics": table})
    print("| run | dev nDCG@10 | dev R@100 | test nDCG@10 | test R@100 |")
    print("|---|---|---|---|---|")
    for name in runs:
        d, t = table[f"dev/{name}"], table[f"test/{name}"]
        print(f"| {name} | {d['ndcg@10']:.4f} | {d['recall@100']:.4f} | {t['ndcg@10']:.4f} | {t['recall@100']:.4f} |")


if __name__ == "__main__":
    main()
