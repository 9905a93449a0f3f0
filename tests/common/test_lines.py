"""The shared line readers turn damaged files into a DataError naming file and line, for every reader built on them
(queries, qrels, runs, SQuAD), and a bad byte is reported on the line that holds it."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from twotower.common.errors import DataError
from twotower.common.lines import json_lines, json_problem, numbered_lines
from twotower.eval.io import read_beir_queries, read_squad, read_trec_run


def test_bad_byte_line_number_matches_an_independent_count(tmp_path):
    """Random files with blank lines, CRLF endings and lines longer than any read-ahead buffer: the line
    reported is the 1-based index of the bad byte's line in ``data.split(b"\\n")``."""
    rng = random.Random(7)
    for trial in range(20):
        rows = []
        for _ in range(rng.randint(1, 400)):
            kind = rng.random()
            rows.append(b"" if kind < 0.2 else ("x" * rng.randint(1, 20_000 if kind > 0.95 else 80)).encode())
        bad = rng.randrange(len(rows))
        rows[bad] += b"caf\xe9"
        data = b"\n".join(row + (b"\r" if rng.random() < 0.3 else b"") for row in rows) + b"\n"
        path = tmp_path / f"f{trial}.txt"
        path.write_bytes(data)
        want = next(i for i, line in enumerate(data.split(b"\n"), start=1) if b"\xe9" in line)
        with pytest.raises(DataError) as info:
            list(numbered_lines(path))
        assert info.value.line == want == bad + 1


def test_truncated_and_fake_gzip_for_every_line_reader(tmp_path):
    run = "".join(f"q1 Q0 d{i} {i + 1} {10 - i * 0.01} t\n" for i in range(2000)).encode()
    cut = tmp_path / "run.trec.gz"
    cut.write_bytes(gzip.compress(run)[:-100])
    with pytest.raises(DataError, match=r"run\.trec\.gz:\d+: the gzip data ends early: the file is truncated"):
        read_trec_run(cut)
    fake = tmp_path / "queries.jsonl.gz"
    fake.write_text('{"_id": "q1", "text": "tea"}\n')
    with pytest.raises(DataError, match=r"queries\.jsonl\.gz: not a gzip file"):
        read_beir_queries(fake)
    corrupt = tmp_path / "c.jsonl.gz"
    blob = bytearray(gzip.compress(run))
    blob[len(blob) // 2] ^= 0xFF  # a flipped byte inside the deflate stream
    corrupt.write_bytes(bytes(blob))
    with pytest.raises(DataError, match=r"c\.jsonl\.gz:\d+: (corrupt gzip data|the gzip data ends early)"):
        list(numbered_lines(corrupt))


def test_queries_with_a_lone_surrogate_deep_nesting_or_a_huge_number(tmp_path):
    path = tmp_path / "queries.jsonl"
    path.write_text('{"_id": "q1", "text": "tea"}\n{"_id": "q2", "text": "x \\udc00"}\n')
    with pytest.raises(DataError, match=r"queries\.jsonl:2: text holds a lone surrogate '\\udc00' at character 2"):
        read_beir_queries(path)
    # a surrogate *pair* is one character (U+1F600), and an escaped backslash is no escape at all: both are fine
    path.write_text('{"_id": "q1", "text": "\\ud83d\\ude00"}\n{"_id": "q2", "text": "\\\\ud800"}\n')
    assert read_beir_queries(path) == {"q1": "\U0001f600", "q2": "\\ud800"}
    path.write_text('{"_id": "q1", "text": ' + "[" * 50_000 + "]" * 50_000 + "}\n")
    with pytest.raises(DataError, match=r"queries\.jsonl:1: JSON nested too deeply to read"):
        read_beir_queries(path)
    path.write_text('{"_id": "q1", "text": "t"}\n\n{"_id": ' + "1" * 5000 + ', "text": "t"}\n')
    with pytest.raises(DataError, match=r"queries\.jsonl:3: a number too long to read \(Exceeds the limit"):
        list(json_lines(path))


def test_squad_nested_too_deeply(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text('{"data": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(DataError, match=r"dev\.json: JSON nested too deeply to read"):
        read_squad(path)


@pytest.mark.parametrize("value, kwargs, problem", [
    ({"a": [1, {"b": float("nan")}]}, {"allow_nan": False}, "m.a[1].b is NaN"),
    ({"a": float("inf")}, {"allow_nan": True}, None),
    ({"a": "ok \ud800"}, {}, "m.a holds a lone surrogate '\\ud800' at character 3"),
    ({"\udfff": 1}, {}, "m has a key '\\udfff' holding a lone surrogate"),
    ({"a": 2**70}, {"max_int_bits": 64}, "m.a is an integer of about 21 digits"),
    ({"a": 2**63}, {"max_int_bits": 64}, None),
    ({1: "x"}, {}, "m has a key 1 that is not a string"),
    ({"a": {1, 2}}, {}, "m.a is a set, which JSON cannot hold"),
    ({"a": [[["x"]]]}, {"max_depth": 3}, "m.a[0][0] is nested more than 3 levels deep"),
    ({"a": [["x"]]}, {"max_depth": 3}, None),
])
def test_json_problem(value, kwargs, problem):
    got = json_problem(value, "m", **kwargs)
    assert got == problem if problem is None else got.startswith(problem), got


def test_json_problem_walks_a_100k_deep_value_without_recursion():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert json_problem(deep, "v", max_depth=32).startswith("v[0][0]")
    assert json_problem(deep, "v") is None


def test_plain_corpus_lines_still_read(tmp_path):
    """A control: ordinary UTF-8 with non-ASCII text, BOM and CRLF reads as before."""
    path = tmp_path / "q.jsonl"
    path.write_bytes("\ufeff".encode() + (json.dumps({"_id": "q1", "text": "café ☕"}, ensure_ascii=False)
                                            + "\r\n").encode())
    assert read_beir_queries(path) == {"q1": "café ☕"}


def test_a_key_given_twice_is_refused_by_line_at_any_depth(tmp_path):
    """Python's parser keeps the last of two equal keys; a corpus line {"_id": "a", "_id": "b"} would index "b"."""
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"_id": "a", "text": "tea"}\n{"_id": "b", "text": "x", "_id": "c"}\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl:2: key '_id' is given twice in one JSON object"):
        list(json_lines(path))
    path.write_text('{"_id": "a", "text": "t", "metadata": {"year": 1, "tags": [{"k": 1, "k": 2}]}}\n')
    with pytest.raises(DataError, match=r"corpus\.jsonl:1: key 'k' is given twice"):
        list(json_lines(path))
    # equal keys in *different* objects, and keys equal only up to case, are fine
    path.write_text('{"_id": "a", "m": {"_id": 1}, "Text": "T", "text": "t"}\n')
    assert [obj for _, obj in json_lines(path)] == [{"_id": "a", "m": {"_id": 1}, "Text": "T", "text": "t"}]
