"""Documents at rest in SQLite: id, title, text and a JSON metadata object.

Why SQLite: one file, transactions, random access by id and bounded-memory scans,
all from the standard library. The connection runs in autocommit mode and manages
transactions explicitly (``begin``/``commit``/``rollback``, or ``transaction()``), so
an owner such as ``IndexStore`` can stage many changes and commit them together with
other files. WAL journaling lets readers keep reading while one writer writes;
``synchronous=FULL`` makes a returned ``commit()`` durable, which the vector-file
protocol of ``IndexStore`` relies on.

Every write method is atomic on its own (a SAVEPOINT inside an open transaction), so a
rejected batch never leaves half of itself staged. Every write also keeps two digests in the
``meta`` table current (``twotower.indexing.integrity``): of the stored ids and of the stored
rows, so an owner can check on open that the rows are the ones it committed.

Besides documents the database holds the commit record of an ``IndexStore``: its vector
segments (``segments``: file name, order, size, SHA-256, id digest) and the ids deleted from
them (``tombstones``); they change in the same transaction as the documents.

Thread-safe: one connection (``check_same_thread=False``) guarded by a re-entrant lock, so
threads may share a ``DocStore``; a transaction spanning several calls belongs to whoever
opened it (``IndexStore`` has one writer).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from twotower.common.documents import check_for_index, parse_beir_document, record_id
from twotower.common.errors import DataError
from twotower.common.ids import id_list
from twotower.indexing.errors import IndexDiskFullError, IndexFormatError
from twotower.indexing.filters import Filter, metadata_fields
from twotower.indexing.integrity import combine, hex64, row_key, set_digest
from twotower.indexing.passage_rows import SEPARATOR

SCHEMA_VERSION = 1
_CHUNK = 500  # ids per "IN (...)" query, well under SQLite's bound-variable limit
FIELDS_KEY = "metadata_fields"  # meta key: JSON list of the metadata field paths stored (filters check names)
# meta key: JSON {path: rows whose metadata has it}, so a delete or replace can take a field away (FIELDS_KEY
# alone only grew); FIELDS_KEY is kept equal to its keys, for older versions and to notice their writes
FIELD_COUNTS_KEY = "metadata_field_counts"
# meta key: the ``docs_digest`` the counts were made at. Every version changes that digest at every write, so a
# write by a version that does not count (an older twotower) leaves the counts visibly stale: they are made
# again by a scan instead of drifting (a delete then took a field another document still had to 0)
FIELD_COUNTS_AT_KEY = "metadata_field_counts_at"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS docs (
    id TEXT PRIMARY KEY NOT NULL,
    title TEXT NOT NULL DEFAULT '',
    text TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY NOT NULL, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS segments (
    name TEXT PRIMARY KEY NOT NULL,
    seq INTEGER NOT NULL,
    stored INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    sha256 TEXT NOT NULL,
    ids_digest TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tombstones (
    segment TEXT NOT NULL,
    id TEXT NOT NULL,
    PRIMARY KEY (segment, id)
);
"""


class Document(TypedDict):
    """A stored document. ``metadata`` is any JSON object.

    A *passage row* (a window of a long document, ``twotower.retrieval.passages``) also has
    ``parent`` (the document's id) and ``start``/``end`` (its span in the document's text);
    a document rebuilt from its passages has ``passages`` (their ``[start, end]``).
    """

    id: str
    title: str
    text: str
    metadata: dict[str, Any]
    parent: NotRequired[str]
    start: NotRequired[int]
    end: NotRequired[int]
    passages: NotRequired[list[list[int]]]


class _Row(dict):  # type: ignore[type-arg]
    """A `Document` the pipeline has read and checked already: made by its readers (``twotower.retrieval.corpus``),
    by `_checked_row`, or a passage row of the pipeline's (``parent``, ``start``/``end``:
    ``twotower.retrieval.passages``). `DocStore.add` and ``IndexStore._add_rows`` give it only `_row_types`'s
    cheap look; nothing public hands one out (`as_document` returns a plain dict).

    Why a type, not a field: a build checked every document three times (its reader, ``IndexStore.add``,
    ``DocStore.add``: 1.28 s against 0.245 s a pass over 50k documents), and any record with a ``parent``
    field was taken for a passage row (refused, or stored past the id and metadata checks); a user's
    ``parent`` is metadata, and only the pipeline makes rows. Why private: a public row type let any caller
    skip every check (an id ``"a b"``, an orphan passage row).
    """

    __slots__ = ()


