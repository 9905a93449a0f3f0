"""Rebuild the reranker twotower ships (retrieval/data/default-reranker) from the bundled SciFact data.

Run from the repository root (minutes on 2 CPU cores; fp32 so that the result does not depend on
the CPU having native bf16):
    TWOTOWER_BF16=0 .venv/bin/python scripts/make_default_reranker.py

It trains `twotower train demo-reranker --trainable-layers 6 --teacher embedded --mine dense
--first-stage dense --evals 3` (every layer, the embeddings frozen; the bundled 809 SciFact train claims,
negatives mined by the embedded all-MiniLM-L6-v2 over the bundled 2,000-abstract sample, its scores
distilled next to the labels, seed 0), then packs the result as an int8 delta over the embedded all-MiniLM-L6-v2
(`twotower.retrieval.default_reranker.pack`), recording the command, the data and the licences.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def recipe_args(argv: list[str]) -> list[str]:
    """The arguments that change what is trained (not where the run directory is or whether a bar shows)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--work", "--out"):
            skip = True
        elif not (a.startswith(("--work=", "--out=")) or a == "--no-progress"):
            out.append(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=os.path.join(HERE, "..", "runs", "default-reranker"),
                    help="training run directory (kept; default runs/default-reranker)")
    ap.add_argument("--trainable-layers", type=int, default=6,
                    help="top layers trained (default all 6: the embeddings stay as the base's)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--max-length", type=int, default=192)
    ap.add_argument("--evals", type=int, default=3,
                    help="dev evaluations, evenly spaced, the last at the end (3: as the shipped one was chosen; "
                         "the demo recipe's 2 save one dev pass)")
    ap.add_argument("--distill-weight", type=float, default=1.0,
                    help="weight of the embedded dense model's scores next to the labels (0: labels only)")
    ap.add_argument("--mine", choices=["bm25", "dense"], default="dense",
                    help="negatives from BM25 or the embedded dense model (the first stage --rerank reorders)")
    ap.add_argument("--passage-window", type=int, default=96,
                    help="read abstracts as windows of N tokens, each scored with the title, the best one counting "
                         "(0: the head of each abstract up to --max-length, the recipe before windows)")
    ap.add_argument("--passage-stride", type=int, default=64, help="tokens between window starts")
    ap.add_argument("--max-windows", type=int, default=3,
                    help="windows scored per abstract and claim, those BM25 ranks best among its windows (0: all)")
    ap.add_argument("--out", default=None, help="default: the package's retrieval/data/default-reranker")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args()

    from twotower.retrieval import default_reranker
    from twotower.retrieval.interpolation import read_first_stage_alphas
    from twotower.retrieval.training.demo_reranker import train_demo_reranker

    teacher = "embedded" if args.distill_weight > 0 or args.mine == "dense" else None
    best = train_demo_reranker(args.work, steps=args.steps, trainable_layers=args.trainable_layers,
                               max_length=args.max_length, teacher=teacher, distill_weight=args.distill_weight,
                               mine=args.mine, first_stage="dense" if teacher else None, evals=args.evals,
                               passage_window=args.passage_window or None,
                               passage_stride=args.passage_stride if args.passage_window else None,
                               max_windows=args.max_windows or None,
                               progress=not args.no_progress)
    with open(os.path.join(args.work, "demo_reranker.json"), encoding="utf-8") as f:
        run = json.load(f)
    about = {
        "command": " ".join(["TWOTOWER_BF16=0 .venv/bin/python scripts/make_default_reranker.py",
                             *(shlex.quote(a) for a in recipe_args(sys.argv[1:]))]).strip(),
        "recipe": {"trainable_layers": args.trainable_layers, "steps": args.steps, "dev_evaluations": args.evals,
                   "max_length": args.max_length,
                   "windows": ({"window": args.passage_window, "stride": args.passage_stride,
                                "keep": args.max_windows or None} if args.passage_window else None),
                   "loss": f"listwise, 1 positive + 3 negatives mined by {args.mine}, 4 groups a step"
                           + (f"; + {args.distill_weight} x KL to the embedded all-MiniLM-L6-v2's scores (x20)"
                              if args.distill_weight > 0 else ""),
                   "lr": "1e-4, head 10x, 5% warmup, linear decay", "seed": 0},
        "data": "SciFact train claims (809, the bundled retrieval/data/scifact-train-claims.jsonl.gz) over the "
                "bundled 2,000-abstract SciFact sample (retrieval/data/scifact-sample.jsonl.gz); 10% of the "
                "claims held out as dev to choose the checkpoint and the interpolation weights (over the "
                "dense model's top 20 and over the hybrid's)",
        "licence": "weights: Apache-2.0 (all-MiniLM-L6-v2, sentence-transformers); training data: SciFact claims "
                   "CC BY 4.0, abstracts ODC-By 1.0 (Wadden et al. 2020; retrieval/data/README.md)",
        "dev": {"reranker_ndcg@10": run["best_dev_ndcg@10"],
                ("dense_ndcg@10" if teacher else "bm25_ndcg@10"): run["first_stage_dev_ndcg@10"],
                "interpolation_alpha": run["interpolation_alpha"],
                "interpolation_by_first_stage": read_first_stage_alphas(best), "best_step": run["best_step"]},
    }
    out = args.out or default_reranker.DIRECTORY
    manifest = default_reranker.pack(best, default_reranker.base_model_dir(), out, about=about)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    print(json.dumps({"out": out, "bytes": size, "changed_tensors": manifest["changed_tensors"],
                      "max_logit_diff_to_trained": roundtrip_error(best, out), **about["dev"]}))


def roundtrip_error(trained_dir: str, packed_dir: str, pairs: int = 200) -> float:
    """Largest |logit| difference between the trained checkpoint and the packed delta, in fp32, on the
    bundled example claims paired with the first abstracts of the bundled sample."""
    import gzip

    import numpy as np

    from twotower.retrieval import default_reranker
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.training.demo_reranker import BUNDLED_CORPUS, DATA

    with open(os.path.join(DATA, "example_queries.jsonl"), encoding="utf-8") as f:
        claims = [json.loads(line)["text"] for line in f]
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(pairs // len(claims)), f)]
    batch = [(c, d) for c in claims for d in docs]
    want = CrossEncoder.from_pretrained(trained_dir, device="cpu", bf16=False).predict(batch)
    got = default_reranker.load(device="cpu", bf16=False, directory=packed_dir).predict(batch)
    return float(np.abs(got - want).max())


if __name__ == "__main__":
    main()
