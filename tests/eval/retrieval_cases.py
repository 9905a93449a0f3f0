"""Random runs and graded qrels for the pytrec_eval parity test (and its recorded numbers).

Each case mixes the situations where implementations disagree: score ties
(scores drawn from a few values), document ids whose text order differs from
their numeric order (d2 vs d10), graded and negative judgments, judged queries
with no relevant document, judged queries absent from the run, empty result
lists, run queries without judgments, documents named like their query (for
drop_self_hits), and rankings longer than the largest cutoff.

``python -m tests.eval.retrieval_cases`` prints the number of cases and the
largest absolute difference to pytrec_eval, as recorded in docs/results.md ("Evaluation parity").
"""

from __future__ import annotations

import numpy as np

CUTOFFS = (1, 3, 5, 10, 20)
OUR_METRICS = (
    [f"ndcg@{k}" for k in CUTOFFS]
    + ["ndcg"]
    + [f"recall@{k}" for k in CUTOFFS]
    + [f"p@{k}" for k in CUTOFFS]
    + ["map"]
    + [f"map@{k}" for k in CUTOFFS]
    + ["rprec", "mrr"]
    + [f"mrr@{k}" for k in CUTOFFS]
)
# our label -> pytrec_eval key (mrr@k is checked on a run truncated to k, see parity_diffs)
TREC_KEYS = (
    {f"ndcg@{k}": f"ndcg_cut_{k}" for k in CUTOFFS}
    | {"ndcg": "ndcg", "map": "map", "rprec": "Rprec", "mrr": "recip_rank"}
    | {f"recall@{k}": f"recall_{k}" for k in CUTOFFS}
    | {f"p@{k}": f"P_{k}" for k in CUTOFFS}
    | {f"map@{k}": f"map_cut_{k}" for k in CUTOFFS}
)
TREC_MEASURES = {
    "ndcg",
    "map",
    "Rprec",
    "recip_rank",
    *(f"ndcg_cut.{k}" for k in CUTOFFS),
    *(f"recall.{k}" for k in CUTOFFS),
    *(f"P.{k}" for k in CUTOFFS),
    *(f"map_cut.{k}" for k in CUTOFFS),
}


def random_case(rng: np.random.Generator) -> tuple[dict, dict]:
    """One (run, qrels) pair."""
    n_queries = int(rng.integers(1, 9))
    qids = [f"q{i}" for i in rng.choice(40, size=n_queries, replace=False)]
    pool = [f"d{i}" for i in range(int(rng.integers(5, 60)))] + ["D1", "d", "q1", "q2", "q3"]
    discrete = rng.random() < 0.6  # many ties when scores come from a handful of values
    qrels: dict[str, dict[str, int]] = {}
    run: dict[str, dict[str, float]] = {}
    for qid in qids:
        n_judged = int(rng.integers(1, 15))
        judged = rng.choice(len(pool), size=min(n_judged, len(pool)), replace=False)
        levels = rng.choice([-1, 0, 0, 1, 1, 2, 3], size=judged.size)
        if rng.random() < 0.1:
            levels[:] = rng.choice([-1, 0], size=judged.size)  # judged, but nothing relevant
        qrels[qid] = {pool[j]: int(v) for j, v in zip(judged, levels)}
        situation = rng.random()
        if situation < 0.1:
            continue  # judged query absent from the run
        if situation < 0.18:
            run[qid] = {}  # present with no results
            continue
        n_ret = int(rng.integers(1, min(len(pool), 45) + 1))
        docs = rng.choice(len(pool), size=n_ret, replace=False)
        if discrete:
            scores = rng.integers(0, 4, size=n_ret) / 2.0
        else:
            scores = np.round(rng.normal(size=n_ret), 6)
        run[qid] = {pool[d]: float(s) for d, s in zip(docs, scores)}
    if rng.random() < 0.3:  # a query with results but no judgments
        run["unjudged"] = {pool[0]: 1.0, pool[1]: 0.5}
    return run, qrels


def cases(n: int = 200, seed: int = 1234) -> list[tuple[dict, dict]]:
    rng = np.random.default_rng(seed)
    return [random_case(rng) for _ in range(n)]


def _truncate(run: dict, k: int) -> dict:
    """Top-k of each query in trec_eval order (score desc, docid desc), written independently of eval/."""
    return {
        q: dict(sorted(d.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:k]) for q, d in run.items()
    }


def parity_diffs(run: dict, qrels: dict, drop_self_hits: bool = False) -> list[tuple[str, str, float, float]]:
    """(query or "<mean>", metric, ours, pytrec_eval) for every judged query and metric."""
    import pytrec_eval

    from twotower.eval.metrics import evaluate

    ours = evaluate(run, qrels, OUR_METRICS, drop_self_hits=drop_self_hits)
    ref_run = run
    if drop_self_hits:
        ref_run = {q: {d: s for d, s in docs.items() if d != q} for q, docs in run.items()}
    # A query with an empty result dict makes pytrec_eval read uninitialised memory (it hangs or
    # returns garbage depending on what ran before).  A TREC run file cannot express "query with no
    # results" anyway -- the query is simply absent -- so the reference sees it absent (score 0).
    ref_run = {q: docs for q, docs in ref_run.items() if docs}
    reference = pytrec_eval.RelevanceEvaluator(qrels, TREC_MEASURES - {"ndcg"}).evaluate(ref_run)
    # trec_eval's full-length "ndcg" (not ndcg_cut) loops forever or reads garbage on a query whose
    # judgments are all negative; such a query has ideal DCG 0, which trec_eval defines as nDCG 0.
    # So the reference nDCG is computed on the queries that have a relevant document, 0 elsewhere.
    positive = {q: j for q, j in qrels.items() if any(v > 0 for v in j.values())}
    full = pytrec_eval.RelevanceEvaluator(positive, {"ndcg"}).evaluate(ref_run) if positive else {}
    for qid, values in reference.items():
        values["ndcg"] = full[qid]["ndcg"] if qid in full else 0.0
    for k in CUTOFFS:
        truncated = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(_truncate(ref_run, k))
        for qid, values in truncated.items():
            reference[qid][f"mrr@{k}"] = values["recip_rank"]
    rows = []
    for label in OUR_METRICS:
        key = TREC_KEYS.get(label, label)
        total = 0.0
        for qid in qrels:
            # trec_eval -c: a judged query that pytrec_eval did not evaluate (absent from the run) is 0
            expected = reference[qid][key] if qid in reference else 0.0
            total += expected
            rows.append((qid, label, ours.per_query[qid][label], expected))
        rows.append(("<mean>", label, ours.means[label], total / len(qrels)))
    return rows


def max_abs_diff(n: int = 200, seed: int = 1234) -> tuple[int, int, float]:
    """(cases, comparisons, largest |ours - pytrec_eval|) over both drop_self_hits settings."""
    worst, count = 0.0, 0
    for run, qrels in cases(n, seed):
        for drop in (False, True):
            for _, _, a, b in parity_diffs(run, qrels, drop):
                worst = max(worst, abs(a - b))
                count += 1
    return n, count, worst


if __name__ == "__main__":
    n_cases, n_comparisons, worst = max_abs_diff()
    print(f"cases={n_cases} comparisons={n_comparisons} max_abs_diff={worst:.3e}")
