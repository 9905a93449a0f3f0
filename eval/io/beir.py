"""BEIR dataset directories: ``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``.

Layout (Thakur et al. 2021, the BEIR benchmark):

* ``corpus.jsonl``: one JSON object a line, ``{"_id", "title", "text", "metadata"}``;
* ``queries.jsonl``: ``{"_id", "text"}``;
* ``qrels/<split>.tsv``: tab-separated ``query-id corpus-id score`` with that header line.

``parse_beir_document`` (in ``twotower.common.documents``, re-exported here) is the project's one
reading of a corpus record: the evaluation readers here, the index builds of
``twotower.retrieval.corpus`` and ``IndexStore.add`` all call it, so a file accepted by one is
accepted by the others.  Its rules:
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
from typing import NamedTuple

from twotower.common.atomic import atomic_open
from twotower.common.documents import (  # noqa: F401 - BeirDocument, empty_document: re-exported here
    BeirDocument,
    empty_document,
    parse_beir_document,
    record_id,
    record_text,
)
from twotower.common.errors import DataError
from twotower.common.lines import json_lines, numbered_lines
from twotower.eval.io.trec import Qrels, parse_int

QRELS_HEADER = "query-id\tcorpus-id\tscore"


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
        qid = record_id(obj, path, number)
        if qid in seen:
            raise DataError(path, number, f"query id {qid!r} appears twice")
        seen.add(qid)
        yield number, qid, record_text(obj, path, number)


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
    if not root.is_dir():  # a file was "no such folder" too, which it is not
        raise FileNotFoundError(f"{root}: not a BEIR directory ("
                                f"{'a file; give the folder holding queries.jsonl and qrels/' if root.exists() else 'no such folder'})")
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
