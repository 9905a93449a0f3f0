"""Reading a BEIR-style ``corpus.jsonl`` ({_id, title, text}) in bounded-memory chunks.

An index build reads the corpus twice: once to *validate* it (every line is a
JSON object with a string ``_id`` and ``text``; ids are unique, or a duplicate
policy says what to do) and once to *encode* it chunk by chunk.  Validating
first is what makes "a bad line 90,000 into the file" fail in seconds, naming
the file and line, before any model runs or anything is written.

An index holds stricter documents than an evaluation corpus (`check_for_index`, in
``twotower.common.documents`` with its limits),
because what goes in must come out again through every output: ids go into TREC
run files, whose fields are separated by whitespace, and into URLs and SQLite
keys; texts go through a tokenizer and out as UTF-8 JSON.  So ids are at most
``twotower.common.documents.MAX_ID_BYTES`` of UTF-8 without whitespace or control
characters, no string holds a lone surrogate, and metadata is JSON (no NaN or
Infinity, at most ``MAX_METADATA_DEPTH`` levels deep there).  Both ``build`` and
``add`` apply the rules, to files and to in-memory documents alike, and so does
``IndexStore.add``.

A document whose ``text`` and ``title`` are both blank has nothing to search, so it
stops a build by default; ``on_empty="skip"`` (``--on-empty skip``) leaves such
documents out and counts them (`empty_note`), as benchmark corpora have them
(Cranfield has two) and a new user should not have to edit the file to index it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Container, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from twotower.common.documents import check_for_index, document_records
from twotower.common.errors import DataError
from twotower.eval.io.beir import BeirDocument, empty_document, iter_beir_corpus, parse_beir_document
from twotower.indexing import Document
from twotower.indexing.docstore import _Row

DUPLICATE_POLICIES = ("error", "skip", "replace")
EMPTY_POLICIES = ("error", "skip")
SKIP_EMPTY_HINT = "use --on-empty skip to leave such documents out"
EMPTY_EXAMPLES = 5  # ids of skipped empty documents a note names


def _as_document(doc: BeirDocument) -> Document:
    """A document `check_for_index` has passed, as a `_Row`: the index layer (``IndexStore._add_rows``) takes it
    without checking it again."""
    return _Row(id=doc.doc_id, title=doc.title, text=doc.text, metadata=dict(doc.metadata))  # type: ignore[return-value]


def parse_document(obj: Any, where: str, keep_empty: bool = False) -> Document:
    """Turn one in-memory record into an `indexing.Document`; `where` (e.g. "docs[3]") prefixes every error.

    The rules are BEIR's, as ``twotower.eval.io.beir.parse_beir_document`` checks them
    for every corpus line: ``_id`` (or ``id``; an integer becomes a string) and ``text``
    are required, ``title`` and ``metadata`` optional; an index also refuses a document
    with blank ``text`` and ``title`` (nothing to search), unless `keep_empty` (the caller
    leaves it out under ``on_empty="skip"``).

    A record this function (or a corpus reader) returned is taken as it is, but for the blank check of
    `keep_empty`. Why: the service parses each document to answer with its field (``POST /documents``), then
    ``SearchPipeline.add`` parsed it again; only the pipeline's code has such a record (`_Row` is private).
    """
    if isinstance(obj, _Row):
        if not keep_empty and (empty := empty_document(obj["id"], obj["title"], obj["text"])):
            raise DataError(where, None, empty, field="text")
        return obj  # type: ignore[return-value]
    doc = parse_beir_document(obj, where, require_content=not keep_empty)
    return _as_document(check_for_index(doc, where, None))


def is_empty(doc: Document) -> bool:
    """Whether a document has nothing to search: its text and title are both blank (`empty_document`)."""
    return empty_document(doc["id"], doc["title"], doc["text"]) is not None


def iter_documents(path: str, keep_empty: bool = False) -> Iterator[tuple[int, Document]]:
    """Yield (line number, Document) for every non-blank line of a .jsonl(.gz) corpus, streaming.

    A document with blank text and title is an error naming its line, unless `keep_empty`: then it is
    yielded, for a caller that applies the ``--on-empty`` policy (`validate_corpus`, `iter_chunks`).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"corpus file not found: {path}")
    for lineno, doc in iter_beir_corpus(path, require_content=not keep_empty):
        yield lineno, _as_document(check_for_index(doc, path, lineno, strings=False))


