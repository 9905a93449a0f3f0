"""Corpus reading for index builds: chunking, duplicate policies and errors that name file and line."""

from __future__ import annotations

import gzip
import json

import pytest

from twotower.retrieval.corpus import iter_chunks, iter_documents, validate_corpus


def _write(tmp_path, lines: list[str], name: str = "corpus.jsonl") -> str:
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(p)


def _doc(i, text="some text", **kw) -> str:
    return json.dumps({"_id": i, "text": text, **kw})


def test_reads_documents_and_chunks_in_order(tmp_path):
    path = _write(tmp_path, [_doc(f"d{i}", f"text {i}", title=f"t{i}") for i in range(7)] + [""])
    docs = [d for _, d in iter_documents(path)]
    assert [d["id"] for d in docs] == [f"d{i}" for i in range(7)]
    assert docs[3] == {"id": "d3", "title": "t3", "text": "text 3", "metadata": {}}
    chunks = list(iter_chunks(path, 3))
    assert [len(c) for c in chunks] == [3, 3, 1]
    assert [d["id"] for c in chunks for d in c] == [f"d{i}" for i in range(7)]


def test_an_id_beside_the_id_is_metadata(tmp_path):
    path = _write(tmp_path, ['{"_id": "x", "id": "y", "text": "t"}', '{"_id": null, "id": 7, "text": "t"}'])
    assert [(d["id"], d["metadata"]) for _, d in iter_documents(path)] == [("x", {"id": "y"}), ("7", {})]


def test_gzip_corpus_and_integer_ids(tmp_path):
    p = tmp_path / "c.jsonl.gz"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"_id": 12, "text": "x"}) + "\n")
    assert [d["id"] for _, d in iter_documents(str(p))] == ["12"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"text": "no id"}', "missing field '_id'"),
        ('{"_id": "x"}', "missing string field 'text'"),
        ('{"_id": "x", "text": 3}', "missing string field 'text'"),
        ('{"_id": "", "text": "t"}', "non-empty string"),
        ('{"_id": "x", "text": "t", "title": 5}', "'title' must be a string"),
        ('{"_id": "x", "text": "  ", "title": ""}', "empty 'text' and 'title'"),
        # metadata keys no filter can name: "a.b" is read as b inside a, so it never matched
        ('{"_id": "x", "text": "t", "metadata": {"a.b": 1}}', r"key 'a.b': filters read a '\.' as nesting.*"
                                                             r'\{"a": \{"b": ...\}\}'),
        ('{"_id": "x", "text": "t", "src": {"": 1}}', "metadata.src has an empty key"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, line, message):
    path = _write(tmp_path, [_doc("a"), "", line, _doc("b")])
    with pytest.raises(ValueError, match=message) as info:
        validate_corpus(path)
    assert f"{path}:3:" in str(info.value)


def test_empty_corpus_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="corpus is empty"):
        validate_corpus(_write(tmp_path, ["", "   "]))
    with pytest.raises(FileNotFoundError, match="corpus file not found"):
        validate_corpus(str(tmp_path / "nope.jsonl"))


def test_duplicate_policies(tmp_path):
    path = _write(tmp_path, [_doc("a", "first a"), _doc("b"), _doc("a", "second a"), _doc("c")])
    with pytest.raises(ValueError, match=r":3: duplicate document id 'a' \(already in line 1\)"):
        validate_corpus(path)
    skip = validate_corpus(path, "skip")
    assert (skip.num_documents, skip.num_duplicates, skip.skip_lines) == (3, 1, {3})
    kept = [d for c in iter_chunks(path, 10, skip.skip_lines) for d in c]
    assert [(d["id"], d["text"]) for d in kept] == [("a", "first a"), ("b", "some text"), ("c", "some text")]
    replace = validate_corpus(path, "replace")
    assert replace.skip_lines == {1}
    kept = [d for c in iter_chunks(path, 10, replace.skip_lines) for d in c]
    assert [(d["id"], d["text"]) for d in kept] == [("b", "some text"), ("a", "second a"), ("c", "some text")]
    with pytest.raises(ValueError, match="on_duplicate"):
        validate_corpus(path, "merge")


