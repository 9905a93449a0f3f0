"""Hard-negative mining: rank window, margin filters, random negatives, files, retrievers."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from twotower.retrieval.training.mining import (
    DenseRetriever,
    MiningConfig,
    bm25_retriever,
    mine_hard_negatives,
    read_mined_negatives,
    write_mined,
)
from twotower.retrieval.training.training_data import TrainExample, read_jsonl_training

CORPUS = {f"d{i}": f"document number {i}" for i in range(20)}


def fake_retrieve(lists):
    """A retriever returning fixed ranked lists (best first), recording the k it was asked for."""
    calls = []

    def retrieve(queries, k):
        calls.append(k)
        return [lists[q][:k] for q in queries]

    retrieve.calls = calls
    return retrieve


def test_rank_window_and_positive_exclusion():
    ranked = [(f"d{i}", 10.0 - i) for i in range(10)]  # d0 best ... d9
    ex = TrainExample("q", "q1", ("d3",))
    retrieve = fake_retrieve({"q1": ranked})
    cfg = MiningConfig(rank_start=3, rank_end=8, num_negatives=10)
    mined, stats = mine_hard_negatives([ex], retrieve, list(CORPUS), cfg)
    m = mined[0]
    assert retrieve.calls == [8]
    assert m.negatives == ["d2", "d4", "d5", "d6", "d7"]  # ranks 3..8, d3 (positive, rank 4) dropped
    assert m.ranks == [3, 5, 6, 7, 8] and m.sources == ["hard"] * 5
    assert m.positive_score == pytest.approx(7.0)
    assert stats.dropped_positive == 1 and stats.candidates == 6 and stats.short_of_negatives == 1


def test_margin_and_ratio_drop_near_positive_scores():
    ranked = [("d0", 10.0), ("d1", 9.9), ("d2", 9.0), ("d3", 5.0)]
    ex = TrainExample("q", "q1", ("d0",))
    mined, stats = mine_hard_negatives([ex], fake_retrieve({"q1": ranked}), list(CORPUS),
                                       MiningConfig(rank_start=1, rank_end=4, margin=0.5))
    assert mined[0].negatives == ["d2", "d3"] and stats.dropped_margin == 1
    mined, stats = mine_hard_negatives([ex], fake_retrieve({"q1": ranked}), list(CORPUS),
                                       MiningConfig(rank_start=1, rank_end=4, max_ratio=0.8))
    assert mined[0].negatives == ["d3"] and stats.dropped_margin == 2


def test_positive_score_from_score_docs_or_counted_unknown():
    ranked = [("d1", 0.9), ("d2", 0.5), ("d3", 0.2)]
    ex = TrainExample("q", "q1", ("d0",))  # positive not retrieved
    cfg = MiningConfig(rank_start=1, rank_end=3, margin=0.0)
    mined, stats = mine_hard_negatives([ex], fake_retrieve({"q1": ranked}), list(CORPUS), cfg)
    assert mined[0].negatives == ["d1", "d2", "d3"] and stats.positive_score_unknown == 1
    mined, stats = mine_hard_negatives([ex], fake_retrieve({"q1": ranked}), list(CORPUS), cfg,
                                       score_docs=lambda qs, ids: [[0.6] for _ in qs])
    assert mined[0].negatives == ["d2", "d3"] and stats.positive_score_unknown == 0


def test_random_negatives_avoid_positives_and_are_seeded():
    ranked = [(f"d{i}", 1.0 / (i + 1)) for i in range(5)]
    ex = TrainExample("q", "q1", ("d0", "d7"))
    cfg = MiningConfig(rank_start=2, rank_end=5, num_negatives=2, num_random=5, seed=1)
    a, stats = mine_hard_negatives([ex], fake_retrieve({"q1": ranked}), list(CORPUS), cfg)
    b, _ = mine_hard_negatives([ex], fake_retrieve({"q1": ranked}), list(CORPUS), cfg)
    assert a[0].negatives == b[0].negatives
    assert len(a[0].negatives) == 7 and len(set(a[0].negatives)) == 7
    assert not {"d0", "d7"} & set(a[0].negatives)
    assert a[0].sources == ["hard"] * 2 + ["random"] * 5 and a[0].ranks[2:] == [None] * 5
    assert stats.random_negatives == 5


def test_files_round_trip_and_feed_the_training_reader(tmp_path):
    ranked = [(f"d{i}", 1.0 - i / 10) for i in range(6)]
    exs = [TrainExample("q1", "first", ("d0",)), TrainExample("q2", "second", ("d1",))]
    mined, stats = mine_hard_negatives(exs, fake_retrieve({"first": ranked, "second": ranked}), list(CORPUS),
                                       MiningConfig(rank_start=2, rank_end=6, num_negatives=3))
    path = str(tmp_path / "neg.jsonl")
    write_mined(path, mined, {"retriever": "fake", "stats": stats.as_dict()})
    assert json.load(open(path + ".meta.json"))["retriever"] == "fake"
    assert read_mined_negatives(path) == {m.query_id: m.negatives for m in mined}
    data = read_jsonl_training(path, corpus=CORPUS)
    assert [(e.query_id, e.positives, e.negatives) for e in data.examples] == [
        (m.query_id, tuple(m.positives), tuple(m.negatives)) for m in mined]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query_id": "q1"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected fields 'query_id'"):
        read_mined_negatives(str(bad))


@pytest.mark.parametrize("line, message", [
    ('{"query_id": null, "neg_ids": ["d1"]}', "expected fields 'query_id' (string) and 'neg_ids' (list)"),
    ('{"query_id": 1.5, "neg_ids": ["d1"]}', "field 'query_id' must be a string (or an integer), got 1.5"),
    ('{"query_id": true, "neg_ids": ["d1"]}', "field 'query_id' must be a string (or an integer), got true"),
    ('{"query_id": "q1", "neg_ids": ["d1", null]}', "field 'neg_ids' must hold document ids, strings (or integers); "
                                                     "item 2 is null"),
    ('{"query_id": "q1", "neg_ids": [5.0]}', "item 1 is 5.0"),
    ('{"query_id": "q1", "neg_ids": [["d1"]]}', 'item 1 is ["d1"]'),
])
def test_mined_ids_that_are_not_ids_are_refused_by_line_and_field(tmp_path, line, message):
    """A null or a float id became the id "None" or "5.0" (str()), which matched nothing, or a document so named."""
    path = tmp_path / "neg.jsonl"
    path.write_text('{"query_id": "q0", "neg_ids": []}\n' + line + "\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: ")) as err:
        read_mined_negatives(str(path))
    assert message in str(err.value)


def test_integer_ids_are_read_as_the_corpus_reads_an_integer_id(tmp_path):
    path = tmp_path / "neg.jsonl"
    path.write_text('{"query_id": 7, "neg_ids": [12, "d3"]}\n')
    assert read_mined_negatives(str(path)) == {"7": ["12", "d3"]}


def test_bm25_retriever_ranks_lexical_match_first():
    corpus = {"a": "green tea leaves are dried", "b": "cars drive on roads", "c": "black tea with milk"}
    hits = bm25_retriever(corpus)(["green tea", "roads"], 2)
    assert hits[0][0][0] == "a" and {d for d, _ in hits[0]} == {"a", "c"}
    assert [d for d, _ in hits[1]] == ["b"]


class _FixedDual:
    """A dual encoder stand-in whose vectors are given: texts are looked up, not encoded."""

    def __init__(self, vectors: dict[str, np.ndarray]) -> None:
        self.vectors = vectors

    def encode_documents(self, texts, batch_size=64, progress=False):
        return np.stack([self.vectors[t] for t in texts]).astype(np.float32)

    encode_queries = encode_documents


def test_dense_retriever_is_exact_inner_product_search():
    rng = np.random.default_rng(3)
    corpus = {f"d{i}": f"text {i}" for i in range(12)}
    vecs = {t: rng.normal(size=6) for t in [*corpus.values(), "q0", "q1"]}
    vecs["text 5"] = vecs["text 2"]  # a tie: ordered by doc id
    dual = _FixedDual(vecs)
    retriever = DenseRetriever(dual, corpus)
    doc_matrix = np.stack([vecs[t] for t in corpus.values()])  # (12, 6)
    for q, hits in zip(["q0", "q1"], retriever(["q0", "q1"], 5)):
        exact = doc_matrix @ vecs[q]  # (12,)
        want = sorted(range(12), key=lambda j: (-exact[j], f"d{j}"))[:5]
        assert [d for d, _ in hits] == [f"d{j}" for j in want]
        assert [s for _, s in hits] == pytest.approx(exact[want].tolist(), abs=1e-5)
    tied = [d for d, _ in retriever(["text 2"], 12)[0]]
    assert tied[:2] == ["d2", "d5"]
    assert len(retriever(["q0"], 50)[0]) == 12  # k beyond the corpus: every document once, no padding
    scores = retriever.score_docs(["q0", "q1"], [["d3", "missing", "d0"], []])
    assert scores[0] == pytest.approx([doc_matrix[3] @ vecs["q0"], doc_matrix[0] @ vecs["q0"]], abs=1e-5)
    assert scores[1] == []
    same = DenseRetriever.from_vectors(dual, list(corpus), doc_matrix)
    assert same(["q1"], 4) == retriever(["q1"], 4)


def test_config_validation():
    with pytest.raises(ValueError, match="rank window"):
        MiningConfig(rank_start=0)
    with pytest.raises(ValueError, match="rank window"):
        MiningConfig(rank_start=50, rank_end=10)
