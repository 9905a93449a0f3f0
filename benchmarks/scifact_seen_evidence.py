"""SciFact test split by whether a claim's evidence was already a positive in train: how much of a gain is memory?

181 of the 283 abstracts cited by test claims are also cited by train claims (196 of 300 test claims have
at least one such abstract).  A model fine-tuned on train can therefore gain on test partly by learning
*which documents* tend to be relevant, not only how to match claims to abstracts.  This script scores saved
TREC runs separately on the two groups of test claims, so that the gain on claims with unseen evidence is
visible on its own:

    .venv/bin/python benchmarks/scifact_seen_evidence.py runs/scifact_dual_frozen_idle/runs/test_dense_base.trec \\
        runs/scifact_dual_frozen_idle/runs/test_dense.trec

Nothing here makes a choice; it only splits a report.
"""

from __future__ import annotations

import argparse
import os

from scifact_train_common import DEFAULT_DATA, evaluate, load_splits, read_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="TREC run files over the SciFact test claims")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--baseline", default=None, metavar="RUN",
                    help="also print each run's paired difference from this run on each group: the mean, its 95%% "
                         "confidence interval (paired t) and the paired randomization test's p")
    args = ap.parse_args()

    from twotower.eval.io.beir import read_beir_qrels as read_qrels

    train = read_qrels(os.path.join(args.data, "qrels", "train.tsv"))
    test = read_qrels(os.path.join(args.data, "qrels", "test.tsv"))
    seen_docs = {d for docs in train.values() for d, r in docs.items() if r > 0}
    seen = {q: v for q, v in test.items() if any(d in seen_docs for d, r in v.items() if r > 0)}
    unseen = {q: v for q, v in test.items() if q not in seen}
    test_docs = {d for v in test.values() for d, r in v.items() if r > 0}
    print(f"abstracts cited by test claims: {len(test_docs)}, of them cited by train claims: "
          f"{len(test_docs & seen_docs)}")
    print(f"test claims: {len(test)}; evidence seen in train: {len(seen)}; unseen: {len(unseen)}")
    # The dev split the benchmarks carve out of train (seed 0) against the train claims that remain.
    _, _, dev_qrels, _, _, _, rest = load_splits(args.data, with_train=True)
    rest_docs = {d for v in rest.values() for d, r in v.items() if r > 0}
    dev_seen = sum(any(d in rest_docs for d, r in v.items() if r > 0) for v in dev_qrels.values())
    print(f"dev claims: {len(dev_qrels)}; evidence seen in the other {len(rest)} train claims: {dev_seen}")
    print("| run | all | seen evidence | unseen evidence |")
    print("|---|---|---|---|")
    groups = (test, seen, unseen)
    for path in args.runs:
        run = read_run(path)
        cells = [evaluate({q: run.get(q, {}) for q in group}, group)["ndcg@10"] for group in groups]
        print(f"| {path} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    if args.baseline:
        print(f"\nnDCG@10 minus {args.baseline}'s, per claim: mean [95% CI], randomization p")
        print("| run | all | seen evidence | unseen evidence |")
        print("|---|---|---|---|")
        base = read_run(args.baseline)
        for path in args.runs:
            run = read_run(path)
            cells = [paired_cell(run, base, group) for group in groups]
            print(f"| {path} | " + " | ".join(cells) + " |")


def paired_cell(run: dict, base: dict, qrels: dict) -> str:
    """'+0.0130 [-0.0050, +0.0310] p 0.16': the paired difference of nDCG@10 over the judged claims of `qrels`."""
    from twotower.eval.metrics import evaluate as ev
    from twotower.eval.metrics import paired_randomization_test, paired_t_interval

    a = ev({q: run.get(q, {}) for q in qrels}, qrels, ["ndcg@10"]).column("ndcg@10")
    b = ev({q: base.get(q, {}) for q in qrels}, qrels, ["ndcg@10"]).column("ndcg@10")
    low, high = paired_t_interval(a, b)
    p = paired_randomization_test(a, b).pvalue
    return f"{float((a - b).mean()):+.4f} [{low:+.4f}, {high:+.4f}] p {p:.3g}"


if __name__ == "__main__":
    main()
