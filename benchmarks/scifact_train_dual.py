"""Fine-tune all-MiniLM-L6-v2 as a dual encoder on SciFact train; report dense / BM25 / hybrid on dev and test.

Run from the repository root (results land in --out, default runs/scifact_dual):

    nohup .venv/bin/python benchmarks/scifact_train_dual.py > runs/scifact_dual.log 2>&1 &

Steps: (1) `twotower.retrieval.training.train_dual.train_dual` on qrels/train.tsv with a dev split
carved from train by query (seed 0), BM25 hard negatives from ranks 10-100, the
best checkpoint chosen on dev nDCG@10 over a pool (dev positives + 500
documents); (2) the chosen model encodes the whole corpus once; dense, BM25,
hybrid (RRF, k=60) and hybrid_weighted (z-score fusion, dense weight chosen on dev) top-100 runs are written for dev and test as TREC files under
``out/runs/`` (the reranker benchmark reads them); (3) ``results.json`` holds every
metric.  Test is never used for a choice.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from scifact_train_common import (
    DEFAULT_DATA,
    REPO,
    bm25_runs,
    choose_fusion_weight,
    dense_runs,
    evaluate,
    load_splits,
    minilm_path,
    rrf_run,
    weighted_fusion_run,
    write_json,
    write_run,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--model", default=None, help="starting checkpoint (default: all-MiniLM-L6-v2)")
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "scifact_dual"))
    ap.add_argument("--time-budget", type=float, default=40 * 60, help="training seconds (evaluations included)")
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--hard-negatives", type=int, default=1)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--temperature", type=float, default=0.05)
    ap.add_argument("--symmetric", action="store_true")
    ap.add_argument("--doc-max-length", type=int, default=256, help="document tokens at evaluation and in the saved model")
    ap.add_argument("--train-doc-max-length", type=int, default=128, help="document tokens while training")
    ap.add_argument("--dev-pool", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--eval-interval", type=float, default=10 * 60,
                    help="also evaluate dev after this many seconds since the last evaluation; 0: never by the clock, "
                         "so the kept step does not depend on the CPU's speed (use --eval-every)")
    ap.add_argument("--freeze-documents", action="store_true",
                    help="train the query tower only against the frozen corpus vectors (full-corpus softmax)")
    ap.add_argument("--skip-train", action="store_true", help="evaluate an existing out/best")
    ap.add_argument("--baseline", action="store_true", help="also evaluate the starting model on dev and test")
    args = ap.parse_args()

    from twotower.retrieval.training.train_dual import DualTrainConfig, train_dual

    model = args.model or minilm_path()
    results: dict = {"command": "benchmarks/scifact_train_dual.py", "args": vars(args)}
    best = os.path.join(args.out, "best")
    if not args.skip_train:
        cfg = DualTrainConfig(
            model=model, data=args.data, out=args.out, mine="bm25", mine_ranks=(10, 100),
            batch_size=args.batch_size, hard_negatives=args.hard_negatives, lr=args.lr,
            temperature=args.temperature, symmetric=args.symmetric, epochs=args.epochs,
            doc_max_length=args.doc_max_length, train_doc_max_length=args.train_doc_max_length,
            freeze_documents=args.freeze_documents, dev_pool=args.dev_pool, eval_every=args.eval_every, eval_interval_s=args.eval_interval or None, time_budget=args.time_budget, progress=True,
        )
        t = time.time()
        res = train_dual(cfg)
        results["train"] = {"seconds": round(time.time() - t, 1), "best_step": res.best_step, "steps": res.steps,
                            "best_dev_pool_ndcg@10": res.best_score, "initial_dev_pool_ndcg@10": res.initial_score,
                            "skipped": res.skipped}
        print("training:", results["train"], flush=True)

    corpus, dev_q, dev_qrels, test_q, test_qrels, train_q, train_qrels = load_splits(args.data, with_train=True)
    # train runs are written for the reranker benchmark (negatives mined from this first stage).
    sets = {"dev": dev_q, "test": test_q, "train": train_q}
    qrels = {"dev": dev_qrels, "test": test_qrels, "train": train_qrels}
    runs = {"bm25": bm25_runs(corpus, sets)}
    models = {"dense": best}
    if args.baseline:
        models["dense_base"] = model
    with open(os.path.join(best, "training_args.json"), encoding="utf-8") as f:
        frozen = args.out if json.load(f).get("freeze_documents") else None  # reuse the saved corpus vectors
    for name, directory in models.items():
        runs[name] = dense_runs(directory, corpus, sets, vectors_from=frozen if name == "dense" else None)
    runs["hybrid"] = {s: rrf_run(runs["dense"][s], runs["bm25"][s]) for s in sets}
    # Score fusion with the dense weight chosen on dev (never test): the hybrid for a weak dense model,
    # where equal-weight RRF can fall below BM25 alone.
    w, curve = choose_fusion_weight(runs["dense"]["dev"], runs["bm25"]["dev"], qrels["dev"])
    results["fusion"] = {"dense_weight": w, "dev_ndcg@10_by_weight": curve, "normalization": "zscore"}
    runs["hybrid_weighted"] = {s: weighted_fusion_run(runs["dense"][s], runs["bm25"][s], w) for s in sets}
    table = {}
    for name, by_split in runs.items():
        for split, run in by_split.items():
            write_run(run, os.path.join(args.out, "runs", f"{split}_{name}.trec"), tag=name)
            table[f"{split}/{name}"] = evaluate(run, qrels[split])
    results["metrics"] = table
    write_json(os.path.join(args.out, "results.json"), results)
    print("| run | dev nDCG@10 | dev R@100 | test nDCG@10 | test R@100 |")
    print("|---|---|---|---|---|")
    for name in runs:
        d, t = table[f"dev/{name}"], table[f"test/{name}"]
        print(f"| {name} | {d['ndcg@10']:.4f} | {d['recall@100']:.4f} | {t['ndcg@10']:.4f} | {t['recall@100']:.4f} |")
    print(f"hybrid_weighted: dense weight {w} chosen on dev")


if __name__ == "__main__":
    main()
