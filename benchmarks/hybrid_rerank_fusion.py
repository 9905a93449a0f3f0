"""How to combine a reranker with the hybrid first stage: z-score interpolation at a dev-chosen weight, or RRF.

`--hybrid --rerank` mixes ``alpha * z(rerank) + (1 - alpha) * z(RRF score)`` over the hybrid's top
`--rerank-k`, with ``alpha`` chosen on 81 dev claims.  Dev cannot pin that weight down (docs/results.md,
"Other seeds": a run that chose 0.6 lost 0.026 on unseen evidence).  Reciprocal-rank fusion of the
reranker's ranking with the two lists the hybrid already fuses needs no weight:

    rrf3(d) = 1 / (60 + rank_dense(d)) + 1 / (60 + rank_bm25(d)) + w / (60 + rank_rerank(d))

(the first two terms are the hybrid's own score; w = 1 is plain RRF of three lists).  For each reranker
this script searches the claims in `--index` as `--hybrid` does (the RRF of the dense and BM25 top 100s),
scores the hybrid's top `--rerank-k` with the reranker, and scores nDCG@10 per claim for the
z-interpolation at every weight of the trainers' grid and for rrf3 at each w of `--rrf-weights`.

* ``--split dev``: the run's dev claims (its dev seed; ``default`` is seed 0), split into seen / unseen
  evidence as `benchmarks/alpha_rules.py` does, and judged the same way: each rule chooses on the seen
  claims and is scored on the unseen, and chooses on a random half and is scored on the other half.
* ``--split test``: the SciFact test claims; writes TREC runs (`--out`/test_*.trec) for
  `benchmarks/scifact_seen_evidence.py`.  Touch only to report a choice already made on dev.

    .venv/bin/python benchmarks/hybrid_rerank_fusion.py --index runs/demo-index --rerankers default runs/wc-model runs/wc-bm25 --out runs/fusion-dev
    .venv/bin/python benchmarks/hybrid_rerank_fusion.py --split test --index runs/serve/scifact-minilm --rerankers default --out runs/fusion-test

Per-claim scores are cached in `--out` (delete it to rescore).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from alpha_rules import judge as judge_rules
from scifact_train_common import DEFAULT_DATA, load_splits, write_run

from twotower.retrieval.fusion import RRF_K


def rrf3(first: dict[str, float], rerank: dict[str, float], w: float) -> dict[str, float]:
    """One claim's reranked candidates rescored: their hybrid RRF score plus w / (60 + rank by the reranker).

    `first` is the pipeline's hybrid score, which is already 1/(60 + dense rank) + 1/(60 + BM25 rank)
    (`twotower.retrieval.fusion.reciprocal_rank_fusion`), so only the reranker's term is added here.
    Reranker ties are ordered by the hybrid score.
    """
    order = sorted(rerank, key=lambda d: (-rerank[d], -first[d], d))
    return {d: first[d] + w / (RRF_K + r) for r, d in enumerate(order, start=1)}


def first_stage(index: str, queries: dict[str, str], qids: list[str], bf16):
    """({doc: hybrid RRF score} of the top 100, {doc: (title, text)}) per claim, as `--hybrid` searches."""
    from twotower.retrieval import SearchPipeline

    with SearchPipeline.load(index, bf16=bf16, use_default_reranker=False) as pipe:
        hybrid = pipe.search([queries[q] for q in qids], k=100, recall_k=100, hybrid=True, rerank=False)
    h_score = {q: {h.id: h.score for h in row} for q, row in zip(qids, hybrid)}
    docs = {h.id: (h.title or "", h.text) for row in hybrid for h in row}
    return h_score, docs


def score(reranker: str, index: str, data: str, split: str, rerank_k: int, grid: list[float],
          rrf_weights: list[float], bf16, runs_out: str | None) -> dict:
    from rerank_windows import load

    from twotower.eval.metrics.retrieval import evaluate
    from twotower.retrieval.interpolation import interpolate_run

    seed = 0
    if reranker != "default":
        with open(os.path.join(reranker, "demo_reranker.json"), encoding="utf-8") as f:
            settings = json.load(f)["settings"]
        seed = settings.get("dev_seed", settings["seed"])
        reranker = os.path.join(reranker, "best")
    _, dev_q, dev_qrels, test_q, test_qrels, _, train_qrels = load_splits(data, seed=seed, with_train=True)
    queries, qrels = (dev_q, dev_qrels) if split == "dev" else (test_q, test_qrels)
    cited = {d for rel in train_qrels.values() for d, g in rel.items() if g > 0}
    qids = sorted(queries)
    h_score, docs = first_stage(index, queries, qids, bf16)
    heads = {q: dict(list(h_score[q].items())[:rerank_k]) for q in qids}
    pairs = [(q, d) for q in qids for d in heads[q]]
    ce = load(reranker, 192, bf16)
    scores = ce.predict([(queries[q], docs[d]) for q, d in pairs]).tolist()
    rr: dict[str, dict[str, float]] = {q: {} for q in qids}
    for (q, d), s in zip(pairs, scores):
        rr[q][d] = s

    def full(top: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """The reordered top rerank_k above the rest of the hybrid's 100, in the hybrid's order."""
        out = {}
        for q in qids:
            floor = min(top[q].values())
            tail = [d for d in h_score[q] if d not in top[q]]
            out[q] = {**top[q], **{d: floor - i for i, d in enumerate(tail, start=1)}}
        return out

    systems = {"hybrid": full(heads)}
    for a in grid:
        systems[f"z@{a}"] = full(interpolate_run(rr, heads, a))
    for w in rrf_weights:
        systems[f"rrf3@{w}"] = full({q: rrf3(heads[q], rr[q], w) for q in qids})
    out = {"seed": seed, "claims": qids,
           "seen": [any(d in cited for d, g in qrels[q].items() if g > 0) for q in qids], "per_claim": {}}
    for name, run in systems.items():
        per = evaluate(run, qrels, ["ndcg@10"]).per_query
        out["per_claim"][name] = [round(per[q]["ndcg@10"], 6) if q in per else 0.0 for q in qids]
        if runs_out:
            write_run(run, os.path.join(runs_out, f"test_{name.replace('@', '_')}.trec"), name)
    return out


def judge(scored: dict, grid: list[float], rrf_weights: list[float], halves: int) -> dict:
    """Gains over the hybrid: the z-score weight argmax picks (judged by `alpha_rules.judge`), and rrf3 at each
    fixed w, scored on the same unseen claims and the same random halves (a fixed w has nothing to choose)."""
    per = {k: np.array(v) for k, v in scored["per_claim"].items()}
    seen = np.array(scored["seen"])
    base = per["hybrid"]
    z = np.stack([per[f"z@{a}"] for a in grid], axis=1)  # (claims, weights); the column at 0.0 is the hybrid
    chosen = judge_rules(z, seen, grid, halves, scored["seed"])["argmax"]
    out = {"hybrid": round(float(base.mean()), 4),
           "z_argmax": {"all_dev": round(float(z[:, grid.index(chosen["weight_all_dev"])].mean()), 4),
                        "weight": chosen["weight_all_dev"], "unseen_gain": chosen["unseen_gain"],
                        "half_gain": chosen["half_gain"]}}
    rng = np.random.default_rng(scored["seed"])  # the halves `alpha_rules.judge` draws for argmax
    scored_halves = [p[len(p) // 2:] for p in (rng.permutation(len(base)) for _ in range(halves))]
    for w in rrf_weights:
        col = per[f"rrf3@{w}"]
        out[f"rrf3@{w}"] = {"all_dev": round(float(col.mean()), 4),
                            "unseen_gain": round(float(col[~seen].mean() - base[~seen].mean()), 4),
                            "half_gain": round(float(np.mean([col[b].mean() - base[b].mean() for b in scored_halves])), 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", required=True, help="a SciFact index built with --bm25")
    ap.add_argument("--rerankers", nargs="+", required=True,
                    help="`default` or `twotower train demo-reranker --out` directories")
    ap.add_argument("--split", choices=["dev", "test"], default="dev")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--rerank-k", type=int, default=20)
    ap.add_argument("--rrf-weights", default="0.5,1,1.5,2,3")
    ap.add_argument("--halves", type=int, default=1000)
    ap.add_argument("--bf16", choices=["auto", "0", "1"], default="auto")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from twotower.common.device import cpu_description
    from twotower.retrieval.training.alpha import ALPHA_GRID

    grid = [float(a) for a in ALPHA_GRID]
    rrf_weights = [float(w) for w in args.rrf_weights.split(",")]
    bf16 = {"auto": "auto", "0": False, "1": True}[args.bf16]
    os.makedirs(args.out, exist_ok=True)
    summary = {"cpu": cpu_description(), "args": vars(args), "rerankers": {}}
    for rr in args.rerankers:
        name = "default" if rr == "default" else os.path.basename(os.path.normpath(rr))
        cache = os.path.join(args.out, f"{name}.{args.split}.json")
        if not os.path.isfile(cache):
            runs_out = os.path.join(args.out, name) if args.split == "test" else None
            scored = score(rr, args.index, args.data, args.split, args.rerank_k, grid, rrf_weights, bf16, runs_out)
            with open(cache + ".tmp", "w", encoding="utf-8") as f:
                json.dump(scored, f)
            os.replace(cache + ".tmp", cache)
        with open(cache, encoding="utf-8") as f:
            scored = json.load(f)
        means = {k: round(float(np.mean(v)), 4) for k, v in scored["per_claim"].items()}
        entry = {"seed": scored["seed"], "claims": len(scored["claims"]), "unseen": int(len(scored["seen"]) - sum(scored["seen"])),
                 "means": means}
        if args.split == "dev":
            entry["judged"] = judge(scored, grid, rrf_weights, args.halves)
        summary["rerankers"][rr] = entry
        print(json.dumps({rr: entry}), flush=True)
    with open(os.path.join(args.out, f"summary.{args.split}.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
