"""Training-data readers: BEIR, {query, pos, neg} JSONL, labeled pairs; counted skips and located errors."""

from __future__ import annotations

import json
import os
import random
import re

import pytest

from twotower.retrieval.training.training_data import (
    read_beir_training,
    read_jsonl_training,
    read_labeled_pairs,
    read_training,
    split_dev,
    text_id,
    training_from_pairs,
)


def _write(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("".join(lines))
    return str(path)


@pytest.fixture
def beir(tmp_path):
    root = tmp_path / "beir"
    (root / "qrels").mkdir(parents=True)
    _write(root / "corpus.jsonl", [json.dumps({"_id": f"d{i}", "title": f"T{i}", "text": f"text {i}"}) + "\n"
                                   for i in range(5)])
    _write(root / "queries.jsonl", [json.dumps({"_id": f"q{i}", "text": f"query {i}"}) + "\n" for i in range(4)])
    _write(root / "qrels" / "train.tsv", [
        "query-id\tcorpus-id\tscore\n",
        "q0\td0\t1\n", "q0\td1\t0\n",      # one positive, one judged negative
        "q1\td2\t2\n", "q1\td9\t1\n",      # d9 missing from the corpus
        "q2\td3\t0\n",                      # no positive
        "q3\td9\t1\n",                      # its only positive is missing
    ])
    return str(root)


def test_beir_reader_counts_every_skip(beir):
    data = read_beir_training(beir, "train")
    assert [(e.query_id, e.positives, e.negatives) for e in data.examples] == [
        ("q0", ("d0",), ("d1",)), ("q1", ("d2",), ())]
    assert data.corpus["d0"] == "T0 text 0"
    assert data.skipped.as_dict() == {"judged documents missing from the corpus": 2,
                                      "queries with no positive in the corpus": 2}
    assert "q1:d9" in data.skipped.summary()
    with pytest.raises(FileNotFoundError, match="splits found: train"):
        read_beir_training(beir, "dev")


def test_jsonl_texts_and_ids(tmp_path, beir):
    path = _write(tmp_path / "t.jsonl", [
        json.dumps({"query": "what is tea", "pos": ["Tea is a drink."], "neg": ["Cars are fast."]}) + "\n",
        "\n",
        json.dumps({"query": "what is tea", "pos": ["Tea is a drink."]}) + "\n",  # duplicate pair, merged
        json.dumps({"query": "no answer", "pos": [], "neg": ["x"]}) + "\n",
    ])
    data = read_jsonl_training(path)
    assert len(data.examples) == 1
    ex = data.examples[0]
    assert ex.positives == (text_id("Tea is a drink."),) and data.corpus[ex.negatives[0]] == "Cars are fast."
    assert data.skipped.as_dict() == {"duplicate pairs": 1, "queries with no positive": 1}
    # ids resolved against a corpus; an unknown id is a counted skip
    ids = _write(tmp_path / "ids.jsonl", [json.dumps({"query": "q", "pos": ["d1"], "neg_ids": ["d2", "zz"]}) + "\n"])
    data = read_training(ids, corpus_path=os.path.join(beir, "corpus.jsonl"))
    assert data.examples[0].positives == ("d1",) and data.examples[0].negatives == ("d2",)
    assert data.skipped.as_dict() == {"negative ids missing from the corpus": 1}


def test_jsonl_errors_name_file_and_line(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        read_jsonl_training(_write(tmp_path / "e.jsonl", ["\n"]))
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_jsonl_training(_write(tmp_path / "bad.jsonl", [json.dumps({"query": "a", "pos": ["b"]}) + "\n", "{oops\n"]))
    with pytest.raises(ValueError, match=r"nq.jsonl:1: missing field 'query'"):
        read_jsonl_training(_write(tmp_path / "nq.jsonl", [json.dumps({"pos": ["b"]}) + "\n"]))
    with pytest.raises(ValueError, match=r"lst.jsonl:1: field 'pos' must be a list"):
        read_jsonl_training(_write(tmp_path / "lst.jsonl", [json.dumps({"query": "a", "pos": [1.5]}) + "\n"]))
    with pytest.raises(ValueError, match=r"tf.jsonl:1: field 'neg' must be a list of strings"):  # was the id "True"
        read_jsonl_training(_write(tmp_path / "tf.jsonl", [json.dumps({"query": "a", "pos": ["b"], "neg": [True]}) + "\n"]))
    with pytest.raises(ValueError, match="no usable training query"):
        read_jsonl_training(_write(tmp_path / "none.jsonl", [json.dumps({"query": "a", "pos": []}) + "\n"]))


def test_labeled_pairs_tsv_graded(tmp_path):
    path = _write(tmp_path / "p.tsv", [
        "query\tpassage\tlabel\n", "tea\tTea is a drink\t2\n", "tea\tCars\t0\n", "tea\tGreen tea\t1\n",
        "tea\tCars\t0\n",  # duplicate, same label
        "cars\tCars\t0\n",  # a query with no positive: skipped, named by its first line
    ])
    data = read_labeled_pairs(path)
    assert [p.label for p in data.pairs] == [2, 0, 1, 0] and data.max_label == 2
    assert data.skipped.as_dict() == {"duplicate pairs": 1}
    grouped = training_from_pairs(data)
    assert grouped.skipped.where["queries with no positive"] == [f"{path}:6"]
    ex = grouped.examples[0]
    assert [grouped.corpus[d] for d in ex.positives] == ["Tea is a drink", "Green tea"]  # best grade first
    assert [grouped.corpus[d] for d in ex.negatives] == ["Cars"]


@pytest.mark.parametrize("rows, message", [
    (["a\tb\t-1\n"], r"x.tsv:1: label '-1' is out of range"),
    (["a\tb\tyes\n"], r"x.tsv:1: label 'yes' is not a number"),
    (["a\tb\t1\n", "a\tc\t2.5\n"], r"x.tsv:2: graded label 2.5 must be an integer"),
    (["a\tb\n"], r"x.tsv:1: expected 3 tab-separated columns"),
    (["a\tb\t1\n", "a\tb\t0\n"], r"x.tsv:2: pair repeats line 1 with a different label"),
    ([], "pairs file is empty"),
])
def test_labeled_pairs_errors(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        read_labeled_pairs(_write(tmp_path / "x.tsv", rows))


@pytest.mark.parametrize("label", ["1e308", "101", "nan", "inf", "-inf", "-0.5"])
def test_labels_outside_the_documented_range_are_refused_by_line(tmp_path, label):
    """1e308 was read as a grade and scaled every other label to about 0, the target of a negative."""
    rows = ["query\tpassage\tlabel\n", "a\tb\t1\n", f"a\tc\t{label}\n"]
    with pytest.raises(ValueError, match=re.escape(f"x.tsv:3: label {label!r} is out of range (labels are 0/1 or "
                                                   "integer grades from 0 to 100)")):
        read_labeled_pairs(_write(tmp_path / "x.tsv", rows))


@pytest.mark.parametrize("label, message", [
    ("1e308", "label 1e+308 is out of range (labels are 0/1 or integer grades from 0 to 100)"),
    ("true", "label true is not a number"),  # float(True) made it 1
    ("null", "label null is not a number"),
    ('"x"', "label 'x' is not a number"),
])
def test_jsonl_labels_outside_the_documented_range_are_refused_by_line(tmp_path, label, message):
    path = _write(tmp_path / "p.jsonl", ['{"query": "q", "text": "d", "label": 1}\n',
                                         f'{{"query": "q", "text": "e", "label": {label}}}\n'])
    with pytest.raises(ValueError, match=re.escape(f"p.jsonl:2: {message}")):
        read_labeled_pairs(path)
    assert read_labeled_pairs(_write(tmp_path / "ok.jsonl", ['{"query": "q", "text": "d", "label": 100}\n'])).pairs


def test_cli_reranker_refuses_an_out_of_range_label_by_line(tmp_path, capsys):
    from tests.retrieval.training_fixtures import tiny_model_dir
    from twotower.cli import main

    pairs = _write(tmp_path / "pairs.tsv", ["what is tea\ttea is a drink\t1e308\n", "what is tea\tcars\t0\n"])
    rc = main(["train", "reranker", "--model", tiny_model_dir(), "--pairs", pairs, "--loss", "pointwise",
               "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and f"{pairs}:1: label '1e308' is out of range" in capsys.readouterr().err


@pytest.mark.parametrize("name, lines, message", [
    # a header in another order was read as a pair: "label 'passage' is not a number", nothing about the order
    ("h.tsv", ["label\tquery\tpassage\n", "1\ttea\ttea is a drink\n"],
     "h.tsv:1: label 'passage' is not a number; the columns are query, passage, label, and a header line ends in "
     "'label', 'score' or 'relevance'"),
    # columns swapped: the passage in the label column was quoted whole
    ("s.tsv", ["tea\t1\t" + "a passage of many words " * 20 + "\n"],
     "s.tsv:1: label 'a passage of many words a passage of many words a passage o... is not a number"),
    # the first record without 'label' made the file {query, pos, neg}: "no usable training query"
    ("n.jsonl", ['{"query": "tea", "passage": "tea is a drink"}\n', '{"query": "tea", "passage": "x", "label": 0}\n'],
     "n.jsonl:1: a labeled pair needs 'label' (the first record decides how the file is read"),
    # a .csv was refused as "expected a BEIR directory or a .jsonl(.gz) file of {query, pos, neg}"
    ("p.csv", ["tea,tea is a drink,1\n"],
     "p.csv: expected labeled pairs (a .tsv of query<TAB>passage<TAB>label, or a .jsonl of {query, passage, "
     "label}), a .jsonl of {query, pos, neg}, or a BEIR directory"),
])
def test_cli_reranker_says_what_a_pairs_file_got_wrong(tmp_path, capsys, name, lines, message):
    from tests.retrieval.training_fixtures import tiny_model_dir
    from twotower.cli import main

    pairs = _write(tmp_path / name, lines)
    rc = main(["train", "reranker", "--model", tiny_model_dir(), "--pairs", pairs, "--out", str(tmp_path / "o"),
               "--no-progress"])
    assert rc == 2 and message in capsys.readouterr().err


def test_cli_pointwise_on_labeled_pairs_refuses_negatives_it_would_not_use(tmp_path, capsys):
    from tests.retrieval.training_fixtures import tiny_model_dir
    from twotower.cli import main

    pairs = _write(tmp_path / "pairs.tsv", ["what is tea\ttea is a drink\t1\n", "what is tea\tcars\t0\n"])
    neg = _write(tmp_path / "neg.jsonl", ['{"query_id": "q", "neg_ids": ["d"]}\n'])
    rc = main(["train", "reranker", "--model", tiny_model_dir(), "--pairs", pairs, "--loss", "pointwise",
               "--negatives", neg, "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--negatives {neg}: --loss pointwise trains on the labeled pairs" in err, err
    assert not (tmp_path / "o").exists()


def test_labeled_pairs_tsv_is_read_as_every_text_file_is(tmp_path):
    """A spreadsheet's byte-order mark is not part of the first query (which used to split it from its own
    later lines and lose its positive); a bad byte names its line; a document-sized field is read whole."""
    rows = ["tea\tTea is a drink\t1\n", "tea\tCars\t0\n", "cars\tCars go fast\t1\n"]
    bom = tmp_path / "bom.tsv"
    bom.write_bytes(b"\xef\xbb\xbf" + "".join(rows).encode("utf-8"))
    grouped = training_from_pairs(read_labeled_pairs(str(bom)))
    assert [e.query for e in grouped.examples] == ["tea", "cars"] and not grouped.skipped
    assert [grouped.corpus[d] for d in grouped.examples[0].negatives] == ["Cars"]

    latin1 = tmp_path / "latin1.tsv"
    latin1.write_bytes("tea\tTea\t1\ncafe\tCaf\u00e9\t1\n".encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(f"{latin1}:2: not valid UTF-8")):
        read_labeled_pairs(str(latin1))

    long_doc = "word " * 40_000  # 200,000 characters: over csv's 131,072-character field limit
    path = _write(tmp_path / "long.tsv", [f"tea\t{long_doc}\t1\n"])
    assert read_labeled_pairs(path).corpus == {text_id(long_doc): long_doc}


def test_a_batch_larger_than_the_training_split_is_refused_naming_the_flag():
    from twotower.retrieval.training.training_data import check_batch_fits

    check_batch_fits("p.tsv", 4, 4, "labeled pairs")  # exactly one batch: fine
    with pytest.raises(ValueError, match=re.escape("--batch-size 8: the training split of p.tsv has 4 labeled pairs, "
                                                   "fewer than one batch needs; lower --batch-size (at most 4)")):
        check_batch_fits("p.tsv", 4, 8, "labeled pairs")
    with pytest.raises(ValueError, match=re.escape("--batch-size 4 on each of 2 ranks: the training split of d has 6 "
                                                   "(query, positive) pairs, fewer than one batch needs; lower "
                                                   "--batch-size (at most 3)")):
        check_batch_fits("d", 6, 4, "(query, positive) pairs", ranks=2)


@pytest.mark.parametrize("argv, message", [
    (["reranker", "--batch-size", "16"], "--batch-size 16: the training split of"),  # listwise: its batch stream used to wait for ever
    (["reranker", "--loss", "pointwise", "--batch-size", "64"], "--batch-size 64: the training split of"),
    (["dual"], "--batch-size 32: the training split of"),
])
def test_cli_refuses_a_batch_the_training_split_cannot_fill(tmp_path, capsys, argv, message):
    import signal

    from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
    from twotower.cli import main

    def hung(*_):
        raise AssertionError("training did not return")

    data = "--pairs" if argv[0] == "reranker" else "--data"
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        rc = main(["train", argv[0], "--model", tiny_model_dir(), data, tiny_beir_dir(n_queries=10), "--out",
                   str(tmp_path / "o"), "--max-steps", "1", "--no-progress", "--group-size" if argv[0] == "reranker"
                   else "--hard-negatives", "2", *argv[1:]])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert rc == 2 and message in capsys.readouterr().err


def test_a_set_too_small_for_dev_is_refused_naming_its_file_and_skips(tmp_path):
    """Two queries in the file, one without a positive: the split's error says where and why only one is left."""
    from types import SimpleNamespace

    from twotower.retrieval.training.training_data import carve_dev

    path = _write(tmp_path / "p.tsv", ["tea\tTea is a drink\t1\n", "cars\tCars\t0\n"])
    data = training_from_pairs(read_labeled_pairs(path))
    settings = SimpleNamespace(dev_fraction=0.1, dev_split_seed=0, dev_size=None, dev_by="query")
    with pytest.raises(ValueError, match=re.escape(f"{path}: need at least 2 distinct queries to carve a dev split, "
                                                   f"got 1 (skipped: 1 queries with no positive (e.g. {path}:2))")):
        carve_dev(data, settings)


def test_labeled_pairs_jsonl_and_max_label(tmp_path):
    path = _write(tmp_path / "p.jsonl", [json.dumps({"query": "q", "text": "d", "label": 3}) + "\n"])
    with pytest.raises(ValueError, match=r"p.jsonl:1: label 3 is out of range \(max_label=2\)"):
        read_labeled_pairs(path, max_label=2)
    assert read_labeled_pairs(path, max_label=3).pairs[0].label == 3


def test_dev_split_by_query_is_seeded_and_disjoint(beir):
    from twotower.retrieval.training.training_data import TrainExample

    examples = [TrainExample(f"q{i % 10}", f"query {i % 10}", (f"d{i}",)) for i in range(30)]
    train, dev = split_dev(examples, dev_fraction=0.2, seed=3)
    assert {e.query_id for e in train}.isdisjoint({e.query_id for e in dev})
    assert len({e.query_id for e in dev}) == 2 and len(dev) == 6  # all lines of a dev query go to dev
    assert split_dev(examples, 0.2, seed=3) == (train, dev)
    assert split_dev(examples, 0.2, seed=4)[1] != dev
    with pytest.raises(ValueError, match="at least 2 distinct queries"):
        split_dev(examples[:1])
    # the split every earlier run used: the first n of the seeded shuffle of the sorted query ids
    qids = sorted({e.query_id for e in examples})
    random.Random(3).shuffle(qids)
    assert {e.query_id for e in dev} == set(qids[:2])


def test_dev_split_by_document_keeps_every_positive_on_one_side():
    from twotower.retrieval.training.training_data import TrainExample

    rng = random.Random(0)
    # 60 queries over 40 documents: many share a positive, directly or through other queries
    examples = [TrainExample(f"q{i}", f"query {i}", tuple(f"d{rng.randrange(40)}" for _ in range(rng.choice([1, 2]))))
                for i in range(60)]
    by_query = split_dev(examples, dev_fraction=0.2, seed=1)
    train_pos = {d for e in by_query[0] for d in e.positives}
    assert any(d in train_pos for e in by_query[1] for d in e.positives)  # the leak this split removes
    for seed in range(5):
        train, dev = split_dev(examples, dev_fraction=0.2, seed=seed, by="document")
        train_pos = {d for e in train for d in e.positives}
        assert dev and all(d not in train_pos for e in dev for d in e.positives)
        assert 0 < len(dev) <= 12 and len(train) + len(dev) == 60
        assert split_dev(examples, dev_fraction=0.2, seed=seed, by="document") == (train, dev)
    one_group = [TrainExample(f"q{i}", "q", ("d0",)) for i in range(5)]
    with pytest.raises(ValueError, match="positives form one group; split by query instead"):
        split_dev(one_group, dev_size=2, by="document")
    with pytest.raises(ValueError, match="dev split by 'doc'"):
        split_dev(examples, by="doc")


def test_documents_with_blank_text_and_title_are_left_out_and_counted(beir, caplog):
    """Cranfield has two such documents: training stopped at the first. They are left out with a warning, and a
    judgment of one is a counted skip, as for any document missing from the corpus."""
    import logging

    path = os.path.join(beir, "corpus.jsonl")
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"_id": "d9", "title": " ", "text": ""}) + "\n")  # q1's and q3's judged d9
        f.write(json.dumps({"_id": "e2", "title": "", "text": "\t"}) + "\n")
    with caplog.at_level(logging.WARNING, logger="twotower.retrieval.training.training_data"):
        data = read_beir_training(beir, "train")
    assert "d9" not in data.corpus and "e2" not in data.corpus and len(data.corpus) == 5
    assert [(e.query_id, e.positives) for e in data.examples] == [("q0", ("d0",)), ("q1", ("d2",))]
    assert data.skipped.as_dict() == {"judged documents missing from the corpus": 2,
                                      "queries with no positive in the corpus": 2}
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{path}: 2 documents with blank text and title left out" in warning and "'d9', 'e2'" in warning


def test_under_torchrun_the_blank_documents_are_said_by_rank_0_alone(beir, caplog, monkeypatch):
    """Every rank reads the corpus: the warning came once per rank."""
    import logging

    with open(os.path.join(beir, "corpus.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"_id": "d9", "title": " ", "text": ""}) + "\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    said = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="twotower.retrieval.training.training_data"):
            read_beir_training(beir, "train")
        said.append(sum("blank text and title" in r.getMessage() for r in caplog.records))
    assert said == [1, 0]
