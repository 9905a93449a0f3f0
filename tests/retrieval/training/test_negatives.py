"""Negatives shared by both trainers: random fill-in, a mined file merged in, in-training mining's settings."""

from __future__ import annotations

import json
import os
import random

import pytest

from twotower.retrieval.training.mining import MinedQuery, write_mined
from twotower.retrieval.training.negatives import (
    add_mined_negatives,
    check_negatives_fit,
    mine_negatives,
    sample_negatives,
)
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


def test_a_corpus_too_small_for_the_group_is_refused_not_sampled_for_ever():
    """Two documents besides the positive cannot give three negatives: an error, where the loop used to spin."""
    import signal

    def hung(*_):
        raise AssertionError("sample_negatives did not return")

    ex = TrainExample("q", "what is tea", ("p",), ())
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)
    try:
        with pytest.raises(ValueError, match="query 'what is tea': 3 negatives are needed but the corpus has only 2"):
            sample_negatives(ex, 3, ["p", "a", "b"], random.Random(0))
        assert sorted(sample_negatives(ex, 2, ["p", "a", "b"], random.Random(0))[0]) == ["a", "b"]  # exactly enough
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    with pytest.raises(ValueError, match=r"--group-size 4: each query needs 3 negatives besides its positives, but "
                                         r"the corpus has 3 documents and the query 'what is tea' has 1 positive"):
        check_negatives_fit([ex], 3, 3, "--group-size", 4)
    check_negatives_fit([ex], 4, 3, "--group-size", 4)  # enough: no error


@pytest.mark.parametrize("argv, message", [
    (["reranker", "--group-size", "100"], "--group-size 100: each query needs 99 negatives"),
    (["dual", "--hard-negatives", "100", "--batch-size", "8"], "--hard-negatives 100: each query needs 100 negatives"),
])
def test_cli_refuses_groups_the_corpus_cannot_fill(tmp_path, capsys, argv, message):
    from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
    from twotower.cli import main

    data = "--pairs" if argv[0] == "reranker" else "--data"
    rc = main(["train", argv[0], "--model", tiny_model_dir(), data, tiny_beir_dir(), "--out", str(tmp_path / "o"),
               "--max-steps", "1", "--no-progress", *argv[1:]])
    assert rc == 2 and message in capsys.readouterr().err


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
    assert skipped.as_dict() == {"mined negatives missing from the corpus": 1,  # "gone"
                                 "mined negatives that are the query's positives": 1,  # d1
                                 "negatives-file lines whose query is no training query": 1}  # q9
    assert skipped.where["mined negatives missing from the corpus"] == [f"{path}:1"]
    assert skipped.where["negatives-file lines whose query is no training query"] == [f"{path}:2"]


def test_a_negatives_file_for_other_queries_is_refused(tmp_path):
    """Query ids that match no training query were read, merged into nothing and trained without a word."""
    path = str(tmp_path / "neg.jsonl")
    write_mined(path, [_mined("zz1", ["d1"]), _mined("zz2", ["d2"])])
    examples = [TrainExample("q1", "one", ("d1",)), TrainExample("q2", "two", ("d2",))]
    with pytest.raises(ValueError, match=r"neg.jsonl: the --negatives file has no line for a training query: its 2 "
                                         r"lines' query ids \(e.g. 'zz1'\) are not the training data's \(e.g. 'q1'\)"):
        add_mined_negatives(examples, path, {"d1": "a", "d2": "b"}, Skipped())
    # a line for a query held out of training (the reranker's dev split) is the data's: neither refused nor counted
    skipped = Skipped()
    write_mined(path, [_mined("q3", ["d1"])])
    assert add_mined_negatives(examples, path, {"d1": "a", "d2": "b"}, skipped, known={"q1", "q2", "q3"}) == examples
    assert not skipped


def _beir_negatives(path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_cli_refuses_a_negatives_file_mined_for_other_queries(tmp_path, capsys):
    from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
    from twotower.cli import main

    negatives = _beir_negatives(tmp_path / "neg.jsonl", [{"query_id": f"other{i}", "neg_ids": ["d1"]} for i in range(3)])
    rc = main(["train", "dual", "--model", tiny_model_dir(), "--data", tiny_beir_dir(), "--out", str(tmp_path / "o"),
               "--negatives", negatives, "--max-steps", "1", "--batch-size", "4", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{negatives}: the --negatives file has no line for a training query" in err
    assert "(e.g. 'other0')" in err and "(e.g. 'q0')" in err
    assert not os.path.isdir(tmp_path / "o" / "best")


def test_cli_reports_the_negatives_it_could_not_use(tmp_path, capsys, caplog):
    """Lines for unknown queries and negatives that are the query's positives were dropped without a count; a
    line for a dev query (held out of training, not unknown) is not counted."""
    from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
    from twotower.cli import main

    lines = [{"query_id": f"q{i}", "neg_ids": [f"d{i}", f"d{i + 30}"]} for i in range(24)]  # d{i}: q{i}'s positive
    negatives = _beir_negatives(tmp_path / "neg.jsonl", [*lines, {"query_id": "gone", "neg_ids": ["d1"]}])
    rc = main(["train", "reranker", "--model", tiny_model_dir(0.2), "--pairs", tiny_beir_dir(), "--out",
               str(tmp_path / "o"), "--negatives", negatives, "--max-steps", "1", "--batch-size", "2",
               "--group-size", "2", "--dev-size", "4", "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    skipped = json.loads(out.strip().splitlines()[-1])["skipped"]
    assert skipped == {"negatives-file lines whose query is no training query": 1,
                       "mined negatives that are the query's positives": 20}  # the 20 training queries'
    assert f"1 negatives-file lines whose query is no training query (e.g. {negatives}:25)" in caplog.text


def test_dense_mining_inside_training_needs_a_retriever(tmp_path):
    run = TrainingRun(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="mine='dense' needs a dense retriever"):
        mine_negatives([TrainExample("q", "query", ("d",))], {"d": "text"}, run, method="dense",
                       ranks=(1, 10), num_negatives=2, seed=0, progress=False)
    with pytest.raises(ValueError, match="mine='colbert'"):
        mine_negatives([TrainExample("q", "query", ("d",))], {"d": "text"}, run, method="colbert",
                       ranks=(1, 10), num_negatives=2, seed=0, progress=False)
