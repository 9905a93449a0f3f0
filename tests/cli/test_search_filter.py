"""``twotower search --filter``: matching hits only; a bad filter exits 2 naming --filter and the column."""

from __future__ import annotations

import json

import pytest

from tests.cli.cli_run import run_cli
from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus


@pytest.fixture(scope="module")
def index(tmp_path_factory) -> str:
    from twotower.cli import main

    root = tmp_path_factory.mktemp("cli-filter")
    docs = [{**d, "lang": ["en", "fr"][i % 2], "metadata": {"year": 2000 + i}} for i, d in enumerate(toy_docs(30))]
    corpus = write_corpus(str(root / "corpus.jsonl"), docs)
    assert main(["index", "build", "--corpus", corpus, "--out", str(root / "idx"), "--model", tiny_model_dir(),
                 "--bm25", "--no-progress"]) == 0
    return str(root / "idx")


@pytest.mark.parametrize("hybrid", [False, True])
def test_filter_keeps_matching_hits(capsys, index, hybrid):
    rc, out, _ = run_cli(capsys, "search", "--index", index, "--json", "--no-rerank", "-k", "5",
                         *(["--hybrid"] if hybrid else []), "--filter", 'lang == "fr" and year < 2010', "tea")
    assert rc == 0
    hits = json.loads(out)[0]["hits"]
    assert [h["id"] for h in hits] and all(int(h["id"][1:]) % 2 == 1 and int(h["id"][1:]) < 10 for h in hits)
    assert len(hits) == 5  # d1, d3, d5, d7, d9 match


def test_filter_syntax_error_exits_2_before_loading(capsys, tmp_path):
    rc, out, err = run_cli(capsys, "search", "--index", str(tmp_path / "missing"), "--filter", "year >= 2010 )", "q")
    assert rc == 2 and out == ""
    first, caret = err.rstrip("\n").split("\n")
    assert first == "twotower search: error: --filter: unexpected ')' at column 14: year >= 2010 )"
    assert caret.index("^") == first.index("year >= 2010 )") + 13  # under the ')'


@pytest.mark.parametrize("blank", ["", "   "])
def test_a_blank_filter_is_refused_as_in_python(capsys, tmp_path, blank):
    """`--filter ""` (an unset variable) is refused, and says how to search without a filter; Python's
    `filter=""` was read as no filter, and now is refused the same way."""
    rc, out, err = run_cli(capsys, "search", "--index", str(tmp_path / "missing"), "--filter", blank, "q")
    assert rc == 2 and out == ""
    assert "error: --filter: empty filter (leave it out to search without one) at column" in err


def test_filter_unknown_field_exits_2_with_known_fields(capsys, index):
    rc, _, err = run_cli(capsys, "search", "--index", index, "--no-rerank", "--filter", "yaer > 1", "tea")
    assert rc == 2
    assert "--filter: unknown field 'yaer' at column 1: yaer > 1 (known fields: lang, year)" in err
