import sqlite3

import pytest

from twotower.common.errors import DataError
from twotower.indexing import DocStore, IndexFormatError, as_document


def make(n, start=0):
    return [
        {"id": f"d{i}", "title": f"T{i}", "text": f"text {i}", "metadata": {"n": i}}
        for i in range(start, start + n)
    ]


@pytest.fixture
def store(tmp_path):
    with DocStore(tmp_path / "docs.sqlite") as s:
        yield s


def test_add_get_preserves_order_and_reports_missing(store):
    assert store.add(make(1200)) == 1200  # > one IN(...) chunk
    ids = ["d1100", "nope", "d3", "d3", "d599"]
    got = store.get(ids)
    assert [g and g["id"] for g in got] == ["d1100", None, "d3", "d3", "d599"]
    assert got[0] == {"id": "d1100", "title": "T1100", "text": "text 1100", "metadata": {"n": 1100}}
    assert store.count() == len(store) == 1200
    assert "d5" in store and "zz" not in store
    assert store.contains_many(["d0", "x", "d1199"]) == [True, False, True]
    assert store["d7"]["text"] == "text 7"
    with pytest.raises(KeyError):
        store["zz"]


def test_beir_style_id_and_defaults(store):
    store.add([{"_id": "b1", "text": "body"}])
    assert store["b1"] == {"id": "b1", "title": "", "text": "body", "metadata": {}}


def test_unicode_and_nested_metadata_round_trip(store):
    doc = {
        "id": "ü/1",
        "title": "Café",
        "text": "naïve 中文",
        "metadata": {"tags": ["a", "β"], "x": {"y": 1.5}},
    }
    store.add([doc])
    assert store["ü/1"] == doc


def test_duplicate_policies_are_atomic(store):
    store.add(make(3))
    with pytest.raises(ValueError, match=r"already stored.*d1"):
        store.add(make(2, start=1) + make(1, start=10))  # d1, d2 exist; d10 is new
    assert "d10" not in store and store.count() == 3  # nothing of the refused batch landed
    assert store.add(make(2, start=2), on_duplicate="skip") == 1  # d3 added, d2 kept
    store.add([{"id": "d0", "title": "new", "text": "replaced"}], on_duplicate="replace")
    assert store["d0"]["text"] == "replaced" and store.count() == 4
    assert next(store.iter_ids()) == "d0"  # replace keeps the row (and its order)
    with pytest.raises(ValueError, match="repeated id"):
        store.add([{"id": "q", "text": ""}, {"id": "q", "text": ""}])


def test_bad_documents_name_the_field(store):
    with pytest.raises(DataError, match=r"^docs\[1\] \(id 'b'\): missing string field 'text' \(got int\)"):
        store.add([{"id": "a", "text": "ok"}, {"id": "b", "text": 3}])
    with pytest.raises(DataError, match=r"^docs\[0\]: missing field '_id'"):
        store.add([{"text": "no id"}])
    with pytest.raises(DataError, match=r"^docs\[0\] \(id 'm'\): metadata"):
        store.add([{"id": "m", "text": "", "metadata": {"f": object()}}])
    with pytest.raises(ValueError, match="'metadata' must be an object"):
        as_document({"id": "m", "text": "", "metadata": [1]})
    assert store.count() == 0


def test_delete_reports_missing(store):
    store.add(make(5))
    assert store.delete(["d1", "x", "d3", "d1"]) == ["x"]
    assert store.contains_many(["d1", "d3", "d0"]) == [False, False, True]


def test_iter_batches_is_bounded_and_complete(store):
    store.add(make(25))
    store.delete(["d4"])
    batches = list(store.iter_batches(batch_size=7))
    assert [len(b) for b in batches] == [7, 7, 7, 3]
    assert [d["id"] for b in batches for d in b] == [f"d{i}" for i in range(25) if i != 4]
    assert list(store.iter_ids(batch_size=4)) == [f"d{i}" for i in range(25) if i != 4]
    with pytest.raises(ValueError):
        next(store.iter_batches(0))


def test_explicit_transaction_rollback_and_savepoint(store):
    store.add(make(2))
    store.begin()
    store.add(make(2, start=5))
    with pytest.raises(ValueError):
        store.add(make(1, start=5))  # refused inside the transaction: only this op is undone
    assert store.count() == 4
    store.rollback()
    assert store.count() == 2
    with store.transaction():
        store.add(make(1, start=9))
    assert "d9" in store
    with pytest.raises(RuntimeError), store.transaction():
        store.add(make(1, start=11))
        raise RuntimeError("boom")
    assert "d11" not in store


