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
        rw.add([{"id": "b\x1f0", "title": "", "text": "first half", "parent": "b", "start": 0, "end": 10},
                {"id": "b\x1f1", "title": "", "text": "half two", "parent": "b", "start": 6, "end": 14}])
        assert rw.count_documents() == (2, 2)
        assert [r["id"] for r in rw.passage_rows(["b", "a"])["b"]] == ["b\x1f0", "b\x1f1"]
        assert rw.passage_ids(["b"]) == {"b": ["b\x1f0", "b\x1f1"]}
        assert rw.compute_digests() == rw.recorded_digests()  # the digests cover passage rows too
        rw.delete(["b\x1f0", "b\x1f1"])
        assert rw.count_documents() == (1, 0) and rw.compute_digests() == rw.recorded_digests()


def test_a_passage_row_needs_its_parent_and_span(tmp_path):
    with DocStore(tmp_path / "d.sqlite") as ds, pytest.raises(ValueError, match="passage row"):
        ds.add([{"id": "x\x1f0", "text": "t", "parent": "x", "start": 5, "end": 2}])
