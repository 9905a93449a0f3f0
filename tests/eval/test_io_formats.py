"""Readers and writers on small synthetic files: round trips and errors that name path and line."""

from __future__ import annotations

import gzip
import json
import re

import pytest

from twotower.eval import DataError
from twotower.eval.io import (
    BeirDocument,
    LabeledExample,
    TaggedSentence,
    detect_qrels_format,
    iter_msmarco_triples,
    load_beir,
    read_beir_corpus,
    read_beir_qrels,
    read_beir_queries,
    read_classification_tsv,
    read_conll,
    read_id_text_tsv,
    read_msmarco_run,
    read_qrels,
    read_squad,
    read_squad_predictions,
    read_trec_qrels,
    read_trec_run,
    squad_references,
    write_beir_corpus,
    write_beir_qrels,
    write_beir_queries,
    write_classification_tsv,
    write_conll,
    write_msmarco_run,
    write_squad_predictions,
    write_trec_qrels,
    write_trec_run,
)


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def _raises_at(path, line, func, match=""):
    with pytest.raises(DataError, match=match) as info:
        func(path)
    assert str(info.value).startswith(f"{path}:{line}: " if line else f"{path}: ")
    assert info.value.line == line
    return info.value


# --- TREC -------------------------------------------------------------------------------------------


def test_trec_run_round_trip_in_trec_eval_order(tmp_path):
    run = {"q1": {"a": 1.0, "c": 1.0, "b": 2.5}, "q2": {"x": -0.1}}
    path = tmp_path / "run.trec"
    write_trec_run(run, path, tag="mine")
    lines = path.read_text().splitlines()
    assert lines[:3] == ["q1 Q0 b 1 2.5 mine", "q1 Q0 c 2 1.0 mine", "q1 Q0 a 3 1.0 mine"]
    assert read_trec_run(path) == run
    write_trec_run(run, path, max_rank=1)
    assert read_trec_run(path) == {"q1": {"b": 2.5}, "q2": {"x": -0.1}}


def test_trec_run_errors(tmp_path):
    bad = _write(tmp_path / "bad.trec", "q1 Q0 a 1 2.0 t\n\nq1 Q0 b 2 1.0\n")
    _raises_at(bad, 3, read_trec_run, "expected 6 columns")
    bad = _write(tmp_path / "score.trec", "q1 Q0 a 1 high t\n")
    _raises_at(bad, 1, read_trec_run, "score must be a number")
    bad = _write(tmp_path / "dup.trec", "q1 Q0 a 1 2 t\nq1 Q0 a 2 1 t\n")
    _raises_at(bad, 2, read_trec_run, "appears twice")
    bad = _write(tmp_path / "nan.trec", "q1 Q0 a 1 nan t\n")
    _raises_at(bad, 1, read_trec_run, "NaN")
    with pytest.raises(ValueError, match="whitespace"):
        write_trec_run({"q 1": {"a": 1.0}}, tmp_path / "x.trec")
    with pytest.raises(FileNotFoundError, match="missing.trec"):
        read_trec_run(tmp_path / "missing.trec")


def test_trec_qrels_round_trip_and_errors(tmp_path):
    qrels = {"q1": {"a": 2, "b": 0, "c": -1}, "q2": {"d": 1}}
    path = tmp_path / "qrels.trec"
    write_trec_qrels(qrels, path)
    assert path.read_text().splitlines()[0] == "q1 0 a 2"
    assert read_trec_qrels(path) == qrels
    _raises_at(_write(tmp_path / "b1", "q1 0 a 1\nq1 0 b\n"), 2, read_trec_qrels, "expected 4 columns")
    _raises_at(_write(tmp_path / "b2", "q1 0 a 1.5\n"), 1, read_trec_qrels, "relevance must be an integer")
    _raises_at(_write(tmp_path / "b3", "q1 0 a 1\nq1 0 a 0\n"), 2, read_trec_qrels, "judged twice")
    # a header, which TREC qrels do not have, was reported as a bad grade and nothing more
    _raises_at(_write(tmp_path / "b4", "qid iter docid rel\nq1 0 a 1\n"), 1, read_trec_qrels,
               re.escape("relevance must be an integer, got 'rel' (a header line? TREC qrels have none"))
    with pytest.raises(DataError) as info:  # a number that is no integer is no header
        read_trec_qrels(_write(tmp_path / "b5", "q1 0 a 1.5\n"))
    assert "header" not in str(info.value)


