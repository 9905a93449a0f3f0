"""Documents at rest in SQLite: id, title, text and a JSON metadata object.

Why SQLite: one file, transactions, random access by id and bounded-memory scans,
all from the standard library. The connection runs in autocommit mode and manages
transactions explicitly (``begin``/``commit``/``rollback``, or ``transaction()``), so
an owner such as ``IndexStore`` can stage many changes and commit them together with
other files. WAL journaling lets readers keep reading while one writer writes;
``synchronous=FULL`` makes a returned ``commit()`` durable, which the vector-file
protocol of ``IndexStore`` relies on.

Every write method is atomic on its own (a SAVEPOINT inside an open transaction), so a
rejected batch never leaves half of itself staged.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict

from twotower.indexing.errors import IndexFormatError

SCHEMA_VERSION = 1
_CHUNK = 500  # ids per "IN (...)" query, well under SQLite's bound-variable limit

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    id TEXT PRIMARY KEY NOT NULL,
    title TEXT NOT NULL DEFAULT '',
    text TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY NOT NULL, value TEXT NOT NULL);
"""


class Document(TypedDict):
    """A stored document. ``metadata`` is any JSON object."""

    id: str
    title: str
    text: str
    metadata: dict[str, Any]


def as_document(doc: Mapping[str, Any], where: str = "document") -> Document:
    """Validate a mapping into a ``Document``; accepts BEIR's ``_id`` for ``id``.

    ``title`` defaults to ``""`` and ``metadata`` to ``{}``; ``text`` is required.
    Errors name ``where`` (e.g. ``"docs[3]"``) and the field.
    """
    if not isinstance(doc, Mapping):
        raise ValueError(f"{where}: expected a mapping with id/title/text/metadata, got {type(doc).__name__}")
    doc_id = doc.get("id", doc.get("_id"))
    if not isinstance(doc_id, str) or not doc_id:
        raise ValueError(f"{where}: field 'id' must be a non-empty string, got {doc_id!r}")
    title = doc.get("title", "") or ""
    text = doc.get("text")
    metadata = doc.get("metadata") or {}
    if not isinstance(title, str):
        raise ValueError(
            f"{where} (id {doc_id!r}): field 'title' must be a string, got {type(title).__name__}"
        )
    if not isinstance(text, str):
        raise ValueError(f"{where} (id {doc_id!r}): field 'text' must be a string, got {type(text).__name__}")
    if not isinstance(metadata, Mapping):
        raise ValueError(
            f"{where} (id {doc_id!r}): field 'metadata' must be an object, got {type(metadata).__name__}"
        )
    return Document(id=doc_id, title=title, text=text, metadata=dict(metadata))