def test_wal_readers_see_committed_state_only(tmp_path):
    path = tmp_path / "docs.sqlite"
    writer = DocStore(path)
    writer.add(make(2))
    assert writer._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    reader = DocStore(path, readonly=True)
    writer.begin()
    writer.add(make(3, start=10))
    assert reader.count() == 2  # uncommitted rows invisible
    reader.begin(write=False)  # pin snapshot
    writer.commit()
    assert reader.count() == 2  # still the pinned snapshot
    reader.rollback()
    assert reader.count() == 5
    with pytest.raises(sqlite3.OperationalError):
        reader.add(make(1, start=99))
    reader.close()
    writer.close()


def test_meta_and_errors(tmp_path):
    with DocStore(tmp_path / "a.sqlite") as s:
        assert s.get_meta("generation") is None
        s.set_meta("generation", "3")
        assert s.get_meta("generation") == "3"
    (tmp_path / "junk.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(IndexFormatError, match="junk.sqlite"):
        DocStore(tmp_path / "junk.sqlite")
    with pytest.raises(FileNotFoundError, match="missing.sqlite"):
        DocStore(tmp_path / "missing.sqlite", readonly=True)
    with DocStore(tmp_path / "future.sqlite") as s:
        s.set_meta("docstore_schema", "99")
    with pytest.raises(IndexFormatError, match="future.sqlite.*schema '99'"):
        DocStore(tmp_path / "future.sqlite")


def test_readonly_open_works_on_read_only_storage(tmp_path):
    """A cleanly closed WAL database has no -shm file, which ``mode=ro`` alone needed to create ("unable to
    open database file"); a write-ahead log still waiting must be read, not skipped as ``immutable`` would."""
    import sys

    from .helpers import run_read_only

    with DocStore(tmp_path / "docs.sqlite") as s:
        s.add(make(3))
    read = (f"{sys.executable} -c \"from twotower.indexing import DocStore; "
            f"print(DocStore('{tmp_path / 'docs.sqlite'}', readonly=True).count())\"")
    res = run_read_only(tmp_path, read)
    assert (res.returncode, res.stdout.strip()) == (0, "3"), res.stderr
    writer = sqlite3.connect(tmp_path / "docs.sqlite", isolation_level=None)
    try:  # a writer's log, not checkpointed into the file yet
        writer.execute("PRAGMA wal_autocheckpoint=0")
        writer.execute("INSERT INTO docs (id, title, text, metadata) VALUES ('late', '', 'x', '{}')")
        res = run_read_only(tmp_path, read)
    finally:
        writer.close()
    assert (res.returncode, res.stdout.strip()) == (0, "4"), res.stderr


def test_documents_are_read_by_the_pipelines_rules():
    """IndexStore.add had rules of its own: `{"_id": "A", "id": "B"}` stored B (the pipeline: A, with `id` as
    metadata), metadata `[]` or `""` became `{}` while `[1]` was refused, other top-level fields were dropped,
    integer ids refused, and the errors were plain ValueErrors, not the documented DataError."""
    assert as_document({"_id": "A", "id": "B", "text": "t"}) == \
        {"id": "A", "title": "", "text": "t", "metadata": {"id": "B"}}
    assert as_document({"id": "a", "text": "t", "lang": "en", "metadata": {"year": 2001}})["metadata"] == \
        {"year": 2001, "lang": "en"}
    assert as_document({"id": 7, "text": "t", "title": None})["id"] == "7"
    for bad in ([], "", [1], "tag1 tag2"):
        with pytest.raises(DataError, match=r"^docs\[2\] \(id 'm'\): field 'metadata' must be an object"):
            as_document({"id": "m", "text": "t", "metadata": bad}, "docs[2]")
    with pytest.raises(DataError, match="contains whitespace"):
        as_document({"id": "a b", "text": "t"})
    with pytest.raises(DataError, match="both a top-level field and a key of 'metadata'"):
        as_document({"id": "a", "text": "t", "lang": "en", "metadata": {"lang": "fr"}})


def test_as_document_hands_out_no_row_that_skips_the_checks():
    """`Row` was public and `as_document` returned one, which every later check let through: a user's row with
    the id "a b" or the metadata key "x.y" was stored, and one with a made-up `parent` stored an orphan
    passage row. The checked-row type is private; `as_document` checks every record and returns a plain dict."""
    import twotower.indexing

    assert not hasattr(twotower.indexing, "Row") and "Row" not in twotower.indexing.__all__
    doc = as_document({"id": "a", "text": "t"})
    assert type(doc) is dict and type(as_document(doc)) is dict
    with pytest.raises(DataError, match="contains whitespace"):
        as_document(dict(doc, id="a b"))


def test_errors_name_a_long_id_cut_short():
    """`_where` repeated the whole id in every error (a 1 MB id, a 1 MB message), and built that text for every
    document, not only for the one refused."""
    long_id = "x" * 1_000_000
    with pytest.raises(DataError) as e:
        as_document({"_id": long_id, "id": "other", "text": "t", "metadata": []}, "docs[4]")
    assert str(e.value).startswith("docs[4] (id " + repr("x" * 40) + "...): field 'metadata' must be an object")
    assert len(str(e.value)) < 200