ID_SHOWN = 40  # characters of an id an error names (a 1 MB id made a 1 MB message)


def _where(doc: Any, where: str) -> str:
    """`where` with the record's id, where it has one (``docs[1] (id 'b')``), cut to `ID_SHOWN` characters; built
    only for an error (every document paid for it, and a whole long id was repeated)."""
    if not isinstance(doc, Mapping):
        return where
    try:
        key = record_id(doc, where, None)
    except DataError:
        return where
    cut = f"{key[:ID_SHOWN]!r}..." if len(key) > ID_SHOWN else repr(key)
    return f"{where} (id {cut})"


def _checked_row(doc: Mapping[str, Any], where: str) -> _Row:
    """`doc` read and checked by `as_document`'s rules, as a `_Row` (which the index layer does not check again)."""
    try:
        rec = check_for_index(parse_beir_document(doc, where), where, None)
    except DataError as e:
        raise DataError(_where(doc, where), None, e.message, field=e.field) from None
    return _Row(id=rec.doc_id, title=rec.title, text=rec.text, metadata=dict(rec.metadata))


def _row_types(row: _Row, where: str) -> _Row:
    """The cheap look the index layer gives a row the pipeline checked (`_Row`): the types SQLite and the vector
    index need, so that a slip in the pipeline is a TypeError, not a row stored wrong."""
    if not (isinstance(row.get("id"), str) and isinstance(row.get("title"), str) and isinstance(row.get("text"), str)
            and isinstance(row.get("metadata"), dict)):
        raise TypeError(f"{where}: a checked row needs string 'id', 'title' and 'text' and a dict 'metadata', got "
                        f"{ {k: type(v).__name__ for k, v in row.items()} }")
    return row


def _index_rows(docs: Iterable[Mapping[str, Any]]) -> list[_Row]:
    """`docs` as rows to store: a `_Row` (the pipeline's, checked already) by `_row_types`, any other record by
    `_checked_row` (``docs[j]`` naming it)."""
    return [_row_types(d, f"docs[{j}]") if isinstance(d, _Row) else _checked_row(d, f"docs[{j}]")
            for j, d in enumerate(docs)]


def _not_passage_row(doc: Any, where: str) -> Any:
    """`doc`, unless it is a passage row read back from a passage index (``get(["doc\\x1f0"])``: ``parent``
    and a ``<doc id>\\x1f<n>`` id). Why: its id was refused as a TREC id with whitespace ("rename it"),
    misleading for an id the pipeline made; only the pipeline writes passage rows."""
    if isinstance(doc, Mapping) and doc.get("parent") is not None:
        key = doc.get("_id") if doc.get("_id") is not None else doc.get("id")
        if isinstance(key, str) and SEPARATOR in key:
            raise DataError(_where(doc, where), None,
                            f"a passage row (a window of document {str(doc['parent'])[:ID_SHOWN]!r}), which only "
                            "the pipeline writes: add the whole document through SearchPipeline.add, which splits it",
                            field="_id")
    return doc


def as_document(doc: Mapping[str, Any], where: str = "document") -> Document:
    """Validate a record into a ``Document`` (a plain dict) by the rules ``SearchPipeline.build`` and ``add`` read
    documents by (`twotower.common.documents`, [formats](docs/formats.md), Corpus).

    ``_id`` (or, without one, ``id``; beside an ``_id`` an ``id`` is metadata), an integer id as its decimal
    text; ``text`` required; ``title`` and ``metadata`` (an object) optional; any other top-level field
    (``parent``, ``start`` and ``end`` too) is metadata; ids and metadata must be ones an index can give back
    (`check_for_index`). A blank document is accepted here: leaving such documents out is the pipeline's
    ``on_empty`` policy. Errors are ``DataError`` (a ValueError) naming ``where`` (e.g. ``"docs[3]"``), the
    record's id where it has one, and the field.

    Why one reading: with its own rules ``IndexStore.add`` stored ``{"_id": "A", "id": "B"}`` as B where the
    pipeline stored A, turned metadata ``[]`` into ``{}``, dropped extra fields and refused integer ids.
    """
    return dict(_checked_row(doc, where))  # type: ignore[return-value]


