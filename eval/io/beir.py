"""BEIR dataset directories: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``.

Layout (Thakur et al. 2021, the BEIR benchmark):

* ``corpus.jsonl``: one JSON object a line, ``{"_id", "title", "text", "metadata"}``;
* ``queries.jsonl``: ``{"_id", "text"}``;
* ``qrels/<split>.tsv``: tab-separated ``query-id corpus-id score`` with that header line.

``parse_beir_document`` is the project's one reading of a corpus record: the
evaluation readers here and the index builds of ``twotower.retrieval.corpus``
both call it, so a file accepted by one is accepted by the other.  Its rules:
``_id`` (or ``id``) is a non-empty string, an integer id is turned into one
(run files and qrels compare ids as text); ``text`` is a string; ``title`` is
a string or absent; ``metadata`` is an object or absent.  Any other top-level
key is metadata too (``{"_id": "a", "text": "t", "lang": "en"}`` has metadata
``{"lang": "en"}``), so a corpus can carry filterable fields without nesting them;
a key both at the top level and inside ``metadata`` is refused as ambiguous.
Scoring reads only ``title`` and ``text``, so evaluation is unchanged by this.
Files may be gzip-compressed (``corpus.jsonl.gz``).

One rule depends on the reader's purpose, so it is an argument: an index build
refuses a document whose ``text`` and ``title`` are both blank (nothing to
search: ``require_content=True``, worded by `empty_document`), while evaluation
keeps it, because benchmark corpora have such documents (Cranfield has two) and
dropping them would change the collection that the qrels judge.  An index build
asked to leave them out (``--on-empty skip``) reads with ``require_content=False``
and drops them itself (`twotower.retrieval.corpus.validate_corpus`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from twotower.common.atomic import atomic_open
from twotower.common.errors import DataError
from twotower.common.lines import is_blank, json_lines, numbered_lines
from twotower.eval.io.trec import Qrels, parse_int

QRELS_HEADER = "query-id\tcorpus-id\tscore"
_NO_METADATA: Mapping[str, Any] = MappingProxyType({})
_RECORD_KEYS = frozenset({"_id", "id", "title", "text", "metadata"})  # every other key of a record is metadata


class BeirDocument(NamedTuple):
    doc_id: str
    title: str
    text: str
    metadata: Mapping[str, Any] = _NO_METADATA


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


def _record_id(obj: Mapping[str, Any], path: str | os.PathLike[str], line: int | None) -> str:
    """The ``_id`` (or, without one, ``id``) of a record as a non-empty string; an integer id becomes its decimal
    text."""
    value = obj.get("_id")
    if value is None:
        value = obj.get("id")
    if value is None:
        raise DataError(path, line, "missing field '_id'", field="_id")
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise DataError(path, line, f"field '_id' must be a non-empty string, got {value!r}", field="_id")
    return value


def _record_text(obj: Mapping[str, Any], path: str | os.PathLike[str], line: int | None) -> str:
    value = obj.get("text")
    if not isinstance(value, str):
        found = "" if value is None else f" (got {type(value).__name__})"
        raise DataError(path, line, f"missing string field 'text'{found}", field="text")
    return value


def empty_document(doc_id: str, title: str, text: str) -> str | None:
    """Why a document has nothing to search (its ``text`` and ``title`` are both blank), or None.

    The one wording of the rule, for `parse_beir_document` and for the index build that skips such
    documents under its ``--on-empty`` policy instead of stopping at the first. Blank is a query's blank
    (`is_blank`): a text of zero-width spaces or a soft hyphen was indexed as the vector of an empty text,
    which came up for any query, while the same text as a query was refused.
    """
    if not (is_blank(text) and is_blank(title)):
        return None
    if text.strip() or title.strip():
        return f"document {doc_id!r} has only control or invisible characters in 'text' and 'title'"
    return f"document {doc_id!r} has empty 'text' and 'title'"


def parse_beir_document(
    obj: Any, path: str | os.PathLike[str], line: int | None = None, require_content: bool = False
) -> BeirDocument:
    """Check one decoded corpus record and return it as a ``BeirDocument``.

    Args:
        obj: the decoded JSON value of one line (or an in-memory mapping).
        path, line: where it came from, for the error (``path`` may name a record, e.g. ``"docs[3]"``).
        require_content: refuse a document whose ``text`` and ``title`` are both blank.

    Raises:
        DataError: naming ``path:line`` and the field, by the rules of the module docstring.

    Example:
        >>> parse_beir_document({"_id": 7, "text": "tea"}, "corpus.jsonl", 1)
        BeirDocument(doc_id='7', title='', text='tea', metadata=mappingproxy({}))
        >>> parse_beir_document({"_id": "a", "title": 3, "text": "x"}, "corpus.jsonl", 2)
        Traceback (most recent call last):
        ...
        twotower.common.errors.DataError: corpus.jsonl:2: field 'title' must be a string, got int
    """
    if not isinstance(obj, Mapping):
        raise DataError(path, line, f"expected a JSON object, got {type(obj).__name__}")
    doc_id = _record_id(obj, path, line)
    text = _record_text(obj, path, line)
    title = obj.get("title")
    if title is None:
        title = ""
    if not isinstance(title, str):
        raise DataError(path, line, f"field 'title' must be a string, got {type(title).__name__}", field="title")
    if require_content and (empty := empty_document(doc_id, title, text)):
        raise DataError(path, line, empty, field="text")
    metadata = obj.get("metadata")
    if metadata is None:
        metadata = _NO_METADATA
    elif not isinstance(metadata, Mapping):
        raise DataError(path, line, f"field 'metadata' must be an object, got {type(metadata).__name__}",
                        field="metadata")
    # beside an `_id`, an `id` is a field like any other (it was dropped without a word)
    keys = _RECORD_KEYS if obj.get("_id") is None else _RECORD_KEYS - {"id"}
    extra = {k: v for k, v in obj.items() if k not in keys}
    if extra:
        both = sorted(set(extra) & set(metadata))
        if both:
            raise DataError(path, line, f"field {both[0]!r} is both a top-level field and a key of 'metadata'; "
                            "keep one of them", field=both[0])
        metadata = {**metadata, **extra}
    return BeirDocument(doc_id, title, text, metadata)


def iter_beir_corpus(
    path: str | os.PathLike[str], require_content: bool = False
) -> Iterator[tuple[int, BeirDocument]]:
    """Stream ``(line number, document)`` of ``corpus.jsonl(.gz)`` (large corpora need not fit in memory)."""
    for number, obj in json_lines(path):
        yield number, parse_beir_document(obj, path, number, require_content)


def read_beir_corpus(path: str | os.PathLike[str]) -> dict[str, BeirDocument]:
    """Read ``corpus.jsonl`` into ``{doc id: BeirDocument}``; a repeated id is an error."""
    corpus: dict[str, BeirDocument] = {}
    for number, doc in iter_beir_corpus(path):
        if doc.doc_id in corpus:
            raise DataError(path, number, f"document id {doc.doc_id!r} appears twice")
        corpus[doc.doc_id] = doc
    return corpus


def iter_beir_queries(path: str | os.PathLike[str]) -> Iterator[tuple[int, str, str]]:
    """Stream ``(line number, query id, text)`` of ``queries.jsonl(.gz)``; a repeated id is an error.

    The line travels with each query so that a caller's own check of the text (is it searchable?)
    can name ``file:line`` as this reader names its errors.
    """
    seen: set[str] = set()
    for number, obj in json_lines(path):
        qid = _record_id(obj, path, number)
        if qid in seen:
            raise DataError(path, number, f"query id {qid!r} appears twice")
        seen.add(qid)
        yield number, qid, _record_text(obj, path, number)


def read_beir_queries(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read ``queries.jsonl`` into ``{query id: text}``; a repeated id is an error."""
    return {qid: text for _, qid, text in iter_beir_queries(path)}


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
            record = {"_id": doc.doc_id, "title": doc.title, "text": doc.text}
            if doc.metadata:
                record["metadata"] = dict(doc.metadata)
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


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
