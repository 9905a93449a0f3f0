"""How to choose the reranker's interpolation weight on dev so that it holds on claims with new evidence.

The trainers choose ``alpha`` in ``alpha * z(rerank) + (1 - alpha) * z(first stage)`` as the argmax of
dev nDCG@10 (`twotower.retrieval.training.alpha`).  Dev is carved from SciFact *train* by claim, so most
dev claims cite evidence that training claims cite, and the reranker has learned those abstracts; that
favours high weights, which did not hold on the test claims whose evidence was never seen
(docs/results.md).  This script judges selection rules on dev alone, no test claim is read:

* for each training run (`--runs`, each a `twotower train demo-reranker --out` directory; its dev seed, else its
  seed, says which 81 claims were dev), the dev claims are searched in `--index` (dense, and the hybrid of dense +
  BM25 by RRF), the run's best checkpoint scores each claim's top `--rerank-k`, and nDCG@10 is taken per
  claim at every weight of the grid;
* dev claims are split by whether any of their evidence abstracts is cited by a claim the run trained
  on ("seen") or not ("unseen"), the same split `benchmarks/scifact_seen_evidence.py` makes on test;
* each rule chooses a weight on the seen dev claims and is scored on the unseen ones (the shift from
  memorised to new evidence), and chooses on a random half of all dev claims and is scored on the other
  half (`--halves` times; selection noise alone).

Rules: ``argmax`` (ties to the larger weight: what ships), ``argmax-low`` (ties to the smaller),
``1se`` (the smallest weight whose mean is within one standard error of the per-claim difference to the
best: shrink toward the first stage when dev cannot tell weights apart).

    .venv/bin/python benchmarks/alpha_rules.py --index runs/demo-index --runs runs/regen runs/seed1 runs/seed2 --out runs/alpha-rules

Per-claim scores are cached in `--out` (delete it to rescore).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from scifact_train_common import DEFAULT_DATA, load_splits

RULES = ("argmax", "argmax-low", "1se")


def choose(curves: np.ndarray, grid: list[float], rule: str) -> int:
    """Index into `grid` of the weight `rule` picks from per-claim scores.  # curves: (claims, weights)"""
    means = curves.mean(axis=0)  # (W,)
    best = max(range(len(grid)), key=lambda i: (means[i], grid[i]))
    if rule == "argmax":
        return best
    if rule == "argmax-low":
        return max(range(len(grid)), key=lambda i: (means[i], -grid[i]))
    if rule == "1se":
        n = curves.shape[0]
        for i in range(len(grid)):  # smallest weight first
            diff = curves[:, best] - curves[:, i]  # (claims,)
            se = diff.std(ddof=1) / np.sqrt(n) if n > 1 else 0.0
            if means[best] - means[i] <= se:
                return i
        return best
    raise ValueError(f"unknown rule {rule!r}; choose one of {RULES}")


def score_run(run_dir: str, index: str, data: str, rerank_k: int, grid: list[float], bf16) -> dict:
    """Per-claim dev nDCG@10 at each weight, for the dense and hybrid first stages, and each claim's seen flag."""
    from rerank_windows import load

    from twotower.eval.metrics.retrieval import evaluate
    from twotower.retrieval import SearchPipeline
    from twotower.retrieval.interpolation import interpolate_run

    with open(os.path.join(run_dir, "demo_reranker.json"), encoding="utf-8") as f:
        settings = json.load(f)["settings"]
    seed = settings.get("dev_seed", settings["seed"])  # the seed that carved this run's dev claims
    _, dev_q, dev_qrels, _, _, _, train_qrels = load_splits(data, seed=seed, with_train=True)
    cited = {d for rel in train_qrels.values() for d, g in rel.items() if g > 0}
    qids = sorted(dev_q)
    ce = load(os.path.join(run_dir, "best"), 192, bf16)
    firsts, docs = {}, {}
    with SearchPipeline.load(index, bf16=bf16, use_default_reranker=False) as pipe:
        for name, hybrid in (("dense", False), ("hybrid", True)):
            hits = pipe.search([dev_q[q] for q in qids], k=rerank_k, recall_k=100, hybrid=hybrid, rerank=False)
            firsts[name] = {q: {h.id: h.score for h in row} for q, row in zip(qids, hits)}
            docs.update({h.id: (h.title or "", h.text) for row in hits for h in row})
    pairs = sorted({(q, d) for run in firsts.values() for q, ranked in run.items() for d in ranked})
    by_pair = dict(zip(pairs, ce.predict([(dev_q[q], docs[d]) for q, d in pairs]).tolist()))
    out = {"seed": seed, "claims": qids,
           "seen": [any(d in cited for d, g in dev_qrels[q].items() if g > 0) for q in qids]}
    for name, first in firsts.items():
        rerank = {q: {d: by_pair[(q, d)] for d in ranked} for q, ranked in first.items()}
        cols = []
        for a in grid:
            per = evaluate(interpolate_run(rerank, first, a), dev_qrels, ["ndcg@10"]).per_query
            cols.append([per[q]["ndcg@10"] if q in per else 0.0 for q in qids])
        out[name] = np.array(cols).T.round(6).tolist()  # (claims, weights)
    return out