def test_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.trec"
    path.write_bytes(b"q1 Q0 a 1 1.0 t\nq1 Q0 caf\xe9 2 0.5 t\n")
    _raises_at(path, 2, read_trec_run, "UTF-8")


# --- BEIR and qrels detection --------------------------------------------------------------------


def _beir_dir(tmp_path):
    root = tmp_path / "beir"
    write_beir_corpus(
        [BeirDocument("d1", "T", "text one"), BeirDocument("d2", "", "text two")], root / "corpus.jsonl"
    )
    write_beir_queries({"q1": "first?", "q2": "second?", "q3": "third?"}, root / "queries.jsonl")
    write_beir_qrels({"q1": {"d1": 1}, "q2": {"d2": 2, "d1": 0}}, root / "qrels" / "test.tsv")
    return root


def test_beir_round_trip(tmp_path):
    root = _beir_dir(tmp_path)
    assert (root / "qrels" / "test.tsv").read_text().splitlines()[0] == "query-id\tcorpus-id\tscore"
    data = load_beir(root, "test")
    assert data.corpus["d1"] == BeirDocument("d1", "T", "text one")
    assert data.qrels == {"q1": {"d1": 1}, "q2": {"d2": 2, "d1": 0}}
    assert data.split_queries() == {"q1": "first?", "q2": "second?"}
    assert load_beir(root, "test", corpus=False).corpus == {}


