"""Train a cross-encoder reranker from all-MiniLM-L6-v2 weights on SciFact train; rerank the best first stage.

Run from the repository root after benchmarks/scifact_train_dual.py (it reads that run's TREC files):

    nohup .venv/bin/python benchmarks/scifact_train_reranker.py > runs/scifact_reranker.log 2>&1 &

Steps, none of which looks at test:
1. the first stage is the one of ``<dual-out>/results.json`` with the best *dev* recall@100
   (dense, BM25 or hybrid): what a reranker can reach is bounded by what recall hands it;
2. training negatives come from that first stage's ranking of the train queries (ranks 1-100
   minus positives) when ``<dual-out>/runs/train_<first>.trec`` exists, else from BM25;
3. `twotower.retrieval.training.train_reranker` (listwise, 1 positive + 7 negatives) with dev evaluation =
   nDCG@10 after reranking each dev query's first-stage top ``--dev-rerank-k``; best checkpoint kept;
4. the best checkpoint reranks the top-100 of dev and test; besides the reranker alone we report
   the interpolation ``a * z(rerank) + (1 - a) * z(first stage)`` (per-query z-scores) with ``a``
   chosen on dev.

``--reranker DIR|default`` skips training and scores that reranker (``default``: the one twotower
ships) over the same first stage, its weight chosen on dev the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from scifact_train_common import (
    DEFAULT_DATA,
    REPO,
    evaluate,
    load_splits,
    minilm_path,
    read_run,
    write_json,
    write_run,
)


def choose_first_stage(results: dict) -> str:
    names = sorted({k.split("/", 1)[1] for k in results["metrics"] if k.startswith("dev/")})
    names = [n for n in names if n != "dense_base"]
    return max(names, key=lambda n: (results["metrics"][f"dev/{n}"]["recall@100"],
                                     results["metrics"][f"dev/{n}"]["ndcg@10"]))


def mine_from_run(run: dict, train_q: dict, train_qrels: dict, out: str, num: int = 28) -> str:
    """Negatives for the train queries from a first-stage run (ranks 1-100, positives dropped)."""
    from twotower.retrieval.training.mining import MiningConfig, mine_hard_negatives, write_mined
    from twotower.retrieval.training.training_data import TrainExample

    by_text = {train_q[q]: q for q in train_q}
    examples = [TrainExample(q, train_q[q], tuple(d for d, r in train_qrels[q].items() if r > 0)) for q in train_q]

    def retrieve(queries, k):
        return [sorted(run.get(by_text[t], {}).items(), key=lambda x: (-x[1], x[0]))[:k] for t in queries]

    cfg = MiningConfig(rank_start=1, rank_end=100, num_negatives=num)
    mined, stats = mine_hard_negatives(examples, retrieve, [], cfg)
    write_mined(out, mined, {"source": "first-stage run", **stats.as_dict()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--model", default=None, help="starting encoder (default: all-MiniLM-L6-v2)")
    ap.add_argument("--dual-out", default=os.path.join(REPO, "runs", "scifact_dual"))
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "scifact_reranker"))
    ap.add_argument("--first-stage", default=None, help="dense|bm25|hybrid (default: best dev recall@100)")
    ap.add_argument("--time-budget", type=float, default=40 * 60)
    ap.add_argument("--eval-interval", type=float, default=15 * 60)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--head-lr-scale", type=float, default=10.0)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--head-pooling", choices=["cls", "mean"], default="cls",
                    help="what a fresh relevance head reads: the [CLS] pooler or the mean of the token states")
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--bf16", choices=["auto", "0", "1"], default="auto",
                    help="bf16 autocast while training (auto: where the CPU has it; 0 forces fp32); scoring uses auto")
    ap.add_argument("--warmup", type=float, default=0.1)
    ap.add_argument("--dev-rerank-k", type=int, default=20, help="first-stage depth reranked at dev evaluations")
    ap.add_argument("--final-k", type=int, default=100, help="first-stage depth reranked for the reported runs")
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--reranker", default=None, metavar="DIR|default",
                    help="score this reranker (a directory, or 'default': the one twotower ships) instead of "
                         "training one; implies --skip-train")
    args = ap.parse_args()

    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.interpolation import interpolate_run
    from twotower.retrieval.training.alpha import choose_alpha
    from twotower.retrieval.training.dev_eval import rerank_run
    from twotower.retrieval.training.train_reranker import RerankerTrainConfig, train_reranker

    with open(os.path.join(args.dual_out, "results.json"), encoding="utf-8") as f:
        dual_results = json.load(f)
    first_name = args.first_stage or choose_first_stage(dual_results)
    runs_dir = os.path.join(args.dual_out, "runs")
    corpus, dev_q, dev_qrels, test_q, test_qrels, train_q, train_qrels = load_splits(args.data, with_train=True)
    results: dict = {"command": "benchmarks/scifact_train_reranker.py", "args": vars(args), "first_stage": first_name}
    os.makedirs(args.out, exist_ok=True)
    negatives, mine = None, "bm25"
    train_run_path = os.path.join(runs_dir, f"train_{first_name}.trec")
    if os.path.isfile(train_run_path):
        negatives = mine_from_run(read_run(train_run_path), train_q, train_qrels,
                                  os.path.join(args.out, "first_stage_negatives.jsonl"))
        mine = None
    results["negatives_from"] = first_name if negatives else "bm25"
    if not (args.skip_train or args.reranker):
        cfg = RerankerTrainConfig(
            model=args.model or minilm_path(), pairs=args.data, out=args.out, negatives=negatives, mine=mine,
            mine_ranks=(1, 100), first_stage=os.path.join(runs_dir, f"dev_{first_name}.trec"), loss="listwise",
            group_size=args.group_size, batch_size=args.batch_size, max_length=args.max_length, lr=args.lr,
            head_lr_scale=args.head_lr_scale, head_pooling=args.head_pooling, max_steps=args.max_steps,
            warmup=args.warmup, epochs=args.epochs, bf16={"auto": "auto", "0": False, "1": True}[args.bf16], time_budget=args.time_budget, eval_interval_s=args.eval_interval,
            dev_rerank_k=args.dev_rerank_k, eval_at_start=False, progress=True,
        )
        t = time.time()
        res = train_reranker(cfg)
        results["train"] = {"seconds": round(time.time() - t, 1), "best_step": res.best_step, "steps": res.steps,
                            f"best_dev_ndcg@10_top{args.dev_rerank_k}": res.best_score,
                            "first_stage_dev_ndcg@10": res.first_stage_score, "stopped_by": res.stopped_by}
        print("training:", results["train"], flush=True)

    if args.reranker == "default":
        from twotower.retrieval import default_reranker

        model = default_reranker.load(max_length=args.max_length)
    else:
        model = CrossEncoder.from_pretrained(args.reranker or os.path.join(args.out, "best"), max_length=args.max_length)
    if model.windows is not None:  # a windowed reranker reads (title, text), as the search pipeline hands it
        from twotower.retrieval.training.training_data import read_titles, titled_documents

        corpus = titled_documents(corpus, read_titles(os.path.join(args.data, "corpus.jsonl")))
    table = {}
    reranked, firsts = {}, {}
    for split, queries, qrels in (("dev", dev_q, dev_qrels), ("test", test_q, test_qrels)):
        first = read_run(os.path.join(runs_dir, f"{split}_{first_name}.trec"))
        t = time.time()
        run, _ = rerank_run(model, queries, first, corpus, k=args.final_k, batch_size=32, progress=True)
        print(f"reranked {split} top-{args.final_k} in {time.time() - t:.0f}s", flush=True)
        write_run(run, os.path.join(args.out, "runs", f"{split}_rerank.trec"), tag="rerank")
        table[f"{split}/{first_name}"] = evaluate(first, qrels)
        table[f"{split}/rerank"] = evaluate(run, qrels)
        reranked[split], firsts[split] = run, first
    best_a, dev_curve = choose_alpha(reranked["dev"], firsts["dev"], dev_qrels)  # dev only, never test
    results["interpolation"] = {"dev_ndcg@10_by_a": dev_curve, "chosen_a": best_a}
    for split, qrels in (("dev", dev_qrels), ("test", test_qrels)):
        run = interpolate_run(reranked[split], firsts[split], best_a)
        write_run(run, os.path.join(args.out, "runs", f"{split}_interpolated.trec"), tag="interp")
        table[f"{split}/interpolated"] = evaluate(run, qrels)
    results["metrics"] = table
    write_json(os.path.join(args.out, "results.json"), results)
    print("| run | dev nDCG@10 | test nDCG@10 |")
    print("|---|---|---|")
    for name in (first_name, "rerank", "interpolated"):
        print(f"| {name} | {table[f'dev/{name}']['ndcg@10']:.4f} | {table[f'test/{name}']['ndcg@10']:.4f} |")
    print(f"interpolation weight a={best_a} (chosen on dev)")


if __name__ == "__main__":
    main()
