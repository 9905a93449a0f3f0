"""SQuAD v1.1 / v2.0 JSON: read questions with their gold answers, write predictions.

Structure: ``{"data": [{"title", "paragraphs": [{"context", "qas": [{"id",
"question", "answers": [{"text", "answer_start"}], "is_impossible"?}]}]}]}``.
JSON has no useful line numbers once parsed, so errors name the JSON path,
e.g. ``dev.json: data[3].paragraphs[0].qas[2]: missing 'id'``.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from twotower.common.atomic import atomic_write_text
from twotower.common.errors import DataError


class SquadExample(NamedTuple):
    """One question; ``answers`` and ``answer_starts`` are parallel, empty when ``is_impossible``."""

    id: str
    title: str
    context: str
    question: str
    answers: list[str]
    answer_starts: list[int]
    is_impossible: bool


def _load_json(path: str | os.PathLike[str]) -> object:
    """A whole JSON file, read through gzip when its name ends in ``.gz`` (as the line readers do)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{os.fspath(path)}: no such file")
    compressed = os.fspath(path).endswith(".gz")
    with (gzip.open(path, "rt", encoding="utf-8") if compressed else open(path, encoding="utf-8")) as handle:
        try:
            return json.load(handle)
        except json.JSONDecodeError as exc:
            raise DataError(path, exc.lineno, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        except UnicodeDecodeError as exc:
            raise DataError(path, None, f"not valid UTF-8 ({exc.reason})") from None
        except RecursionError:
            raise DataError(path, None, "JSON nested too deeply to read") from None
        except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
            raise DataError(path, None, f"not readable as gzip ({exc or 'the file is truncated'})") from None


def _get(path: str | os.PathLike[str], where: str, obj: object, key: str, kind: type) -> object:
    if not isinstance(obj, dict):
        raise DataError(path, None, f"{where}: expected an object, got {type(obj).__name__}")
    if key not in obj:
        raise DataError(path, None, f"{where}: missing {key!r}")
    value = obj[key]
    if kind is str and isinstance(value, int) and key == "id":
        value = str(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DataError(path, None, f"{where}.{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def read_squad(path: str | os.PathLike[str], check_offsets: bool = False) -> list[SquadExample]:
    """Read every question of a SQuAD-format file.

    Args:
        path: the JSON file.
        check_offsets: require ``context[start:start+len(text)] == text`` for every answer
            (true for SQuAD/XQuAD dev; off by default because some derived sets drift).

    Raises:
        DataError: a missing or mistyped field (named by its JSON path), a repeated question id,
            or with ``check_offsets`` an answer that is not at its offset.
    """
    root = _load_json(path)
    data = _get(path, "<root>", root, "data", list)
    examples: list[SquadExample] = []
    seen: set[str] = set()
    for a, article in enumerate(data):  # type: ignore[arg-type]
        where_a = f"data[{a}]"
        title = article.get("title", "") if isinstance(article, dict) else ""
        paragraphs = _get(path, where_a, article, "paragraphs", list)
        for p, paragraph in enumerate(paragraphs):  # type: ignore[arg-type]
            where_p = f"{where_a}.paragraphs[{p}]"
            context = _get(path, where_p, paragraph, "context", str)
            qas = _get(path, where_p, paragraph, "qas", list)
            for q, qa in enumerate(qas):  # type: ignore[arg-type]
                where_q = f"{where_p}.qas[{q}]"
                qid = _get(path, where_q, qa, "id", str)
                question = _get(path, where_q, qa, "question", str)
                answers = _get(path, where_q, qa, "answers", list)
                impossible = bool(qa.get("is_impossible", False)) or not answers  # type: ignore[union-attr]
                if qid in seen:
                    raise DataError(path, None, f"{where_q}: question id {qid!r} appears twice")
                seen.add(qid)  # type: ignore[arg-type]
                texts: list[str] = []
                starts: list[int] = []
                for n, answer in enumerate(answers):  # type: ignore[arg-type]
                    where_n = f"{where_q}.answers[{n}]"
                    text = _get(path, where_n, answer, "text", str)
                    start = _get(path, where_n, answer, "answer_start", int)
                    if check_offsets and context[start : start + len(text)] != text:  # type: ignore[index]
                        raise DataError(path, None, f"{where_n}: text {text!r} is not at offset {start}")
                    texts.append(text)  # type: ignore[arg-type]
                    starts.append(start)  # type: ignore[arg-type]
                examples.append(
                    SquadExample(qid, str(title), context, question, texts, starts, impossible)  # type: ignore[arg-type]
                )
    return examples


def squad_references(examples: Sequence[SquadExample]) -> dict[str, list[str]]:
    """``{question id: [gold texts]}`` for the metrics; an impossible question maps to ``[]``."""
    return {ex.id: ([] if ex.is_impossible else list(ex.answers)) for ex in examples}


def write_squad_predictions(predictions: Mapping[str, str], path: str | os.PathLike[str]) -> None:
    """Write ``{question id: answer text}`` as the official scripts expect, atomically."""
    atomic_write_text(path, json.dumps(dict(predictions), ensure_ascii=False, indent=1) + "\n")


def read_squad_predictions(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a predictions file ``{question id: answer text}``."""
    obj = _load_json(path)
    if not isinstance(obj, dict):
        raise DataError(path, None, "predictions must be a JSON object {question id: answer}")
    for key, value in obj.items():
        if not isinstance(value, str):
            raise DataError(
                path, None, f"prediction for {key!r} must be a string, got {type(value).__name__}"
            )
    return dict(obj)
