"""BEIR dataset directories: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``.

Layout (Thakur et al. 2021, the BEIR benchmark):

* ``corpus.jsonl``: one JSON object a line, ``{"_id", "title", "text"}``
  (``title`` may be missing or empty; other keys such as ``metadata`` are ignored);
* ``queries.jsonl``: ``{"_id", "text"}``;
* ``qrels/<split>.tsv``: tab-separated ``query-id corpus-id score`` with that header line.

Ids are kept as strings (a JSON number id is converted with ``str``) because
run files and qrels compare ids as text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

from twotower.eval.errors import DataError
from twotower.eval.io.atomic import atomic_open
from twotower.eval.io.lines import numbered_lines
from twotower.eval.io.trec import Qrels, parse_int

QRELS_HEADER = "query-id\tcorpus-id\tscore"


class BeirDocument(NamedTuple):
    doc_id: str
    title: str
    text: str


class BeirDataset(NamedTuple):
    """One split of a BEIR directory.

    Attributes:
        corpus: ``{doc id: BeirDocument}``, empty when loaded with ``corpus=False``.
        queries: ``{query id: text}`` for every query of the file (all splits).
        qrels: ``{query id: {doc id: score}}`` of the requested split.
    """

    corpus: dict[str, BeirDocument]
    queries: dict[str, str]
    qrels: Qrels

    def split_queries(self) -> dict[str, str]:
        """The queries that have judgments in this split, in qrels order."""
        return {qid: self.queries[qid] for qid in self.qrels if qid in self.queries}


def _json_objects(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict]]:
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(path, number, f"invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(path, number, f"expected a JSON object, got {type(obj).__name__}")
        yield number, obj


def _string_field(path: str | os.PathLike[str], number: int, obj: dict, key: str, required: bool) -> str:
    if key not in obj or obj[key] is None:
        if required:
            raise DataError(path, number, f"missing field {key!r}")
        return ""
    value = obj[key]
    if key == "_id" and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise DataError(path, number, f"field {key!r} must be a string, got {type(value).__name__}")
    if key == "_id" and not value.strip():
        raise DataError(path, number, "field '_id' is empty")
    return value


def iter_beir_corpus(path: str | os.PathLike[str]) -> Iterator[BeirDocument]:
    """Stream ``corpus.jsonl`` one document at a time (large corpora need not fit twice in memory)."""
    for number, obj in _json_objects(path):
        yield BeirDocument(
            _string_field(path, number, obj, "_id", True),
            _string_field(path, number, obj, "title", False),
            _string_field(path, number, obj, "text", True),
        )


def read_beir_corpus(path: str | os.PathLike[str]) -> dict[str, BeirDocument]:
    """Read ``corpus.jsonl`` into ``{doc id: BeirDocument}``; a repeated id is an error."""
    corpus: dict[str, BeirDocument] = {}
    for number, obj in _json_objects(path):
        doc = BeirDocument(
            _string_field(path, number, obj, "_id", True),
            _string_field(path, number, obj, "title", False),
            _string_field(path, number, obj, "text", True),
        )
        if doc.doc_id in corpus:
            raise DataError(path, number, f"document id {doc.doc_id!r} appears twice")
        corpus[doc.doc_id] = doc
    return corpus


def read_beir_queries(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read ``queries.jsonl`` into ``{query id: text}``; a repeated id is an error."""
    queries: dict[str, str] = {}
    for number, obj in _json_objects(path):
        qid = _string_field(path, number, obj, "_id", True)
        if qid in queries:
            raise DataError(path, number, f"query id {qid!r} appears twice")
        queries[qid] = _string_field(path, number, obj, "text", True)
    return queries


def read_beir_qrels(path: str | os.PathLike[str]) -> Qrels:
    """Read a BEIR qrels TSV (``query-id corpus-id score``; the header line is recognised and skipped)."""
    qrels: Qrels = {}
    first = True
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        fields = line.split("\t") if "\t" in line else line.split()
        fields = [f.strip() for f in fields]
        if first:
            first = False
            if len(fields) == 3 and fields[0].lower() in ("query-id", "query_id", "qid", "query"):
                continue
        if len(fields) != 3:
            raise DataError(path, number, f"expected 3 columns 'query-id corpus-id score', got {len(fields)}")
        qid, docid, raw = fields
        if not qid or not docid:
            raise DataError(path, number, "empty query or corpus id")
        judgments = qrels.setdefault(qid, {})
        if docid in judgments:
            raise DataError(path, number, f"document {docid!r} is judged twice for query {qid!r}")
        judgments[docid] = parse_int(path, number, "score", raw)
    return qrels


def available_splits(directory: str | os.PathLike[str]) -> list[str]:
    """Split names that have a ``qrels/<split>.tsv`` file."""
    qrels_dir = Path(directory) / "qrels"
    return sorted(p.stem for p in qrels_dir.glob("*.tsv")) if qrels_dir.is_dir() else []


def load_beir(directory: str | os.PathLike[str], split: str = "test", corpus: bool = True) -> BeirDataset:
    """Load one split of a BEIR directory.

    Args:
        directory: folder holding ``corpus.jsonl``, ``queries.jsonl`` and ``qrels/``.
        split: which ``qrels/<split>.tsv`` to read.
        corpus: ``False`` skips the corpus (evaluation only needs queries and qrels).

    Raises:
        FileNotFoundError: the directory or a file is missing (the message lists the splits found).
        DataError: a malformed line, or judged queries that are missing from ``queries.jsonl``.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a BEIR directory (no such folder)")
    qrels_path = root / "qrels" / f"{split}.tsv"
    if not qrels_path.is_file():
        found = ", ".join(available_splits(root)) or "none"
        raise FileNotFoundError(f"{qrels_path}: no such split file (splits found: {found})")
    queries = read_beir_queries(root / "queries.jsonl")
    qrels = read_beir_qrels(qrels_path)
    unknown = [qid for qid in qrels if qid not in queries]
    if unknown:
        raise DataError(
            qrels_path, None, f"{len(unknown)} judged queries are not in queries.jsonl, e.g. {unknown[:3]}"
        )
    docs = read_beir_corpus(root / "corpus.jsonl") if corpus else {}
    return BeirDataset(docs, queries, qrels)


def write_beir_corpus(documents: Iterable[BeirDocument], path: str | os.PathLike[str]) -> None:
    """Write ``corpus.jsonl`` atomically."""
    with atomic_open(path) as handle:
        for doc in documents:
            handle.write(
                json.dumps({"_id": doc.doc_id, "title": doc.title, "text": doc.text}, ensure_ascii=False)
            )
            handle.write("\n")


def write_beir_queries(queries: Mapping[str, str], path: str | os.PathLike[str]) -> None:
    """Write ``queries.jsonl`` atomically."""
    with atomic_open(path) as handle:
        for qid, text in queries.items():
            handle.write(json.dumps({"_id": qid, "text": text}, ensure_ascii=False) + "\n")


def write_beir_qrels(qrels: Mapping[str, Mapping[str, int]], path: str | os.PathLike[str]) -> None:
    """Write ``qrels/<split>.tsv`` with its header, atomically."""
    with atomic_open(path) as handle:
        handle.write(QRELS_HEADER + "\n")
        for qid, judgments in qrels.items():
            for docid, score in judgments.items():
                if any(ch in "\t\n" for ch in qid + docid):
                    raise ValueError(f"id {qid!r}/{docid!r} contains a tab or newline")
                handle.write(f"{qid}\t{docid}\t{int(score)}\n")
