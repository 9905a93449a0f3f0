"""Negatives shared by both trainers: random fill-in, a mined file merged in, in-training mining's settings."""

from __future__ import annotations

import random

import pytest

from twotower.retrieval.training.mining import MinedQuery, write_mined
from twotower.retrieval.training.negatives import add_mined_negatives, mine_negatives, sample_negatives
from twotower.retrieval.training.training_data import Skipped, TrainExample
from twotower.retrieval.training.training_run import TrainingRun


def test_enough_hard_negatives_need_no_fill_in():
    ex = TrainExample("q", "query", ("p",), ("n1", "n2", "n3", "n4"))
    chosen, filled = sample_negatives(ex, 2, ["x", "y"], random.Random(0))
    assert filled == 0 and len(set(chosen)) == 2 and set(chosen) <= set(ex.negatives)
    # the same seed draws the same negatives
    assert sample_negatives(ex, 2, ["x", "y"], random.Random(0)) == (chosen, 0)


def test_short_of_hard_negatives_tops_up_with_distinct_non_positives():
    ex = TrainExample("q", "query", ("p1", "p2"), ("n1",))
    corpus = ["p1", "p2", "n1", "r1", "r2", "r3"]
    for seed in range(20):
        chosen, filled = sample_negatives(ex, 4, corpus, random.Random(seed))
        assert chosen[0] == "n1" and filled == 3
        assert sorted(chosen[1:]) == ["r1", "r2", "r3"]  # the only documents that are neither positive nor chosen


def _mined(query_id: str, negatives: list[str]) -> MinedQuery:
    n = len(negatives)
    return MinedQuery(query_id, "a query", ["p"], negatives, list(range(1, n + 1)), [1.0] * n, ["hard"] * n)


def test_mined_file_is_merged_and_ids_missing_from_the_corpus_are_counted(tmp_path):
    path = str(tmp_path / "neg.jsonl")
    write_mined(path, [_mined("q1", ["d2", "gone", "d1"]), _mined("q9", ["d4"])])
    skipped = Skipped()
    examples = [TrainExample("q1", "one", ("d1",), ("d3",)), TrainExample("q2", "two", ("d2",))]
    merged = add_mined_negatives(examples, path, {"d1": "a", "d2": "b", "d3": "c"}, skipped)
    # d2 appended after the query's own negative; a positive (d1) is never a negative; q2 has no mined line
    assert merged == [TrainExample("q1", "one", ("d1",), ("d3", "d2")), examples[1]]
    assert skipped.as_dict() == {"mined negatives missing from the corpus": 2}  # "gone" and q9's d4
    assert skipped.where["mined negatives missing from the corpus"] == [path]


def test_dense_mining_inside_training_needs_a_retriever(tmp_path):
    run = TrainingRun(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="mine='dense' needs a dense retriever"):
        mine_negatives([TrainExample("q", "query", ("d",))], {"d": "text"}, run, method="dense",
                       ranks=(1, 10), num_negatives=2, seed=0, progress=False)
    with pytest.raises(ValueError, match="mine='colbert'"):
        mine_negatives([TrainExample("q", "query", ("d",))], {"d": "text"}, run, method="colbert",
                       ranks=(1, 10), num_negatives=2, seed=0, progress=False)