@dataclass
class CorpusPlan:
    """What a validation pass learned: how many documents will be indexed and which lines to drop.

    `skip_lines` are the line numbers whose document is not indexed: one superseded
    under the duplicate policy (the later copy with "skip", the earlier with "replace"),
    so the encoding pass sees each id exactly once, or, under ``on_empty="skip"``, an
    empty one (`num_empty` of them; `empty_ids` holds the first few, for the note).
    """

    path: str
    num_documents: int
    num_duplicates: int
    skip_lines: set[int]
    content_bytes: int = 0  # characters of id, title and text of every line: about what the document store holds
    num_empty: int = 0
    empty_ids: list[str] = field(default_factory=list)

    @property
    def duplicates_dropped(self) -> int:
        """Copies of a repeated id that are not indexed (`skip_lines` less the empty documents)."""
        return len(self.skip_lines) - self.num_empty


def validate_corpus(path: str, on_duplicate: str = "error", existing_ids: Container[str] = frozenset(),
                    on_empty: str = "error") -> CorpusPlan:
    """Check every line, count documents and resolve duplicate ids, without keeping the texts.

    Args:
        path: the corpus file.
        on_duplicate: "error" (default) stops at the second occurrence of an id,
            naming both lines; "skip" keeps the first occurrence; "replace" keeps the last.
        existing_ids: ids already in the index (for `add`): a collision is a duplicate too;
            with "replace" the caller must delete the old copy.  Only ``in`` is used, so a view
            that asks the index per id (`twotower.retrieval.passages.DocumentIdView`) will do.
        on_empty: "error" (default) stops at a document whose text and title are both blank,
            naming the flag that skips them; "skip" leaves them out (before the duplicate
            policy: an empty copy of an id neither counts as one nor replaces one) and counts them.
    Raises:
        DataError (a ValueError) naming file and line, or the file for an empty corpus.
    """
    if on_duplicate not in DUPLICATE_POLICIES:
        raise ValueError(f"on_duplicate={on_duplicate!r}; choose one of {DUPLICATE_POLICIES}")
    if on_empty not in EMPTY_POLICIES:
        raise ValueError(f"on_empty={on_empty!r}; choose one of {EMPTY_POLICIES}")
    existing = existing_ids
    first_line: dict[str, int] = {}
    skip: set[int] = set()
    dups = 0
    content = 0
    empty_ids: list[str] = []
    num_empty = 0
    for lineno, doc in iter_documents(path, keep_empty=True):
        doc_id = doc["id"]
        if empty := empty_document(doc_id, doc["title"], doc["text"]):
            if on_empty == "error":
                raise DataError(path, lineno, f"{empty}; {SKIP_EMPTY_HINT}", field="text")
            skip.add(lineno)
            num_empty += 1
            if len(empty_ids) < EMPTY_EXAMPLES:
                empty_ids.append(doc_id)
            continue
        content += len(doc_id) + len(doc["title"]) + len(doc["text"])
        prev = first_line.get(doc_id)
        if prev is None and doc_id not in existing:
            first_line[doc_id] = lineno
            continue
        dups += 1
        where = f"line {prev}" if prev is not None else "the index"
        if on_duplicate == "error":
            raise DataError(
                path, lineno, f"duplicate document id {doc_id!r} (already in {where}); "
                "use --on-duplicate skip|replace to choose"
            )
        if on_duplicate == "skip":
            skip.add(lineno)
        else:  # replace: the later line wins
            if prev is not None:
                skip.add(prev)
            first_line[doc_id] = lineno
    if not first_line and dups == 0:
        only = f" ({num_empty} empty documents left out by --on-empty skip)" if num_empty else ""
        raise DataError(path, None, f"corpus is empty (no documents){only}")
    return CorpusPlan(path=path, num_documents=len(first_line), num_duplicates=dups, skip_lines=skip,
                      content_bytes=content, num_empty=num_empty, empty_ids=empty_ids)


