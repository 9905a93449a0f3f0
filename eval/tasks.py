"""Task data files -> encoder task examples, and the eval metrics used to score them.

The file formats are read by ``twotower.eval.io`` (one reader per format for the whole
project); this module only adapts them to the plain examples the encoder
fine-tunes on, attaching a ``source`` ("train.tsv:17") to each so that problems
found later (a dev label missing from the training label map, an empty text)
still name the file and line.  Line numbers are recovered with the same rule
the readers use to skip lines; if the counts ever disagree, the source falls
back to the example's position, never to a wrong line.

Formats by task:
- classify: ``.tsv`` with a header (GLUE style, see eval.io.tsv), ``.jsonl``
  ({"text", "label"?, "pair"?}), or ``.txt`` (one text a line, prediction only);
- tag: CoNLL (``token<TAB>tag`` lines, blank line between sentences),
  ``.jsonl`` ({"tokens", "tags"?}), or ``.txt`` (one whitespace-tokenized sentence
  a line, prediction only);
- qa: SQuAD v1.1/v2.0 ``.json`` or ``.jsonl`` ({"id", "question", "context", "answers"?}).

Any of them may be gzip-compressed (``train.jsonl.gz``): the format is chosen by the name without ``.gz``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from twotower.common.errors import DataError
from twotower.encoder.finetuning.task_examples import QAExample, TagExample, TextExample


def _check_file(path: str) -> None:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")


def _lines(path: str):
    from twotower.common.lines import numbered_lines

    return numbered_lines(path)


def _jsonl(path: str):
    from twotower.common.lines import json_lines

    return json_lines(path)


def _format(path: str) -> str:
    """The name that picks a file's format: `path` without a final ``.gz``, which the line readers decompress.

    Why: the format was picked by the whole name, so ``tag.jsonl.gz`` fell through to the CoNLL reader and
    trained on tags such as ``"B-LOC"]}``, and ``.txt.gz`` / ``.jsonl.gz`` classify files were read as TSV.
    """
    return path[:-3] if path.endswith(".gz") else path


_KIND_NAMES = {str: "a string", int: "an integer", list: "a list"}


def _field(path: str, number: int, obj: dict, key: str, kind: type | tuple, required: bool = True) -> Any:
    """``obj[key]`` checked against `kind`; a JSON true/false is not an integer here (bool subclasses int,
    so ``"label": true`` became the label "True")."""
    if key not in obj or obj[key] is None:
        if required:
            raise DataError(path, number, f"missing field {key!r}")
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    value = obj[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)
        raise DataError(path, number, f"field {key!r} must be {names}")
    return value


def _strings(path: str, number: int, values: list, name: str) -> list[str]:
    """A JSON list whose items must be strings; `name` is what one item is called ("token", "tag").

    Why: items were passed through ``str()``, so ``[null, "O"]`` trained on the tag "None".
    """
    for k, value in enumerate(values):
        if not isinstance(value, str):
            raise DataError(path, number, f"{name} {k + 1} must be a string, got {json.dumps(value)}")
    return values


def _text_lines(path: str, what: str) -> list[tuple[int, str]]:
    """The ``(line number, line)`` of a one-record-a-line ``.txt`` file to predict on.

    Blank lines at the end are dropped (they shift nothing); a blank line before a text is refused, naming
    it. Why: blank lines were dropped silently, so output line k no longer answered input line k.
    """
    lines = list(_lines(path))
    while lines and not lines[-1][1].strip():
        lines.pop()
    blank = [n for n, line in lines if not line.strip()]
    if blank:
        raise DataError(path, blank[0], f"blank line ({len(blank)} in all): each line is one {what} and the "
                        "output has one line per input line; remove the blank lines")
    return lines


def read_text_examples(path: str, text_column: str | None = None, label_column: str | None = None,
                       pair_column: str | None = None, need_labels: bool = True) -> list[TextExample]:
    """Classification examples from .tsv / .jsonl / .txt; labels optional (kept when present) unless needed.

    Without `need_labels` an example may lack its label in any format (a JSONL record without the field, a
    blank TSV cell): its label is None.
    """
    _check_file(path)
    kind = _format(path)
    if kind.endswith(".jsonl"):
        out = []
        for n, obj in _jsonl(path):
            key = label_column or "label"
            label = _field(path, n, obj, key, (str, int), need_labels)
            label = None if label is None else str(label).strip()  # a TSV cell's rule: stripped, blank is none
            if label == "":  # it was a class "" in training, and refused as outside the map in predict
                if need_labels:
                    raise DataError(path, n, f"empty label in field {key!r}")
                label = None
            pair_key = pair_column or ("pair" if "pair" in obj else "text_pair")
            pair = _field(path, n, obj, pair_key, str, required=False)
            out.append(TextExample(_field(path, n, obj, text_column or "text", str), label, pair, f"{path}:{n}"))
        return out
    if kind.endswith(".txt"):
        if need_labels:
            raise DataError(path, None, "a .txt file has no labels; use a .tsv with a header or .jsonl")
        return [TextExample(line, source=f"{path}:{n}") for n, line in _text_lines(path, "text")]
    from twotower.eval.io import read_classification_tsv

    if not need_labels and not _has_label_column(path, label_column):
        return _unlabelled_tsv(path, text_column, pair_column)
    rows = read_classification_tsv(path, text_column, label_column, pair_column, missing_labels=not need_labels)
    numbers = [n for n, line in _lines(path) if n > 1 and line.strip()]
    sources = [f"{path}:{n}" for n in numbers] if len(numbers) == len(rows) else \
        [f"{path}: row {i + 1}" for i in range(len(rows))]
    return [TextExample(r.text, r.label, r.text_pair, s) for r, s in zip(rows, sources)]


def _has_label_column(path: str, label_column: str | None) -> bool:
    first = next(_lines(path), None)
    header = [h.strip() for h in first[1].split("\t")] if first else []
    return label_column in header if label_column else any(h.startswith("label") for h in header)


def _unlabelled_tsv(path: str, text_column: str | None, pair_column: str | None) -> list[TextExample]:
    """A TSV to predict on: same header rules as eval.io.tsv, but no label column required."""
    from twotower.eval.io.tsv import PAIR_COLUMNS, TEXT_COLUMNS

    rows = _lines(path)
    first = next(rows, None)
    if first is None:
        raise DataError(path, None, "file is empty (a header line is required)")
    header = [h.strip() for h in first[1].split("\t")]
    names = [text_column] if text_column else list(TEXT_COLUMNS)
    text_i = next((header.index(c) for c in names if c in header), None)
    if text_i is None:
        raise DataError(path, 1, f"no text column (tried {names}); columns are {header}")
    pairs = [pair_column] if pair_column else list(PAIR_COLUMNS)
    pair_i = next((header.index(c) for c in pairs if c in header), None)
    out = []
    for n, line in rows:
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            raise DataError(path, n, f"expected {len(header)} tab-separated fields, got {len(fields)}")
        out.append(TextExample(fields[text_i], None, fields[pair_i] if pair_i is not None else None, f"{path}:{n}"))
    return out


def read_tag_examples(path: str, need_tags: bool = True) -> list[TagExample]:
    """Tagging examples from CoNLL / .jsonl / .txt; tags optional (kept when present) unless needed."""
    _check_file(path)
    kind = _format(path)
    if kind.endswith(".jsonl"):
        out = []
        for n, obj in _jsonl(path):
            tokens = _strings(path, n, _field(path, n, obj, "tokens", list), "token")
            tags = _field(path, n, obj, "tags", list, need_tags)
            if tags is not None and len(tags) != len(tokens):
                raise DataError(path, n, f"{len(tokens)} tokens but {len(tags)} tags")
            out.append(TagExample(list(tokens), None if tags is None else list(_strings(path, n, tags, "tag")),
                                  f"{path}:{n}"))
        return out
    if kind.endswith(".txt") and not need_tags:
        return [TagExample(line.split(), None, f"{path}:{n}") for n, line in _text_lines(path, "sentence")]
    from twotower.eval.io import read_conll

    sentences = read_conll(path)
    starts, in_sentence = [], False
    for n, line in _lines(path):
        is_break = not line.strip() or line.startswith("-DOCSTART-")
        if not is_break and not in_sentence:
            starts.append(n)
        in_sentence = not is_break
    sources = [f"{path}:{n}" for n in starts] if len(starts) == len(sentences) else \
        [f"{path}: sentence {i + 1}" for i in range(len(sentences))]
    return [TagExample(list(s.tokens), list(s.tags), src) for s, src in zip(sentences, sources)]


def _answer_list(path: str, number: int, obj: dict) -> list:
    """A JSONL record's answers as ``[{"text", "answer_start"}, ...]``: that list itself, or the column form
    ``{"text": [...], "answer_start": [...]}`` that Hugging Face datasets write (``squad``'s ``to_json``), which
    was refused as "must be a list"."""
    value = obj.get("answers")
    if isinstance(value, dict) and set(value) >= {"text", "answer_start"}:
        texts, starts = value["text"], value["answer_start"]
        if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
            raise DataError(path, number, "field 'answers' in the column form needs 'text' and 'answer_start' as "
                            f"lists of one length, got {len(texts) if isinstance(texts, list) else 'no list'} and "
                            f"{len(starts) if isinstance(starts, list) else 'no list'}")
        return [{"text": t, "answer_start": a} for t, a in zip(texts, starts)]
    if isinstance(value, dict):
        raise DataError(path, number, "field 'answers' must be a list of {\"text\", \"answer_start\"} or "
                        "{\"text\": [...], \"answer_start\": [...]}")
    return _field(path, number, obj, "answers", list, required=False) or []


def read_qa_examples(path: str) -> list[QAExample]:
    """QA examples from SQuAD JSON (answers checked against their offsets) or .jsonl."""
    _check_file(path)
    if _format(path).endswith(".jsonl"):
        out = []
        seen: dict[str, int] = {}  # id -> its line: scoring keys references by id, so a repeat replaced one
        for n, obj in _jsonl(path):
            qid = str(_field(path, n, obj, "id", (str, int)))
            if qid in seen:
                raise DataError(path, n, f"id {qid!r} appears twice (first on line {seen[qid]})")
            seen[qid] = n
            answers = []
            for k, a in enumerate(_answer_list(path, n, obj), start=1):
                if not isinstance(a, dict) or not isinstance(a.get("text"), str):
                    raise DataError(path, n, f"answer {k} needs 'text' (a string) and 'answer_start'")
                start = a.get("answer_start")
                # bool is an int to Python (true was offset 1), and a negative offset counted from the end
                if not isinstance(start, int) or isinstance(start, bool) or start < 0:
                    raise DataError(path, n, f"answer {k}: 'answer_start' must be a character offset (an "
                                    f"integer >= 0), got {json.dumps(start)}")
                answers.append((a["text"], start))
            out.append(QAExample(qid, _field(path, n, obj, "question", str),
                                 _field(path, n, obj, "context", str), answers, f"{path}:{n}"))
        return out
    from twotower.eval.io import read_squad

    return [QAExample(ex.id, ex.question, ex.context, list(zip(ex.answers, ex.answer_starts)),
                      f"{path}: question {ex.id}")
            for ex in read_squad(path, check_offsets=True)]


READERS = {"classify": read_text_examples, "tag": read_tag_examples, "qa": read_qa_examples}


# ---- metrics ------------------------------------------------------------------------------------------


def classify_metrics(preds: Sequence, examples: Sequence[TextExample]) -> dict[str, float]:
    from twotower.eval.metrics import classification_report

    r = classification_report([ex.label for ex in examples], [p.label for p in preds])
    return {"accuracy": r.accuracy, "macro_f1": r.macro_f1}


def tag_metrics(preds: Sequence, examples: Sequence[TagExample]) -> dict[str, float]:
    from twotower.eval.metrics import tagging_report

    r = tagging_report([ex.tags for ex in examples], [p.tags for p in preds])
    return {"precision": r.precision, "recall": r.recall, "f1": r.f1}


def qa_metrics(preds: Sequence, examples: Sequence[QAExample]) -> dict[str, float]:
    """Official SQuAD EM / F1 (percent): v1.1 when every question has an answer, else v2.0."""
    from twotower.eval.metrics import squad_v1_scores, squad_v2_scores

    refs = {ex.id: [t for t, _ in ex.answers] for ex in examples}
    answers = {p.id: p.answer for p in preds}
    if all(refs.values()):
        s = squad_v1_scores(answers, refs)
        return {"exact_match": s["exact_match"], "f1": s["f1"]}
    s = squad_v2_scores(answers, refs)
    return {"exact_match": s["exact"], "f1": s["f1"], "has_ans_f1": s.get("HasAns_f1", 0.0),
            "no_ans_f1": s.get("NoAns_f1", 0.0)}


METRICS = {"classify": (classify_metrics, "accuracy"), "tag": (tag_metrics, "f1"), "qa": (qa_metrics, "f1")}
