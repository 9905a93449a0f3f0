"""Task example readers (`twotower.eval.tasks`): the QA JSONL reader takes both answer layouts in use."""

from __future__ import annotations

import json

import pytest

from twotower.common.errors import DataError
from twotower.eval.tasks import read_qa_examples

CONTEXT = "The Eiffel Tower is in Paris, France."


def _write(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_qa_jsonl_reads_the_hugging_face_column_form_as_the_list_form(tmp_path):
    """``datasets.load_dataset("squad").to_json()`` writes answers as columns; it was refused as "must be a list"."""
    columns = {"id": "q1", "question": "Where?", "context": CONTEXT,
               "answers": {"text": ["Paris", "Paris, France"], "answer_start": [23, 23]}}
    rows = dict(columns, answers=[{"text": "Paris", "answer_start": 23}, {"text": "Paris, France", "answer_start": 23}])
    (a,) = read_qa_examples(_write(tmp_path / "columns.jsonl", columns))
    (b,) = read_qa_examples(_write(tmp_path / "rows.jsonl", rows))
    assert a.answers == b.answers == [("Paris", 23), ("Paris, France", 23)]
    unanswerable = dict(columns, id="q2", answers={"text": [], "answer_start": []})
    (c,) = read_qa_examples(_write(tmp_path / "none.jsonl", unanswerable))
    assert c.answers == []


@pytest.mark.parametrize("answers, words", [
    ({"text": ["Paris"], "answer_start": [23, 30]}, "lists of one length, got 1 and 2"),
    ({"text": ["Paris"], "answer_start": [-1]}, "'answer_start' must be a character offset"),
    ({"text": "Paris", "answer_start": 23}, "lists of one length"),
    ({"span": "Paris"}, "must be a list of"),
])
def test_qa_jsonl_column_form_errors_name_the_line(tmp_path, answers, words):
    ok = {"id": "q1", "question": "Where?", "context": CONTEXT, "answers": []}
    path = _write(tmp_path / "bad.jsonl", ok, dict(ok, id="q2", answers=answers))
    with pytest.raises(DataError, match=f"bad.jsonl:2.*{words}") as e:
        read_qa_examples(path)
    assert "bad.jsonl:2" in str(e.value)
