"""Every retrieval metric equals pytrec_eval (trec_eval 9) on 200 random runs, within 1e-6."""

from __future__ import annotations

import pytest

from tests.eval.retrieval_cases import OUR_METRICS, cases, parity_diffs
from twotower.eval.metrics import parse_metric

pytest.importorskip("pytrec_eval")

CASES = cases(200, seed=1234)


@pytest.mark.parametrize("drop_self_hits", [False, True])
def test_matches_pytrec_eval_on_200_random_runs(drop_self_hits):
    worst = 0.0
    checked = 0
    for index, (run, qrels) in enumerate(CASES):
        for qid, metric, ours, reference in parity_diffs(run, qrels, drop_self_hits):
            assert ours == pytest.approx(reference, abs=1e-6), (index, qid, metric)
            worst = max(worst, abs(ours - reference))
            checked += 1
    assert checked > 20_000
    assert worst < 1e-6


def test_cases_cover_the_hard_situations():
    """The random cases really contain ties, empty and missing queries, and unjudged queries."""
    ties = empty = missing = unjudged = no_relevant = self_hits = 0
    for run, qrels in CASES:
        for qid, docs in run.items():
            ties += len(docs) != len(set(docs.values()))
            empty += not docs
            unjudged += qid not in qrels
            self_hits += qid in docs
        missing += sum(qid not in run for qid in qrels)
        no_relevant += sum(all(v <= 0 for v in j.values()) for j in qrels.values())
    assert min(ties, empty, missing, unjudged, no_relevant, self_hits) >= 10
    assert {parse_metric(m).family for m in OUR_METRICS} == {"ndcg", "mrr", "recall", "p", "map", "rprec"}