_PASSAGE_COLUMNS = ("parent", "char_start", "char_end")


def _locked(method):
    """Run a DocStore method holding the store's lock (one connection shared by threads)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


def readonly_uri(path: Path) -> str:
    """The URI that opens `path` read-only: ``mode=ro``, plus ``immutable=1`` where its directory cannot be written.

    Why: a WAL database read with ``mode=ro`` needs its ``-shm`` file, which SQLite creates beside it; after a
    clean close there is none, so on read-only storage (or for a user without write permission) the open
    failed with "unable to open database file". ``immutable=1`` (SQLite's answer for read-only media) reads
    the file without that index or any lock, which is safe only while nobody writes it: it is used only
    when this process cannot write the directory and no write-ahead log is waiting (``immutable`` would
    ignore one, and a log means a writer with write access is, or was, at work: its ``-shm`` is there too).
    """
    uri = path.resolve().as_uri() + "?mode=ro"
    wal = path.with_name(path.name + "-wal")
    if not os.access(path.parent, os.W_OK) and not (wal.exists() and wal.stat().st_size > 0):
        uri += "&immutable=1"
    return uri


class DocStore:
    """SQLite document store (one ``.sqlite`` file).

    Args:
        path: database file; created (with parents) unless ``readonly``.
        readonly: open with ``mode=ro`` (the file must exist; see ``readonly_uri``).

    Shareable across threads (calls are serialised by a lock; see the module docstring).
    """

    def __init__(self, path: str | Path, *, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        self._lock = threading.RLock()
        self._scanned_fields: tuple[str | None, set[str]] | None = None  # (docs_digest, fields) of a scan
        try:
            if readonly:
                if not self.path.is_file():
                    raise FileNotFoundError(f"{self.path}: document store not found")
                self._conn = sqlite3.connect(readonly_uri(self.path), uri=True, isolation_level=None,
                                             check_same_thread=False)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA busy_timeout=10000")
            if not readonly:
                self._conn.executescript(_SCHEMA)
                self._add_passage_columns()
                if self.get_meta("docstore_schema") is None:
                    self.set_meta("docstore_schema", str(SCHEMA_VERSION))
            version = self.get_meta("docstore_schema")
            has = {r[1] for r in self._conn.execute("PRAGMA table_info(docs)")} >= set(_PASSAGE_COLUMNS)
            self._columns = "id, title, text, metadata" + (", parent, char_start, char_end" if has else "")
        except sqlite3.DatabaseError as e:
            if not readonly and _disk_is_full(self.path.parent):
                # SQLite reports a full disk at open as "disk I/O error" (it cannot create the WAL files)
                raise IndexDiskFullError(
                    errno.ENOSPC, f"{self.path.parent}: no space left on device while opening the index for "
                    f"writing; nothing was changed. Free some space and run the command again.") from None
            raise IndexFormatError(self.path, f"not a readable document store ({e})") from None
        if version is None or not version.isdigit() or int(version) > SCHEMA_VERSION:
            raise IndexFormatError(
                self.path,
                f"document store schema {version!r} is not supported (this code reads {SCHEMA_VERSION})",
            )

    def _add_passage_columns(self) -> None:
        """Migration: the passage columns (NULL for whole documents) and their index, added to older files."""
        have = {r[1] for r in self._conn.execute("PRAGMA table_info(docs)")}
        for name, kind in zip(_PASSAGE_COLUMNS, ("TEXT", "INTEGER", "INTEGER")):
            if name not in have:
                self._conn.execute(f"ALTER TABLE docs ADD COLUMN {name} {kind}")
        self._conn.execute("CREATE INDEX IF NOT EXISTS docs_parent ON docs(parent)")

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Close the connection; an open transaction is rolled back."""
        with self._lock:
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

    @_locked
    def begin(self, *, write: bool = True) -> None:
        """Open a transaction. ``write`` takes the write lock now (``BEGIN IMMEDIATE``);
        otherwise a read transaction is started and pinned to the current snapshot."""
        if write:
            self._conn.execute("BEGIN IMMEDIATE")
        else:
            self._conn.execute("BEGIN")
            self._conn.execute("SELECT 1 FROM meta LIMIT 1").fetchall()  # pins the WAL snapshot

    @_locked
    def commit(self) -> None:
        if self._conn.in_transaction:
            self._conn.execute("COMMIT")

    @_locked
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
        with self._lock:
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
        rows = _index_rows(docs)
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
            values.append((d["id"], d["title"], d["text"], meta, d.get("parent"), d.get("start"), d.get("end")))
        cols = "INTO docs (id, title, text, metadata, parent, char_start, char_end) VALUES (?, ?, ?, ?, ?, ?, ?)"
        sql = {
            "error": f"INSERT {cols}",
            "skip": f"INSERT OR IGNORE {cols}",
            "replace": f"INSERT {cols} ON CONFLICT(id) DO UPDATE SET title=excluded.title, text=excluded.text, "
            "metadata=excluded.metadata, parent=excluded.parent, char_start=excluded.char_start, "
            "char_end=excluded.char_end",
        }[on_duplicate]
        with self._atomic():
            present_flags = self.contains_many(ids)
            present = [i for i, c in zip(ids, present_flags) if c]
            if on_duplicate == "error" and present:
                raise ValueError(
                    f"add: {len(present)} id(s) already stored, e.g. {present[:5]}; "
                    "pass on_duplicate='skip' or 'replace'"
                )
            old = [d for d in self.get(present) if d is not None] if on_duplicate == "replace" else []
            counted_at = self.get_meta("docs_digest")  # before this write: what valid counts were made at
            written = [v for v, c in zip(values, present_flags) if not c or on_duplicate == "replace"]
            new_ids = [v[0] for v, c in zip(values, present_flags) if not c]
            before = self._conn.total_changes
            self._conn.executemany(sql, values)
            changed = self._conn.total_changes - before
            self._update_digests(
                add_ids=new_ids, add_rows=[_key_of(v) for v in written], drop_rows=[row_key(d) for d in old]
            )
            self._record_fields([d["metadata"] for d, c in zip(rows, present_flags)
                                 if not c or on_duplicate == "replace"], [d["metadata"] for d in old], counted_at)
            return changed

    def delete(self, ids: Iterable[str]) -> list[str]:
        """Delete documents; returns the ids that were not stored (input order, deduplicated).
        A bare string is refused (`twotower.common.ids.id_list`): it deleted one document per character."""
        ids = list(dict.fromkeys(id_list(ids, "delete")))
        with self._atomic():
            docs = self.get(ids)
            counted_at = self.get_meta("docs_digest")
            missing = [i for i, d in zip(ids, docs) if d is None]
            self._conn.executemany("DELETE FROM docs WHERE id = ?", ((i,) for i in ids))
            gone = [d for d in docs if d is not None]
            self._update_digests(drop_ids=[d["id"] for d in gone], drop_rows=[row_key(d) for d in gone])
            self._record_fields([], [d["metadata"] for d in gone], counted_at)
        return missing

    # ------------------------------------------------------------------ digests
    def _update_digests(self, add_ids: Sequence[str] = (), drop_ids: Sequence[str] = (),
                        add_rows: Sequence[str] = (), drop_rows: Sequence[str] = ()) -> None:
        """Keep ``ids_digest`` / ``docs_digest`` in ``meta`` equal to the digests of what is stored (O(change))."""
        ids_d, docs_d = self.recorded_digests()
        if ids_d is None or docs_d is None:  # a store written before digests existed: compute them once
            ids_d, docs_d = self.compute_digests()
        else:
            ids_d = combine(ids_d, set_digest(add_ids), minus=[set_digest(drop_ids)])
            docs_d = combine(docs_d, set_digest(add_rows), minus=[set_digest(drop_rows)])
        self.set_meta("ids_digest", hex64(ids_d))
        self.set_meta("docs_digest", hex64(docs_d))

    def recorded_digests(self) -> tuple[int | None, int | None]:
        """The ``(ids, rows)`` digests recorded at the last write (None before any write recorded them)."""
        ids_d, docs_d = self.get_meta("ids_digest"), self.get_meta("docs_digest")
        return (int(ids_d, 16) if ids_d else None), (int(docs_d, 16) if docs_d else None)

    @_locked
    def ids_digest_now(self) -> int:
        """Digest of the ids stored now (one pass over the ids; the cheap check on open)."""
        return set_digest(r[0] for r in self._conn.execute("SELECT id FROM docs"))

    @_locked
    def compute_digests(self) -> tuple[int, int]:
        """Digests of the ids and rows stored now (one pass over every row; ``twotower index check``)."""
        ids_d = rows_d = 0
        for batch in self.iter_batches(5000):
            ids_d = combine(ids_d, set_digest(d["id"] for d in batch))
            rows_d = combine(rows_d, set_digest(row_key(d) for d in batch))
        return ids_d, rows_d

    # ------------------------------------------------------------------ the vector commit record
    @_locked
    def segment_rows(self) -> list[dict[str, Any]] | None:
        """The committed vector segments in order, or None for a store written before segments existed."""
        try:
            cur = self._conn.execute(
                "SELECT name, seq, stored, bytes, sha256, ids_digest FROM segments ORDER BY seq"
            )
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return None
            raise
        cols = [c[0] for c in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]

    @_locked
    def tombstone_ids(self) -> dict[str, list[str]]:
        """Ids deleted from each committed segment: ``{segment name: [ids]}``."""
        try:
            rows = self._conn.execute("SELECT segment, id FROM tombstones ORDER BY segment, id").fetchall()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return {}
            raise
        out: dict[str, list[str]] = {}
        for seg, i in rows:
            out.setdefault(seg, []).append(i)
        return out

    def record_segments(self, add: Sequence[Mapping[str, Any]] = (), drop: Sequence[str] = (),
                        tombstones: Iterable[tuple[str, str]] = ()) -> None:
        """Change the commit record: add segment rows, drop segments (with their tombstones), add tombstones."""
        with self._atomic():
            for name in drop:
                self._conn.execute("DELETE FROM segments WHERE name = ?", (name,))
                self._conn.execute("DELETE FROM tombstones WHERE segment = ?", (name,))
            self._conn.executemany(
                "INSERT INTO segments (name, seq, stored, bytes, sha256, ids_digest) VALUES (?, ?, ?, ?, ?, ?)",
                [(r["name"], r["seq"], r["stored"], r["bytes"], r["sha256"], r["ids_digest"]) for r in add],
            )
            self._conn.executemany("INSERT OR IGNORE INTO tombstones (segment, id) VALUES (?, ?)", list(tombstones))

    # ------------------------------------------------------------------ reads
    @_locked
    def get(self, ids: Sequence[str]) -> list[Document | None]:
        """Documents for ``ids`` in the same order; ``None`` where an id is not stored (a bare string is
        refused, as in `delete`)."""
        ids = id_list(ids, "get")
        found: dict[str, Document] = {}
        for start in range(0, len(ids), _CHUNK):
            chunk = list(dict.fromkeys(ids[start : start + _CHUNK]))
            marks = ",".join("?" * len(chunk))
            for row in self._conn.execute(
                f"SELECT {self._columns} FROM docs WHERE id IN ({marks})", chunk
            ):
                found[row[0]] = _row_to_doc(row)
        return [found.get(i) for i in ids]

    def __getitem__(self, doc_id: str) -> Document:
        doc = self.get([doc_id])[0]
        if doc is None:
            raise KeyError(doc_id)
        return doc

    @_locked
    def contains_many(self, ids: Sequence[str]) -> list[bool]:
        """Whether each id is stored, in order (one query per 500 ids; a bare string is refused, as in `delete`)."""
        ids = id_list(ids, "contains_many")
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

    @_locked
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
            with self._lock:
                rows = self._conn.execute(
                    f"SELECT rowid, {self._columns} FROM docs WHERE rowid > ? ORDER BY rowid LIMIT ?",
                    (last, batch_size),
                ).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield [_row_to_doc(r[1:]) for r in rows]

    # ------------------------------------------------------------------ passages (retrieval.passages)
    @_locked
    def passage_rows(self, parents: Sequence[str]) -> dict[str, list[Document]]:
        """The passage rows of each split document among `parents` (absent when it has none), by start."""
        out: dict[str, list[Document]] = {}
        if "parent" not in self._columns:
            return out
        for start in range(0, len(parents), _CHUNK):
            chunk = list(dict.fromkeys(parents[start : start + _CHUNK]))
            marks = ",".join("?" * len(chunk))
            for row in self._conn.execute(
                f"SELECT {self._columns} FROM docs WHERE parent IN ({marks}) ORDER BY parent, char_start", chunk
            ):
                out.setdefault(row[4], []).append(_row_to_doc(row))
        return out

    @_locked
    def passage_ids(self, parents: Sequence[str]) -> dict[str, list[str]]:
        """The passage row ids of each split document among `parents` (absent when it has none)."""
        out: dict[str, list[str]] = {}
        if "parent" not in self._columns:
            return out
        for start in range(0, len(parents), _CHUNK):
            chunk = list(dict.fromkeys(parents[start : start + _CHUNK]))
            marks = ",".join("?" * len(chunk))
            for parent, i in self._conn.execute(
                f"SELECT parent, id FROM docs WHERE parent IN ({marks}) ORDER BY parent, char_start", chunk
            ):
                out.setdefault(parent, []).append(i)
        return out

    def iter_passage_groups(self, batch_size: int = _CHUNK) -> Iterator[tuple[str, list[dict[str, Any]]]]:
        """Each split document's passage rows (``id``, ``start``, ``end``; no text), one document at a time.

        Pages by document id (`batch_size` documents a query), so memory stays bounded and no lock is
        held between pages; ``twotower index check`` rebuilds nothing, it only needs the spans.
        """
        if "parent" not in self._columns:
            return
        last = ""  # every id sorts after "" (ids are not empty)
        while True:
            with self._lock:
                parents = [r[0] for r in self._conn.execute(
                    "SELECT DISTINCT parent FROM docs WHERE parent > ? ORDER BY parent LIMIT ?", (last, batch_size))]
                if not parents:
                    return
                marks = ",".join("?" * len(parents))
                rows = self._conn.execute(
                    f"SELECT parent, id, char_start, char_end FROM docs WHERE parent IN ({marks}) ORDER BY parent",
                    parents).fetchall()
            groups: dict[str, list[dict[str, Any]]] = {}
            for parent, i, start, end in rows:
                groups.setdefault(parent, []).append({"id": i, "start": start, "end": end})
            yield from groups.items()
            last = parents[-1]

    @_locked
    def count_documents(self) -> tuple[int, int]:
        """(documents, passage rows): a split document counts once, however many passages it has."""
        if "parent" not in self._columns:
            return self.count(), 0
        whole, passages, parents = self._conn.execute(
            "SELECT COUNT(*) - COUNT(parent), COUNT(parent), COUNT(DISTINCT parent) FROM docs").fetchone()
        return int(whole) + int(parents), int(passages)

    def iter_ids(self, batch_size: int = 10000) -> Iterator[str]:
        """All ids in insertion order (paged like ``iter_batches``)."""
        last = -1
        while True:
            with self._lock:
                rows = self._conn.execute(
                    "SELECT rowid, id FROM docs WHERE rowid > ? ORDER BY rowid LIMIT ?", (last, batch_size)
                ).fetchall()
            if not rows:
                return
            last = rows[-1][0]
            yield from (r[1] for r in rows)

    # ------------------------------------------------------------------ owners' own tables
    @_locked
    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        """Rows of a read query on an owner's bookkeeping table (e.g. the Milvus backend's keys)."""
        return self._conn.execute(sql, params).fetchall()

    def write(self, sql: str, rows: Iterable[Sequence[Any]] | None = None) -> None:
        """Run a statement once (``rows`` None: DDL too) or once per row of parameters, atomically
        (joins an open transaction)."""
        with self._atomic():
            if rows is None:
                self._conn.execute(sql)
            else:
                self._conn.executemany(sql, rows)

    # ------------------------------------------------------------------ metadata fields and filters
    def _record_fields(self, added: Iterable[Mapping[str, Any]], removed: Iterable[Mapping[str, Any]],
                       counted_at: str | None) -> None:
        """Count the field paths of metadata just written (``added``) or deleted / replaced (``removed``) in the
        ``metadata_field_counts`` meta key (same transaction, after the rows and digests changed), so that the
        fields a filter may name are those some stored document has: an index changed by adds and deletes
        accepts the filters a rebuild of its documents accepts. `counted_at`: ``docs_digest`` before this
        write; counts made at another (none yet, or a write by a version that does not count) are made again
        by a scan. O(change) otherwise, plus the digest the counts are now at."""
        delta: Counter[str] = Counter()
        for md in added:
            if md:
                delta.update(metadata_fields(md))
        for md in removed:
            if md:
                delta.subtract(metadata_fields(md))
        counts = self._stored_counts(counted_at)
        if counts is None and not any(delta.values()) and self.get_meta(FIELD_COUNTS_KEY) is None:
            return  # a store written before the counts, unchanged in its fields: its list stays as it is
        if counts is None:  # the rows already hold this change: the scan counts it
            counts = self._scan_fields()
        elif any(delta.values()):
            counts.update(delta)
        else:  # the same fields: only the digest they are at moves
            self.set_meta(FIELD_COUNTS_AT_KEY, self.get_meta("docs_digest") or "")
            return
        counts = Counter({path: n for path, n in counts.items() if n > 0})
        self.set_meta(FIELD_COUNTS_KEY, json.dumps(dict(sorted(counts.items())), ensure_ascii=False))
        self.set_meta(FIELDS_KEY, json.dumps(sorted(counts), ensure_ascii=False))
        self.set_meta(FIELD_COUNTS_AT_KEY, self.get_meta("docs_digest") or "")

    def _stored_counts(self, at: str | None) -> Counter[str] | None:
        """The recorded field counts if they were made at ``docs_digest`` `at`, else None (missing, or stale:
        a write by a version that does not count them changed the documents since)."""
        value = self.get_meta(FIELD_COUNTS_KEY)
        if value is None or self.get_meta(FIELD_COUNTS_AT_KEY) != (at or ""):
            return None
        return Counter(json.loads(value))

    @_locked
    def _scan_fields(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (meta,) in self._conn.execute("SELECT metadata FROM docs WHERE metadata != '{}'"):
            out.update(metadata_fields(json.loads(meta)))
        return out

    @_locked
    def metadata_fields(self) -> set[str]:
        """Dotted paths of the metadata values some stored document has (``source.name``).

        Counted at each write in the same transaction. A store written before the counts uses the older list
        of fields ever added (a superset after deletes) until its next write; one whose counts are stale (an
        older twotower wrote since) is scanned, once per connection and commit, until its next write.
        """
        at = self.get_meta("docs_digest")
        counts = self._stored_counts(at)
        if counts is not None:
            return set(counts)
        if (listed := self.get_meta(FIELDS_KEY)) is not None and self.get_meta(FIELD_COUNTS_KEY) is None:
            return set(json.loads(listed))
        if self._scanned_fields is None or self._scanned_fields[0] != at:
            self._scanned_fields = (at, set(self._scan_fields()))
        return set(self._scanned_fields[1])

    @_locked
    def matching_ids(self, flt: Filter) -> list[str]:
        """Ids of the rows whose metadata passes `flt`, in insertion order (one SQL scan, ids only).

        Raises ``FilterError`` naming a field the store has never seen (with the known fields).
        """
        flt.check_fields(self.metadata_fields())
        where, params = flt.to_sql("metadata")
        return [r[0] for r in self._conn.execute(f"SELECT id FROM docs WHERE {where} ORDER BY rowid", params)]

    # ------------------------------------------------------------------ bookkeeping
    @_locked
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


def _key_of(values: tuple) -> str:
    """``row_key`` of an ``(id, title, text, metadata JSON, parent, start, end)`` tuple as it is inserted."""
    return row_key({"id": values[0], "title": values[1], "text": values[2], "metadata": values[3],
                    "parent": values[4], "start": values[5], "end": values[6]})


def _row_to_doc(row: Sequence[Any]) -> Document:
    doc = Document(id=row[0], title=row[1], text=row[2], metadata=json.loads(row[3]))
    if len(row) > 4 and row[4] is not None:
        doc.update(parent=row[4], start=row[5], end=row[6])
    return doc


def _disk_is_full(directory: Path, reserve: int = 64 * 1024) -> bool:
    """Whether the filesystem holding `directory` has less than `reserve` bytes left for us."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < reserve
