"""Reading a BEIR-style ``corpus.jsonl`` ({_id, title, text}) in bounded-memory chunks.

An index build reads the corpus twice: once to *validate* it (every line is a
JSON object with a string ``_id`` and ``text``; ids are unique, or a duplicate
policy says what to do) and once to *encode* it chunk by chunk.  Validating
first is what makes "a bad line 90,000 into the file" fail in seconds, naming
the file and line, before any model runs or anything is written.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from twotower.indexing import Document

DUPLICATE_POLICIES = ("error", "skip", "replace")


def parse_document(obj: Any, where: str) -> Document:
    """Turn one decoded JSON value into an `indexing.Document`; `where` ("file:line") prefixes every error.

    BEIR's ``_id`` (or ``id``; an integer is accepted and turned into a string) and
    ``text`` are required, ``title`` and ``metadata`` optional.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    doc_id = obj.get("_id", obj.get("id"))
    if doc_id is None:
        raise ValueError(f"{where}: missing field '_id'")
    if isinstance(doc_id, int) and not isinstance(doc_id, bool):
        doc_id = str(doc_id)
    if not isinstance(doc_id, str) or not doc_id.strip():
        raise ValueError(f"{where}: field '_id' must be a non-empty string, got {doc_id!r}")
    text = obj.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}: missing string field 'text'")
    title = obj.get("title") or ""
    if not isinstance(title, str):
        raise ValueError(f"{where}: field 'title' must be a string, got {type(title).__name__}")
    if not text.strip() and not title.strip():
        raise ValueError(f"{where}: document {doc_id!r} has empty 'text' and 'title'")
    meta = obj.get("metadata") or {}
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: field 'metadata' must be an object, got {type(meta).__name__}")
    return Document(id=doc_id, title=title, text=text, metadata=meta)


def _open(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file not found: {path}")
    opener = gzip.open if path.endswith(".gz") else open
    return opener(path, "rt", encoding="utf-8")


def iter_documents(path: str) -> Iterator[tuple[int, Document]]:
    """Yield (line number, Document) for every non-blank line of a .jsonl(.gz) corpus."""
    with _open(path) as f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, 1):  # noqa: B007 - lineno is read in the except clause
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
                yield lineno, parse_document(obj, f"{path}:{lineno}")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}:{lineno + 1}: not valid UTF-8 ({exc.reason})") from exc


@dataclass
class CorpusPlan:
    """What a validation pass learned: how many documents will be indexed and which lines to drop.

    `skip_lines` are the line numbers whose document is superseded under the
    duplicate policy (the later copy with "skip", the earlier with "replace"), so
    the encoding pass sees each id exactly once.
    """

    path: str
    num_documents: int
    num_duplicates: int
    skip_lines: set[int]


def validate_corpus(path: str, on_duplicate: str = "error", existing_ids: Iterable[str] = ()) -> CorpusPlan:
    """Check every line, count documents and resolve duplicate ids, without keeping the texts.

    Args:
        path: the corpus file.
        on_duplicate: "error" (default) stops at the second occurrence of an id,
            naming both lines; "skip" keeps the first occurrence; "replace" keeps the last.
        existing_ids: ids already in the index (for `add`): a collision is a duplicate too;
            with "replace" the caller must delete the old copy.
    Raises:
        ValueError naming file and line; ValueError for an empty corpus.
    """
    if on_duplicate not in DUPLICATE_POLICIES:
        raise ValueError(f"on_duplicate={on_duplicate!r}; choose one of {DUPLICATE_POLICIES}")
    existing = existing_ids if isinstance(existing_ids, (set, frozenset, dict)) else set(existing_ids)
    first_line: dict[str, int] = {}
    skip: set[int] = set()
    dups = 0
    for lineno, doc in iter_documents(path):
        doc_id = doc["id"]
        prev = first_line.get(doc_id)
        if prev is None and doc_id not in existing:
            first_line[doc_id] = lineno
            continue
        dups += 1
        where = f"line {prev}" if prev is not None else "the index"
        if on_duplicate == "error":
            raise ValueError(
                f"{path}:{lineno}: duplicate document id {doc_id!r} (already in {where}); "
                "use --on-duplicate skip|replace to choose"
            )
        if on_duplicate == "skip":
            skip.add(lineno)
        else:  # replace: the later line wins
            if prev is not None:
                skip.add(prev)
            first_line[doc_id] = lineno
    if not first_line and dups == 0:
        raise ValueError(f"{path}: corpus is empty (no documents)")
    return CorpusPlan(path=path, num_documents=len(first_line), num_duplicates=dups, skip_lines=skip)


def iter_chunks(path: str, chunk_size: int, skip_lines: set[int] | None = None) -> Iterator[list[Document]]:
    """Yield lists of at most `chunk_size` documents, in file order, leaving out `skip_lines`."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    skip = skip_lines or set()
    chunk: list[Document] = []
    for lineno, doc in iter_documents(path):
        if lineno in skip:
            continue
        chunk.append(doc)
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def resolve_duplicates(rows: list[Document], on_duplicate: str, existing: set[str] | frozenset[str]) -> list[Document]:
    """Apply the duplicate policy to documents in memory (the same rules as `validate_corpus`).

    "error" raises naming both positions; "skip" keeps the first copy (and what the index
    holds); "replace" keeps the last copy (the caller replaces what the index holds).
    """
    if on_duplicate not in DUPLICATE_POLICIES:
        raise ValueError(f"on_duplicate={on_duplicate!r}; choose one of {DUPLICATE_POLICIES}")
    seen: dict[str, int] = {}
    out: list[Document | None] = []
    for i, d in enumerate(rows):
        doc_id = d["id"]
        if doc_id in seen or doc_id in existing:
            if on_duplicate == "error":
                where = f"docs[{seen[doc_id]}]" if doc_id in seen else "the index"
                raise ValueError(f"docs[{i}]: duplicate document id {doc_id!r} (already in {where})")
            if on_duplicate == "skip":
                continue
            if doc_id in seen:  # replace: the later copy wins
                out[seen[doc_id]] = None
        seen[doc_id] = len(out)
        out.append(d)
    return [d for d in out if d is not None]


def write_corpus_file(docs: Iterable[Mapping[str, Any]], directory: str) -> str:
    """Validate in-memory documents (errors name ``docs[i]``) and write them to a temp JSONL in `directory`.

    Builds always read a file, twice (validate, then encode in chunks); this lets a
    list of dicts take the same path.  The caller deletes the file.
    """
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".corpus-", suffix=".jsonl", dir=directory)
    try:
        n = 0
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for n, d in enumerate(docs, start=1):
                doc = parse_document(d, f"docs[{n - 1}]")
                f.write(json.dumps({"_id": doc["id"], "title": doc["title"], "text": doc["text"],
                                    "metadata": doc["metadata"]}, ensure_ascii=False) + "\n")
        if n == 0:
            raise ValueError("no documents given (empty corpus)")
    except BaseException:
        os.unlink(path)
        raise
    return path
