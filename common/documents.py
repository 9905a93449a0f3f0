"""The project's one reading of a document record: what ``corpus.jsonl`` lines, the documents given to
``SearchPipeline.build`` / ``add`` and those given to ``IndexStore.add`` are checked by.

``parse_beir_document`` reads a record by BEIR's rules (``twotower.eval.io.beir``, whose module docstring
states them: ``_id`` or ``id``, an integer id as its text, ``text`` required, ``title`` and ``metadata``
optional, any other top-level key metadata too); ``check_for_index`` adds what an index needs to give a
document back intact (``twotower.retrieval.corpus``'s docstring: ids without whitespace, at most
`MAX_ID_BYTES`, no lone surrogates, JSON metadata).

Why here, below every package: the evaluation readers, the pipeline's builds and ``IndexStore.add``
(``twotower.indexing.docstore.as_document``) all read documents, and the index layer may import only
``common``; with its own copy of the rules ``IndexStore.add`` stored ``{"_id": "A", "id": "B"}`` as B
(the pipeline: A, with ``id`` metadata), turned metadata ``[]`` into ``{}``, dropped extra fields and
refused integer ids.
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from twotower.common.errors import DataError
from twotower.common.lines import is_blank, json_problem

MAX_ID_BYTES = 512  # UTF-8 bytes; MS MARCO / BEIR ids are < 40, URLs used as ids fit
MAX_METADATA_DEPTH = 32  # nesting levels; deeper is a hostile or broken record, not metadata
MAX_METADATA_INT_BITS = 64  # JSON readers elsewhere (JavaScript, SQLite) hold no wider integers


_NO_METADATA: Mapping[str, Any] = MappingProxyType({})
_RECORD_KEYS = frozenset({"_id", "id", "title", "text", "metadata"})  # every other key of a record is metadata


class BeirDocument(NamedTuple):
    doc_id: str
    title: str
    text: str
    metadata: Mapping[str, Any] = _NO_METADATA


def record_id(obj: Mapping[str, Any], path: str | os.PathLike[str], line: int | None) -> str:
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


def record_text(obj: Mapping[str, Any], path: str | os.PathLike[str], line: int | None) -> str:
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
    doc_id = record_id(obj, path, line)
    text = record_text(obj, path, line)
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


def _id_problem(doc_id: str) -> str | None:
    """Why `doc_id` cannot be an index id, or None (the fast path: printable ASCII without a space)."""
    if doc_id.isascii() and doc_id.isprintable() and " " not in doc_id:
        size = len(doc_id)
    else:
        for i, ch in enumerate(doc_id):
            if ch.isspace() or unicodedata.category(ch) == "Cc":
                return (f"document id {doc_id!r} contains whitespace or a control character ({ch!r} at "
                        f"character {i}); TREC run files separate fields by whitespace, so it could not be "
                        "evaluated: rename it (for example replace spaces with '_')")
            if unicodedata.category(ch) == "Cs":
                return (f"document id {ascii(doc_id)} holds a lone surrogate {ascii(ch)} (an unpaired \\u escape), "
                        "which is not Unicode text")
        size = len(doc_id.encode("utf-8"))
    if size > MAX_ID_BYTES:
        return f"document id of {size} bytes ({doc_id[:20]!r}...) is longer than the limit of {MAX_ID_BYTES} bytes"
    return None


def _key_problem(metadata: Mapping[str, Any]) -> str | None:
    """A metadata key a filter would misread: empty, or holding a '.' (filters read ``a.b`` as the key ``b``
    inside ``a``, so ``{"a.b": 1}`` matched no filter at all)."""
    stack: list[tuple[Mapping[str, Any], str]] = [(metadata, "metadata")]
    while stack:
        obj, where = stack.pop()
        for key, value in obj.items():
            if not key.strip():
                return f"{where} has an empty key {key!r}; a filter cannot name it"
            if "." in key:
                parts = key.split(".")
                nested = "{" + ": {".join(f'"{p}"' for p in parts) + ": ..." + "}" * len(parts)
                return (f"{where} has the key {key!r}: filters read a '.' as nesting, so it could never match; "
                        f"nest it ({nested}) or rename it")
            if isinstance(value, Mapping):
                stack.append((value, f"{where}.{key}"))
    return None


def check_for_index(doc: BeirDocument, path: str, line: int | None, strings: bool = True) -> BeirDocument:
    """Refuse a document an index could store but not give back intact (the rules of the module docstring).

    `strings=False` skips the lone-surrogate scan of text and title, for documents read by
    `json_lines`, which has already scanned every line that could decode to one.

    Raises:
        DataError naming `path` (and `line`): the id, a string field or the metadata, and what is wrong.
    """
    problem, field = _id_problem(doc.doc_id), "_id"
    if problem is None and strings:
        for field, value in (("text", doc.text), ("title", doc.title)):
            if problem := json_problem(value, f"field {field!r}"):
                break
    if problem is None and doc.metadata:
        field = "metadata"
        problem = json_problem(dict(doc.metadata), "metadata", max_depth=MAX_METADATA_DEPTH, allow_nan=False,
                               max_int_bits=MAX_METADATA_INT_BITS) or _key_problem(doc.metadata)
    if problem is not None:
        raise DataError(path, line, problem, field=field)
    return doc


def document_records(docs: Any, argument: str, paths: bool = True) -> Iterator[Any]:
    """The in-memory documents of `docs` (``SearchPipeline.build``'s corpus, ``add``'s docs and ``IndexStore.add``'s,
    which takes no path: `paths` False), each as a record for `parse_beir_document`: a mapping as it is, an ``(id,
    text)`` or ``(id, text, metadata)`` tuple (the form txtai's ``Embeddings.index`` takes) as ``{"_id", "text",
    "metadata"}``.

    Why one function: ``build`` refused a single mapping clearly while ``add({...})`` iterated its keys and said
    "docs[0]: expected a JSON object, got str"; ``IndexStore.add`` refused tuples that docs/formats.md says it reads
    as the pipeline does. `docs` itself is checked at once, before anything is read or
    written: one document (a mapping, or a tuple whose first item is an id) is refused naming `argument`, the
    caller's parameter. Items that are no document raise a `DataError` naming ``docs[i]`` as they are reached.
    """
    single = isinstance(docs, Mapping) or (isinstance(docs, tuple) and bool(docs) and isinstance(docs[0], str | int))
    if single or isinstance(docs, (str, bytes, bytearray)) or not isinstance(docs, Iterable):
        raise TypeError(f"{argument} must be {'a path or ' if paths else ''}an iterable of documents (mappings, or (id, "
                        f"text[, metadata]) tuples), got {type(docs).__name__}"
                        + ("; wrap a single document in a list" if single else ""))
    return _records(docs)


def _records(docs: Iterable[Any]) -> Iterator[Any]:
    for i, item in enumerate(docs):
        if isinstance(item, tuple):
            if len(item) not in (2, 3):
                raise DataError(f"docs[{i}]", None, "a document tuple is (id, text) or (id, text, metadata), got "
                                                   f"{len(item)} items")
            record = {"_id": item[0], "text": item[1]}
            if len(item) == 3 and item[2] is not None:
                record["metadata"] = item[2]
            yield record
        elif isinstance(item, Mapping):
            yield item
        else:
            raise DataError(f"docs[{i}]", None, "expected a document: a mapping with _id and text, or an (id, text[, "
                                               f"metadata]) tuple; got {type(item).__name__}")