class DocStore:
    """SQLite document store (one ``.sqlite`` file).

    Args:
        path: database file; created (with parents) unless ``readonly``.
        readonly: open with ``mode=ro`` (the file must exist).

    Not shareable across threads: open one ``DocStore`` per thread.
    """

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        try:
            if readonly:
                if not self.path.is_file():
                    raise FileNotFoundError(f"{self.path}: document store not found")
                self._conn = sqlite3.connect(
                    self.path.resolve().as_uri() + "?mode=ro", uri=True, isolation_level=None
                )
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._conn = sqlite3.connect(self.path, isolation_level=None)
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA busy_timeout=10000")
            if not readonly:
                self._conn.executescript(_SCHEMA)
                if self.get_meta("docstore_schema") is None:
                    self.set_meta("docstore_schema", str(SCHEMA_VERSION))
            version = self.get_meta("docstore_schema")
        except sqlite3.DatabaseError as e:
            raise IndexFormatError(self.path, f"not a readable document store ({e})") from None
        if version is None or not version.isdigit() or int(version) > SCHEMA_VERSION:
            raise IndexFormatError(
                self.path,
                f"document store schema {version!r} is not supported (this code reads {SCHEMA_VERSION})",
            )

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the connection; an open transaction is rolled back."""
        if self._conn is not None:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            self._conn.close()
            self._conn = None  # type: ignore[assignment]

    @property
    def closed(self) -> bool:
        return self._conn is None

    def __enter__(self) -> DocStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transactions
    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction

    def begin(self, *, write: bool = True) -> None:
        """Open a transaction. ``write`` takes the write lock now (``BEGIN IMMEDIATE``);
        otherwise a read transaction is started and pinned to the current snapshot."""
        if write:
            self._conn.execute("BEGIN IMMEDIATE")
        else:
            self._conn.execute("BEGIN")
            self._conn.execute("SELECT 1 FROM meta LIMIT 1").fetchall()  # pins the WAL snapshot

    def commit(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("COMMIT")

    def rollback(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Commit on success, roll back on error; inside an open transaction it is a savepoint."""
        with self._atomic():
            yield

    @contextlib.contextmanager
    def _atomic(self) -> Iterator[None]:
        if self._conn.in_transaction:
            self._conn.execute("SAVEPOINT docstore_op")
            try:
                yield
            except BaseException:
                self._conn.execute("ROLLBACK TO docstore_op")
                self._conn.execute("RELEASE docstore_op")
                raise
            self._conn.execute("RELEASE docstore_op")
        else:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # ------------------------------------------------------------------ writes
    def add(
        self,
        docs: Iterable[Mapping[str, Any]],
        *,
        on_duplicate: Literal["error", "skip", "replace"] = "error",
    ) -> int:
        """Insert documents in one transaction; returns how many rows were inserted or replaced.

        ``on_duplicate``: ``"error"`` (ValueError naming the ids, nothing written),
        ``"skip"`` (keep the stored document) or ``"replace"`` (overwrite it in place).
        Repeated ids within one call are always an error.
        """
        if on_duplicate not in ("error", "skip", "replace"):
            raise ValueError(f"on_duplicate must be 'error', 'skip' or 'replace', got {on_duplicate!r}")
        rows = [as_document(d, f"docs[{j}]") for j, d in enumerate(docs)]
        ids = [d["id"] for d in rows]
        if len(set(ids)) != len(ids):
            seen: set[str] = set()
            dups = [i for i in ids if i in seen or seen.add(i)]
            raise ValueError(f"add: repeated id(s) within one call, e.g. {dups[:5]}")
        values = []
        for j, d in enumerate(rows):
            try:
                meta = json.dumps(d["metadata"], ensure_ascii=False, sort_keys=True, allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"docs[{j}] (id {d['id']!r}): metadata is not JSON-serialisable: {e}"
                ) from None
            values.append((d["id"], d["title"], d["text"], meta))
        sql = {
            "error": "INSERT INTO docs (id, title, text, metadata) VALUES (?, ?, ?, ?)",
            "skip": "INSERT OR IGNORE INTO docs (id, title, text, metadata) VALUES (?, ?, ?, ?)",
            "replace": "INSERT INTO docs (id, title, text, metadata) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET title=excluded.title, text=excluded.text, metadata=excluded.metadata",
        }[on_duplicate]
        with self._atomic():
            if on_duplicate == "error":
                present = [i for i, c in zip(ids, self.contains_many(ids)) if c]
                if present:
                    raise ValueError(
                        f"add: {len(present)} id(s) already stored, e.g. {present[:5]}; "
                        "pass on_duplicate='skip' or 'replace'"
                    )
            before = self._conn.total_changes
            self._conn.executemany(sql, values)
            return self._conn.total_changes - before

    def delete(self, ids: Iterable[str]) -> list[str]:
        """Delete documents; returns the ids that were not stored (input order, deduplicated)."""
        ids = list(dict.fromkeys(ids))
        with self._atomic():
            missing = [i for i, c in zip(ids, self.contains_many(ids)) if not c]
            self._conn.executemany("DELETE FROM docs WHERE id = ?", ((i,) for i in ids))
        return missing

    # ------------------------------------------------------------------ reads
    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """Documents for ``ids`` in the same order; ``None`` where an id is not stored."""
        found: dict[str, Document] = {}
        for start in range(0, len(ids), _CHUNK):
            chunk = list(dict.fromkeys(ids[start : start + _CHUNK]))
            marks = ",".join("?" * len(chunk))
            for row in self._conn.execute(
                f"SELECT id, title, text, metadata FROM docs WHERE id IN ({marks})", chunk
            ):
                found[row[0]] = _row_to_doc(row)
        return [found.get(i) for i in ids]

    def __getitem__(self, doc_id: str) -> Document:
        doc = self.get([doc_id])[0]
        if doc is None:
            raise KeyError(doc_id)
        return doc

    def contains_many(self, ids: Sequence[str]) -> list[bool]:
        """Whether each id is stored, in order (one query per 500 ids)."""
        ids = list(ids)
        present: set[str] = set()
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            present.update(
                r[0] for r in self._conn.execute(f"SELECT id FROM docs WHERE id IN ({marks})", chunk)
            )
        return [i in present for i in ids]

    def __contains__(self, doc_id: object) -> bool:
        return isinstance(doc_id, str) and self.contains_many([doc_id])[0]

    def count(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM docs").fetchone()[0])

    def __len__(self) -> int:
        return self.count()

    def iter_batches(self, batch_size: int = 1000) -> Iterator[list[Document]]:
        """All documents in insertion order, ``batch_size`` at a time (memory stays bounded).

        Pages by rowid (keyset pagination), so each page is one indexed range query.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        last = -1
        while True:
            rows = self._conn.execute(
                "SELECT rowid, id, title, text, metadata FROM docs WHERE rowid > ? ORDER BY rowid LIMIT ?",
                (last, batch_size),
            ).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield [_row_to_doc(r[1:]) for r in rows]

    def iter_ids(self, batch_size: int = 10000) -> Iterator[str]:
        """All ids in insertion order (paged like ``iter_batches``)."""
        last = -1
        while True:
            rows = self._conn.execute(
                "SELECT rowid, id FROM docs WHERE rowid > ? ORDER BY rowid LIMIT ?", (last, batch_size)
            ).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield from (r[1] for r in rows)

    # ------------------------------------------------------------------ bookkeeping
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        """A value from the small key/value table owners use for bookkeeping (e.g. generation)."""
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row is not None else default

    def set_meta(self, key: str, value: str) -> None:
        """Set a bookkeeping value (joins an open transaction, else commits at once)."""
        with self._atomic():
            self._conn.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, str(value)),
            )

    def __repr__(self) -> str:
        return f"DocStore({str(self.path)!r}, readonly={self.readonly})"


def _row_to_doc(row: Sequence[Any]) -> Document:
    return Document(id=row[0], title=row[1], text=row[2], metadata=json.loads(row[3]))