def test_beir_errors(tmp_path):
    root = _beir_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"splits found: test"):
        load_beir(root, "dev")
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_beir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"c0.jsonl: not a BEIR directory \(a file; give the folder holding"):
        load_beir(_write(tmp_path / "c0.jsonl", '{"_id": "a", "text": "x"}\n'))  # it said "no such folder"
    corpus = _write(tmp_path / "c.jsonl", '{"_id": "a", "text": "x"}\n{"_id": "b", "text": 3}\n')
    _raises_at(corpus, 2, read_beir_corpus, r"missing string field 'text' \(got int\)")
    corpus = _write(tmp_path / "c2.jsonl", '{"_id": "a", "text": "x"}\n{"_id": "a", "text": "y"}\n')
    _raises_at(corpus, 2, read_beir_corpus, "appears twice")
    queries = _write(tmp_path / "q.jsonl", '{"_id": "a", "text": "x"}\n{"_id": "b", "text": "y"\n')
    _raises_at(queries, 2, read_beir_queries, "not valid JSON")
    queries = _write(tmp_path / "q2.jsonl", '{"text": "x"}\n')
    _raises_at(queries, 1, read_beir_queries, "missing field '_id'")
    qrels = _write(tmp_path / "qr.tsv", "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\n")
    _raises_at(qrels, 3, read_beir_qrels, "expected 3 columns")
    qrels = _write(tmp_path / "qr2.tsv", "query-id\tcorpus-id\tscore\nq1\td1\tyes\n")
    _raises_at(qrels, 2, read_beir_qrels, "score must be an integer")
    (root / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq9\td1\t1\n")
    with pytest.raises(DataError, match="not in queries.jsonl"):
        load_beir(root, "test")


def test_beir_numeric_ids_become_strings(tmp_path):
    path = _write(tmp_path / "c.jsonl", '{"_id": 7, "title": null, "text": "x", "metadata": {}}\n')
    assert read_beir_corpus(path) == {"7": BeirDocument("7", "", "x")}


def test_qrels_format_is_detected(tmp_path):
    beir = _write(tmp_path / "a.tsv", "query-id\tcorpus-id\tscore\n1\t10\t1\n")
    headerless = _write(tmp_path / "b.tsv", "\n1\t10\t2\n")
    trec = _write(tmp_path / "c.trec", "1 0 10 1\n")
    assert [detect_qrels_format(p) for p in (beir, headerless, trec)] == ["beir", "beir", "trec"]
    assert read_qrels(beir) == {"1": {"10": 1}}
    assert read_qrels(headerless) == {"1": {"10": 2}}
    assert read_qrels(trec) == {"1": {"10": 1}}
    _raises_at(_write(tmp_path / "d", "1 0 10 1 x\n"), 1, read_qrels, "cannot tell the qrels format")
    _raises_at(_write(tmp_path / "e", "\n\n"), None, read_qrels, "empty")


# --- MS MARCO --------------------------------------------------------------------------------------


def test_msmarco(tmp_path):
    collection = _write(tmp_path / "collection.tsv", "0\tThe first passage.\n1\tSecond one.\n")
    assert read_id_text_tsv(collection) == {"0": "The first passage.", "1": "Second one."}
    _raises_at(_write(tmp_path / "c2.tsv", "0\ta\n1 b\n"), 2, read_id_text_tsv, "expected 2")
    # a header line is skipped (it was searched as the query "text" with the id "qid"); only a first line is one
    headed = _write(tmp_path / "q.tsv", "qid\ttext\nq1\tdoes tea cure colds\nid\tquery\n")
    assert read_id_text_tsv(headed) == {"q1": "does tea cure colds", "id": "query"}
    assert read_id_text_tsv(_write(tmp_path / "q2.tsv", "qid\tdoes tea cure colds\n")) == {"qid": "does tea cure colds"}
    run_path = _write(tmp_path / "run.tsv", "q1\t7\t1\nq1\t3\t2\nq2\t3\t1\n")
    run = read_msmarco_run(run_path)
    assert run == {"q1": {"7": -1.0, "3": -2.0}, "q2": {"3": -1.0}}
    write_msmarco_run(run, tmp_path / "out.tsv")
    assert (tmp_path / "out.tsv").read_text() == run_path.read_text()
    _raises_at(_write(tmp_path / "r2.tsv", "q1\t7\t0\n"), 1, read_msmarco_run, "rank must be >= 1")
    triples = _write(tmp_path / "t.tsv", "q\tpos\tneg\nq\tpos\n")
    with pytest.raises(DataError, match=r"t.tsv:2: expected 3"):
        list(iter_msmarco_triples(triples))


# --- SQuAD -----------------------------------------------------------------------------------------


def _squad(tmp_path, qas, name="squad.json"):
    data = {"data": [{"title": "T", "paragraphs": [{"context": "Paris is in France.", "qas": qas}]}]}
    return _write(tmp_path / name, json.dumps(data))


def test_squad_read_and_predictions(tmp_path):
    path = _squad(
        tmp_path,
        [
            {"id": "a", "question": "Where?", "answers": [{"text": "France", "answer_start": 12}]},
            {"id": "b", "question": "Moon?", "answers": [], "is_impossible": True},
        ],
    )
    examples = read_squad(path, check_offsets=True)
    assert [(e.id, e.answers, e.is_impossible) for e in examples] == [
        ("a", ["France"], False),
        ("b", [], True),
    ]
    assert squad_references(examples) == {"a": ["France"], "b": []}
    write_squad_predictions({"a": "France", "b": ""}, tmp_path / "pred.json")
    assert read_squad_predictions(tmp_path / "pred.json") == {"a": "France", "b": ""}


def test_squad_errors_name_the_json_path(tmp_path):
    path = _squad(tmp_path, [{"question": "Where?", "answers": []}])
    with pytest.raises(DataError, match=r"data\[0\]\.paragraphs\[0\]\.qas\[0\]: missing 'id'"):
        read_squad(path)
    path = _squad(
        tmp_path, [{"id": "a", "question": "W?", "answers": [{"text": "Spain", "answer_start": 12}]}]
    )
    assert read_squad(path)[0].answers == ["Spain"]
    with pytest.raises(DataError, match="not at offset 12"):
        read_squad(path, check_offsets=True)
    path = _squad(tmp_path, [{"id": "a", "question": "W?", "answers": [{"text": "x", "answer_start": "1"}]}])
    with pytest.raises(DataError, match="answer_start: expected int"):
        read_squad(path)
    broken = _write(tmp_path / "broken.json", '{"data": [\n  {"title": }\n]}')
    _raises_at(broken, 2, read_squad, "not valid JSON")
    dup = _squad(tmp_path, [{"id": "a", "question": "?", "answers": []}] * 2, "dup.json")
    with pytest.raises(DataError, match="appears twice"):
        read_squad(dup)


# --- CoNLL -----------------------------------------------------------------------------------------


def test_conll_round_trip_and_breaks(tmp_path):
    path = _write(
        tmp_path / "tags.conll",
        "-DOCSTART-\tO\n\nEU\tB-ORG\nrejects\tO\n\t\nGerman\tB-MISC\ncall\tO\n\n\n",
    )
    sentences = read_conll(path)
    assert sentences == [
        TaggedSentence(["EU", "rejects"], ["B-ORG", "O"]),
        TaggedSentence(["German", "call"], ["B-MISC", "O"]),
    ]
    write_conll(sentences, tmp_path / "out.conll")
    assert read_conll(tmp_path / "out.conll") == sentences
    four = _write(tmp_path / "four.txt", "EU NNP B-NP B-ORG\nrejects VBZ B-VP O\n")
    assert read_conll(four) == [TaggedSentence(["EU", "rejects"], ["B-ORG", "O"])]
    assert read_conll(four, tag_column=2)[0].tags == ["B-NP", "B-VP"]


def test_conll_errors(tmp_path):
    _raises_at(_write(tmp_path / "a", "EU\tB-ORG\nrejects\n"), 2, read_conll, "single column")
    _raises_at(_write(tmp_path / "b", "EU\tB-ORG\n"), 1, lambda p: read_conll(p, tag_column=5), "no column 5")
    with pytest.raises(ValueError, match="2 tokens but 1 tags"):
        write_conll([TaggedSentence(["a", "b"], ["O"])], tmp_path / "c")


# --- classification TSV ----------------------------------------------------------------------------


def test_classification_tsv(tmp_path):
    path = _write(tmp_path / "sst.tsv", 'sentence\tlabel\nit \'s "fine" \t1\nbad\t0\n')
    assert read_classification_tsv(path) == [
        LabeledExample('it \'s "fine" ', "1"),
        LabeledExample("bad", "0"),
    ]
    qc = _write(tmp_path / "qc.tsv", "label_coarse\tlabel_fine\ttext\nNUM\tNUM:dist\tHow far ?\n")
    with pytest.raises(DataError, match="cannot choose the label column"):
        read_classification_tsv(qc)
    assert read_classification_tsv(qc, label_column="label_fine") == [LabeledExample("How far ?", "NUM:dist")]
    pairs = [LabeledExample("a", "yes", "b"), LabeledExample("c", "no", "d")]
    write_classification_tsv(pairs, tmp_path / "pairs.tsv")
    assert read_classification_tsv(tmp_path / "pairs.tsv") == pairs


def test_classification_tsv_errors(tmp_path):
    _raises_at(
        _write(tmp_path / "a.tsv", "sentence\tlabel\nok\t1\ntoo\tmany\tcols\n"),
        3,
        read_classification_tsv,
        "expected 2",
    )
    _raises_at(
        _write(tmp_path / "b.tsv", "sentence\tlabel\nok\t \n"), 2, read_classification_tsv, "empty label"
    )
    _raises_at(
        _write(tmp_path / "c.tsv", "foo\tlabel\nok\t1\n"), 1, read_classification_tsv, "no text column"
    )
    _raises_at(_write(tmp_path / "d.tsv", ""), None, read_classification_tsv, "empty")
    with pytest.raises(DataError, match="no label column 'nope'"):
        read_classification_tsv(tmp_path / "a.tsv", label_column="nope")


# --- one corpus-line parser for evaluation and index builds ---------------------------------------

CORPUS_LINES = [
    ('{"_id": "a", "title": "T", "text": "body", "metadata": {"year": 2001}, "extra": 1}', None),
    ('{"id": 12, "text": "integer id under the id key"}', None),
    ('{"_id": "t", "title": "title only", "text": ""}', None),
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected a JSON object, got list"),
    ('{"text": "no id"}', "missing field '_id'"),
    ('{"_id": "", "text": "t"}', "field '_id' must be a non-empty string"),
    ('{"_id": "x"}', "missing string field 'text'"),
    ('{"_id": "x", "text": 3}', "missing string field 'text' (got int)"),
    ('{"_id": "x", "text": "t", "title": 5}', "field 'title' must be a string, got int"),
    ('{"_id": "x", "text": "t", "metadata": [1]}', "field 'metadata' must be an object, got list"),
    ('{"_id": "x", "text": "t", "metadata": {"lang": "en"}, "lang": "de"}',
     "field 'lang' is both a top-level field and a key of 'metadata'"),
]


@pytest.mark.parametrize("line, message", CORPUS_LINES)
def test_eval_and_index_builds_read_a_corpus_line_alike(tmp_path, line, message):
    """read_beir_corpus (evaluation) and retrieval.corpus.iter_documents (index builds) share one parser."""
    from twotower.retrieval.corpus import iter_documents

    path = _write(tmp_path / "corpus.jsonl", '{"_id": "first", "text": "ok"}\n\n' + line + "\n")
    if message is None:
        (_, beir), (_, doc) = list(read_beir_corpus(path).items())[1], list(iter_documents(str(path)))[1]
        assert (doc["id"], doc["title"], doc["text"], doc["metadata"]) == (
            beir.doc_id, beir.title, beir.text, dict(beir.metadata))
        return
    errors = []
    for read in (read_beir_corpus, lambda p: list(iter_documents(str(p)))):
        with pytest.raises(DataError) as info:
            read(path)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and errors[0].startswith(f"{path}:3: ") and message in errors[0]


def test_extra_top_level_fields_are_metadata(tmp_path):
    path = _write(tmp_path / "corpus.jsonl",
                  '{"_id": "a", "id": "kept", "text": "t", "lang": "en", "metadata": {"year": 2001}}\n')
    # beside `_id`, `id` is metadata too (it was dropped); alone, it is the id
    assert read_beir_corpus(path)["a"].metadata == {"year": 2001, "lang": "en", "id": "kept"}


def test_an_empty_document_is_kept_for_evaluation_and_refused_by_an_index(tmp_path):
    """Benchmark corpora hold documents with blank text and title (Cranfield has two): eval keeps them."""
    from twotower.retrieval.corpus import iter_documents

    path = _write(tmp_path / "corpus.jsonl", '{"_id": "a", "text": "ok"}\n{"_id": "x", "text": " ", "title": ""}\n')
    assert read_beir_corpus(path)["x"] == BeirDocument("x", "", " ")
    with pytest.raises(DataError, match="document 'x' has empty 'text' and 'title'") as info:
        list(iter_documents(str(path)))
    assert str(info.value).startswith(f"{path}:2: ")


def test_beir_corpus_keeps_metadata_and_reads_gzip(tmp_path):
    docs = [BeirDocument("a", "T", "x", {"year": 2001}), BeirDocument("b", "", "y")]
    write_beir_corpus(docs, tmp_path / "corpus.jsonl")
    assert list(read_beir_corpus(tmp_path / "corpus.jsonl").values()) == docs
    packed = tmp_path / "corpus.jsonl.gz"
    with gzip.open(packed, "wb") as f:
        f.write((tmp_path / "corpus.jsonl").read_bytes())
    assert list(read_beir_corpus(packed).values()) == docs
