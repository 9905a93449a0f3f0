"""The docs table's passage columns: a migration for files written before them, and passage rows round-trip."""

from __future__ import annotations

import sqlite3

import pytest

from twotower.indexing.docstore import DocStore


def _old_file(path) -> None:
    """A docs.sqlite as written before passages existed (no parent / char_start / char_end)."""
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE docs (id TEXT PRIMARY KEY NOT NULL, title TEXT NOT NULL DEFAULT '', text TEXT NOT NULL,
                           metadata TEXT NOT NULL DEFAULT '{}');
        CREATE TABLE meta (key TEXT PRIMARY KEY NOT NULL, value TEXT NOT NULL);
        INSERT INTO meta VALUES ('docstore_schema', '1');
        INSERT INTO docs VALUES ('a', 'T', 'old text', '{"k": 1}');
    """)
    con.commit()
    con.close()


def test_an_old_file_reads_as_before_and_gains_the_columns_when_opened_for_writing(tmp_path):
    from twotower.indexing.docstore import _Row

    path = tmp_path / "docs.sqlite"
    _old_file(path)
    with DocStore(path, readonly=True) as ro:  # read-only: no migration, the same documents
        assert ro.get(["a"]) == [{"id": "a", "title": "T", "text": "old text", "metadata": {"k": 1}}]
        assert ro.count_documents() == (1, 0) and ro.passage_rows(["a"]) == {}
    with DocStore(path) as rw:
        cols = {r[1] for r in rw.query("PRAGMA table_info(docs)")}
        assert {"parent", "char_start", "char_end"} <= cols
        assert any(r[1] == "docs_parent" for r in rw.query("PRAGMA index_list(docs)"))
        assert rw.get(["a"])[0] == {"id": "a", "title": "T", "text": "old text", "metadata": {"k": 1}}
        rw.add([_Row(id="b\x1f0", title="", text="first half", metadata={}, parent="b", start=0, end=10),
                _Row(id="b\x1f1", title="", text="half two", metadata={}, parent="b", start=6, end=14)])
        assert rw.count_documents() == (2, 2)
        assert [r["id"] for r in rw.passage_rows(["b", "a"])["b"]] == ["b\x1f0", "b\x1f1"]
        assert rw.passage_ids(["b"]) == {"b": ["b\x1f0", "b\x1f1"]}
        assert rw.compute_digests() == rw.recorded_digests()  # the digests cover passage rows too
        rw.delete(["b\x1f0", "b\x1f1"])
        assert rw.count_documents() == (1, 0) and rw.compute_digests() == rw.recorded_digests()


def test_a_users_parent_start_and_end_are_metadata(tmp_path):
    """Any record with a `parent` was taken for a passage row: {"id": "c1", "parent": "thread-7"} was refused
    ("a passage row needs ... 'start' <= 'end'"), one with `_id` and a span said "field 'id' must be a non-empty
    string", and one with a span skipped the id and metadata checks. Only the pipeline's `Row`s are passage rows."""
    from twotower.common.errors import DataError

    with DocStore(tmp_path / "d.sqlite") as ds:
        ds.add([{"id": "c1", "text": "t", "parent": "thread-7"},
                {"_id": "c2", "text": "u", "parent": "p", "start": 0, "end": 1}])
        assert ds.get(["c1", "c2"]) == [
            {"id": "c1", "title": "", "text": "t", "metadata": {"parent": "thread-7"}},
            {"id": "c2", "title": "", "text": "u", "metadata": {"parent": "p", "start": 0, "end": 1}}]
        assert ds.count_documents() == (2, 0)  # documents, not passage rows
        with pytest.raises(DataError, match="contains whitespace"):
            ds.add([{"id": "a b", "text": "t", "parent": "p", "start": 0, "end": 1}])
        with pytest.raises(DataError, match="has the key 'a.b'"):
            ds.add([{"id": "a", "text": "t", "parent": "p", "start": 0, "end": 1, "metadata": {"a.b": 1}}])