def iter_chunks(path: str, chunk_size: int, skip_lines: set[int] | None = None) -> Iterator[list[Document]]:
    """Yield lists of at most `chunk_size` documents, in file order, leaving out `skip_lines`.

    An empty document must be among `skip_lines` (`validate_corpus` with ``on_empty="skip"`` put it
    there); one that is not is an error naming its line, as `iter_documents` reports it.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    skip = skip_lines or set()
    chunk: list[Document] = []
    for lineno, doc in iter_documents(path, keep_empty=True):
        if lineno in skip:
            continue
        if empty := empty_document(doc["id"], doc["title"], doc["text"]):
            raise DataError(path, lineno, empty, field="text")
        chunk.append(doc)
        if len(chunk) == chunk_size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def duplicates_note(dropped: int, on_duplicate: str, *, into_index: bool = False) -> str:
    """What a build or an add (`into_index`: the ids may be in the index already) says about the copies it did
    not index (they were dropped without a word); a build has no index whose copy it could keep."""
    kept = ("the last copy" if on_duplicate != "skip" else
            "the first copy, or the one already in the index" if into_index else "the first copy")
    return f"{dropped:,} duplicate document{'s' if dropped != 1 else ''} not indexed: kept {kept} (on duplicate: {on_duplicate})"


def example_ids(ids: list[str], total: int) -> str:
    """The first `EMPTY_EXAMPLES` of `ids`, quoted, and "..." when `total` holds more: how a note about
    documents left out names them, so that a user can find them."""
    return ", ".join(repr(i) for i in ids[:EMPTY_EXAMPLES]) + (", ..." if total > EMPTY_EXAMPLES else "")


def empty_note(num_empty: int, empty_ids: list[str]) -> str:
    """What a build or an add says about the empty documents ``--on-empty skip`` left out: how many, and the
    first few ids (the way `duplicates_note` counts the copies not indexed)."""
    return (f"{num_empty:,} empty document{'s' if num_empty != 1 else ''} (blank 'text' and 'title') not indexed: "
            f"{example_ids(empty_ids, num_empty)} (on empty: skip)")


def resolve_duplicates(rows: list[Document], on_duplicate: str, existing: Container[str]) -> list[Document]:
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
                raise DataError(f"docs[{i}]", None, f"duplicate document id {doc_id!r} (already in {where})")
            if on_duplicate == "skip":
                continue
            if doc_id in seen:  # replace: the later copy wins
                out[seen[doc_id]] = None
        seen[doc_id] = len(out)
        out.append(d)
    return [d for d in out if d is not None]


def write_corpus_file(docs: Iterable[Mapping[str, Any]], directory: str, on_duplicate: str = "error",
                      on_empty: str = "error") -> str:
    """Validate in-memory documents (errors name ``docs[i]``) and write them to a temp JSONL in `directory`.

    Builds always read a file, twice (validate, then encode in chunks); this lets a
    list of dicts take the same path.  The caller deletes the file.  With `on_duplicate` "error" a
    repeated id is refused here, naming both ``docs[i]`` (the file's check named the temp file's lines);
    with `on_empty` "skip" an empty document is written, for `validate_corpus` to leave out and count.
    """
    records = document_records(docs, "corpus")
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=".corpus-", suffix=".jsonl", dir=directory)
    try:
        n = 0
        first: dict[str, int] = {}
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for n, d in enumerate(records, start=1):
                doc = parse_document(d, f"docs[{n - 1}]", keep_empty=on_empty == "skip")
                if on_duplicate == "error":
                    if doc["id"] in first:
                        raise DataError(f"docs[{n - 1}]", None, f"duplicate document id {doc['id']!r} (already in "
                                        f"docs[{first[doc['id']]}]); pass on_duplicate='skip' or 'replace' to choose")
                    first[doc["id"]] = n - 1
                f.write(json.dumps({"_id": doc["id"], "title": doc["title"], "text": doc["text"],
                                    "metadata": doc["metadata"]}, ensure_ascii=False) + "\n")
        if n == 0:
            raise DataError("docs", None, "no documents given (empty corpus)")
    except BaseException:
        os.unlink(path)
        raise
    return path