def judge(curves: np.ndarray, seen: np.ndarray, grid: list[float], halves: int, seed: int) -> dict:
    """What each rule picks on all dev, and the gain over the first stage (weight 0) it earns on held-out claims."""
    rng = np.random.default_rng(seed)
    zero = grid.index(0.0)
    out = {}
    for rule in RULES:
        pick_all = choose(curves, grid, rule)
        pick_seen = choose(curves[seen], grid, rule)
        unseen = curves[~seen]
        gains = []
        for _ in range(halves):
            perm = rng.permutation(len(curves))
            a, b = perm[: len(perm) // 2], perm[len(perm) // 2:]
            i = choose(curves[a], grid, rule)
            gains.append(curves[b, i].mean() - curves[b, zero].mean())
        out[rule] = {"weight_all_dev": grid[pick_all], "weight_seen_dev": grid[pick_seen],
                     "unseen_gain": round(float(unseen[:, pick_seen].mean() - unseen[:, zero].mean()), 4),
                     "half_gain": round(float(np.mean(gains)), 4)}
    out["unseen_curve"] = {str(a): round(float(v), 4) for a, v in zip(grid, curves[~seen].mean(axis=0))}
    out["seen_curve"] = {str(a): round(float(v), 4) for a, v in zip(grid, curves[seen].mean(axis=0))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", required=True, help="a SciFact index built with --bm25 (the trainers' dev: the sample)")
    ap.add_argument("--runs", nargs="+", required=True, help="`twotower train demo-reranker --out` directories")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--rerank-k", type=int, default=20)
    ap.add_argument("--halves", type=int, default=1000)
    ap.add_argument("--bf16", choices=["auto", "0", "1"], default="auto")
    ap.add_argument("--out", required=True, help="folder for the per-claim scores and the summary")
    args = ap.parse_args()

    from twotower.common.device import cpu_description
    from twotower.retrieval.training.alpha import ALPHA_GRID

    grid = [float(a) for a in ALPHA_GRID]
    bf16 = {"auto": "auto", "0": False, "1": True}[args.bf16]
    os.makedirs(args.out, exist_ok=True)
    summary = {"cpu": cpu_description(), "args": vars(args), "runs": {}}
    for run in args.runs:
        cache = os.path.join(args.out, os.path.basename(os.path.normpath(run)) + ".json")
        if not os.path.isfile(cache):
            with open(cache + ".tmp", "w", encoding="utf-8") as f:
                json.dump(score_run(run, args.index, args.data, args.rerank_k, grid, bf16), f)
            os.replace(cache + ".tmp", cache)
        with open(cache, encoding="utf-8") as f:
            scored = json.load(f)
        seen = np.array(scored["seen"])
        summary["runs"][run] = {"seed": scored["seed"], "dev_claims": len(seen), "unseen": int((~seen).sum())}
        for name in ("dense", "hybrid"):
            r = judge(np.array(scored[name]), seen, grid, args.halves, scored["seed"])
            summary["runs"][run][name] = r
            print(f"{run} seed {scored['seed']} {name} ({int((~seen).sum())} of {len(seen)} dev claims unseen): "
                  + "; ".join(f"{rule}: all {r[rule]['weight_all_dev']} seen {r[rule]['weight_seen_dev']} "
                              f"-> unseen {r[rule]['unseen_gain']:+.4f}, halves {r[rule]['half_gain']:+.4f}"
                              for rule in RULES), flush=True)
            print("   unseen curve " + " ".join(f"{a}:{v:.3f}" for a, v in r["unseen_curve"].items()))
            print("   seen curve   " + " ".join(f"{a}:{v:.3f}" for a, v in r["seen_curve"].items()))
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
