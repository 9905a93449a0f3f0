"""Dev-split evaluation used for model selection while training (never the test split).

`dense_run` retrieves with a dual encoder over a corpus (or a pool of it),
`rerank_run` reorders a first-stage run with a cross-encoder, and `dev_metrics`
scores a run (nDCG@10, which picks checkpoints, and recall@100) with the
project's trec_eval-exact metrics.  A dev pool (the dev positives plus a seeded
sample of other documents) makes evaluation affordable on a CPU; a run reports
which pool it used, since nDCG over a pool is higher than over the full corpus.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import numpy as np

Run = dict[str, dict[str, float]]


def dev_pool(corpus: Mapping[str, str], qrels: Mapping[str, Mapping[str, int]], size: int | None,
             seed: int = 0) -> dict[str, str]:
    """The whole corpus (size None) or the judged documents plus `size` others drawn with `seed`."""
    if size is None or size >= len(corpus):
        return dict(corpus)
    judged = {d for docs in qrels.values() for d in docs if d in corpus}
    others = sorted(d for d in corpus if d not in judged)
    picked = judged | set(random.Random(seed).sample(others, min(size, len(others))))
    return {d: corpus[d] for d in corpus if d in picked}


def dense_run(dual, queries: Mapping[str, str], corpus: Mapping[str, str], k: int = 100,
              batch_size: int = 64, progress: bool = False) -> Run:
    """Top-k of every query by inner product of the dual encoder's vectors. {qid: {doc id: score}}."""
    from twotower.retrieval.training.mining import DenseRetriever

    retriever = DenseRetriever(dual, corpus, batch_size=batch_size, progress=progress)
    qids = list(queries)
    hits = retriever([queries[q] for q in qids], k)
    return {q: dict(h) for q, h in zip(qids, hits)}


def top_k(run: Mapping[str, Mapping[str, float]], k: int) -> dict[str, list[str]]:
    """Doc ids of each query's top k, best first (ties by doc id, as trec_eval)."""
    return {q: [d for d, _ in sorted(docs.items(), key=lambda x: (-x[1], x[0]))[:k]] for q, docs in run.items()}


def rerank_run(cross_encoder, queries: Mapping[str, str], first_stage: Mapping[str, Mapping[str, float]],
               corpus: Mapping[str, str], k: int = 100, batch_size: int = 32,
               progress: bool = False, known: Mapping[str, Mapping[str, float]] | None = None) -> tuple[Run, np.ndarray]:
    """Rescore each query's first-stage top-k with the cross-encoder. Returns (run, all scores (N,)).

    Scored by `twotower.retrieval.rerank.rerank_scores`, the step `SearchPipeline` reranks with.
    known: scores this cross-encoder already gave ({query id: {doc id: score}}); those pairs are
    taken from it instead of scored again (why: a second first stage's top-k mostly repeats the first's).
    """
    from twotower.retrieval.rerank import rerank_scores

    known = known or {}
    tops = top_k({q: first_stage.get(q, {}) for q in queries}, k)
    todo = {q: [d for d in docs if d not in known.get(q, {})] for q, docs in tops.items()}
    todo = {q: docs for q, docs in todo.items() if docs}
    fresh: Run = {}
    if todo:
        texts = [[corpus[d] for d in docs] for docs in todo.values()]
        scores = rerank_scores(cross_encoder, [queries[q] for q in todo], texts, batch_size=batch_size, progress=progress)
        fresh = {q: dict(zip(docs, s.tolist())) for (q, docs), s in zip(todo.items(), scores)}
    run: Run = {q: {d: fresh[q][d] if d in fresh.get(q, {}) else known[q][d] for d in docs} for q, docs in tops.items()}
    flat = [s for docs in run.values() for s in docs.values()]
    return run, np.asarray(flat, dtype=np.float32)


DEV_METRICS = ("ndcg@10", "recall@100")


def dev_metrics(run: Mapping[str, Mapping[str, float]], qrels: Mapping[str, Mapping[str, int]],
                metrics: Sequence[str] = DEV_METRICS) -> dict[str, float]:
    """Mean `metrics` over the judged queries, trec_eval -c semantics: {"ndcg@10": ..., "recall@100": ...}."""
    from twotower.eval.metrics.retrieval import evaluate

    return evaluate(run, qrels, list(metrics)).means