def test_duplicates_against_existing_index_ids(tmp_path):
    path = _write(tmp_path, [_doc("a"), _doc("new")])
    with pytest.raises(ValueError, match="already in the index"):
        validate_corpus(path, existing_ids={"a"})
    plan = validate_corpus(path, "skip", existing_ids={"a"})
    assert plan.num_documents == 1 and plan.skip_lines == {1}
    plan = validate_corpus(path, "replace", existing_ids={"a"})
    assert plan.num_documents == 2 and plan.skip_lines == set()


def test_empty_documents_stop_the_build_naming_the_flag_or_are_skipped_and_counted(tmp_path):
    """Cranfield has two documents with blank text and title: the build stopped at the first, naming no way
    on, so a new user could not index it without editing the file."""
    path = _write(tmp_path, [_doc("a"), _doc("b", " ", title=""), _doc("c"), _doc("d", "", title="\t")])
    with pytest.raises(ValueError, match=r":2: document 'b' has empty 'text' and 'title'; use --on-empty skip to "
                                         r"leave such documents out$"):
        validate_corpus(path)
    plan = validate_corpus(path, on_empty="skip")
    assert (plan.num_documents, plan.num_empty, plan.empty_ids, plan.skip_lines) == (2, 2, ["b", "d"], {2, 4})
    assert plan.duplicates_dropped == 0 and plan.num_duplicates == 0
    assert [d["id"] for c in iter_chunks(path, 10, plan.skip_lines) for d in c] == ["a", "c"]
    with pytest.raises(ValueError, match=r":2: document 'b' has empty 'text' and 'title'$"):
        list(iter_chunks(path, 10))  # read without the validation's skip lines: still refused
    with pytest.raises(ValueError, match="on_empty"):
        validate_corpus(path, on_empty="keep")


def test_a_document_of_invisible_characters_only_is_empty_as_such_a_query_is(tmp_path):
    """Zero-width spaces, a word joiner, a soft hyphen or a byte-order mark passed `strip()`: such documents were
    indexed as the vector of an empty text (found by any query) while the same text as a query was refused."""
    path = _write(tmp_path, [_doc("a"), _doc("zw", "\u200b\u200b\u2060", title=" "), _doc("shy", "\u00ad"),
                             _doc("bom", "\ufeff", title="\u200b"), _doc("c", "\u200bword")])
    with pytest.raises(ValueError, match=r":2: document 'zw' has only control or invisible characters in 'text' and "
                                         r"'title'; use --on-empty skip"):
        validate_corpus(path)
    plan = validate_corpus(path, on_empty="skip")
    assert (plan.num_documents, plan.empty_ids) == (2, ["zw", "shy", "bom"])


def test_an_empty_copy_of_an_id_is_left_out_before_the_duplicate_policy(tmp_path):
    path = _write(tmp_path, [_doc("a", "first a"), _doc("a", ""), _doc("b")])
    plan = validate_corpus(path, on_empty="skip")  # on_duplicate "error": the empty copy is not a duplicate
    assert (plan.num_documents, plan.num_duplicates, plan.num_empty, plan.skip_lines) == (2, 0, 1, {2})
    plan = validate_corpus(path, "replace", on_empty="skip")  # nor does it replace the first copy
    assert [(d["id"], d["text"]) for c in iter_chunks(path, 10, plan.skip_lines) for d in c] == [
        ("a", "first a"), ("b", "some text")]
    dups = _write(tmp_path, [_doc("a"), _doc("x", ""), _doc("a")], "dups.jsonl")
    plan = validate_corpus(dups, "skip", on_empty="skip")
    assert (plan.duplicates_dropped, plan.num_empty, plan.skip_lines) == (1, 1, {2, 3})


def test_a_corpus_of_empty_documents_only_is_empty(tmp_path):
    path = _write(tmp_path, [_doc("a", ""), _doc("b", " ")])
    with pytest.raises(ValueError, match=r"corpus is empty \(no documents\) \(2 empty documents left out by "
                                         r"--on-empty skip\)"):
        validate_corpus(path, on_empty="skip")

