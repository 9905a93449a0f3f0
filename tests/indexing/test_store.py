"""IndexStore: staging, commit/rollback, manifest, readers, copies, BM25 integration."""

import json
import os
import re

import numpy as np
import pytest

from twotower.indexing import IndexFormatError, IndexLockedError, IndexStore, document_text
from twotower.indexing.store import vectors_name

from .helpers import clustered

DIM = 12


def docs(lo, hi):
    return [
        {"id": f"d{i}", "title": f"title {i}", "text": f"body word{i} shared", "metadata": {"i": i}}
        for i in range(lo, hi)
    ]


@pytest.fixture(scope="module")
def vecs():
    return clustered(400, DIM, seed=5)


def test_create_add_commit_reopen(tmp_path, vecs):
    d = tmp_path / "idx"
    store = IndexStore.create(d, DIM, "Flat", "cosine", extra={"encoder": "abc"})
    assert store.generation == 0 and len(store) == 0
    store.add(docs(0, 50), vecs[:50])
    assert store.has_pending and len(store) == 50
    assert store.commit() == 1
    store.close()
    again = IndexStore.open(d)
    assert again.generation == 1 and len(again) == 50
    assert again.get(["d3", "zz"])[0]["metadata"] == {"i": 3} and again.get(["zz"]) == [None]
    res = again.search(vecs[7:8], 1)
    assert res.ids == [["d7"]]
    m = json.loads((d / "manifest.json").read_text())
    assert m["counts"] == {"documents": 50, "vectors": 50, "tombstones": 0}
    assert (m["dim"], m["metric"], m["factory"], m["format_version"]) == (DIM, "cosine", "Flat", 1)
    assert m["extra"] == {"encoder": "abc"} and m["generation"] == 1
    names = sorted(p.name for p in d.iterdir() if "sqlite" not in p.name)
    assert names[:2] == ["LOCK", "manifest.json"] and len(names) == 3
    assert re.fullmatch(r"seg-00000000-[0-9a-f]{8}\.faiss", names[2])  # one segment: the 50 added vectors
    again.close()


def test_auto_factory_and_vector_options_persist(tmp_path):
    store = IndexStore.create(tmp_path / "a", DIM, expected_size=100_000, ef_search=99)
    assert store.manifest.factory == "HNSW32" and store.vectors.ef_search == 99
    store.close()
    assert IndexStore.open(tmp_path / "a").vectors.ef_search == 99
    with pytest.raises(ValueError, match="expected_size"):
        IndexStore.create(tmp_path / "b", DIM)
    assert not (tmp_path / "b").exists()  # a refused create leaves nothing behind


def test_create_refuses_non_empty_dir(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "file").write_text("hi")
    with pytest.raises(FileExistsError, match="x"):
        IndexStore.create(tmp_path / "x", DIM, "Flat")
    (tmp_path / "empty").mkdir()
    IndexStore.create(tmp_path / "empty", DIM, "Flat").close()  # an empty dir is fine


def test_create_and_open_name_the_directory_argument():
    """IndexStore.open(None) failed in os.fspath ("expected str, bytes or os.PathLike object, not NoneType"),
    naming no argument; the pipeline's rule (`twotower.common.paths`) now holds here too."""
    with pytest.raises(TypeError, match=r"^directory must be a path \(str or os.PathLike\), got NoneType$"):
        IndexStore.open(None)
    with pytest.raises(TypeError, match=r"^directory must be a path \(str or os.PathLike\), got int$"):
        IndexStore.create(3, DIM, "Flat")


def test_delete_reports_missing_and_rollback_restores(tmp_path, vecs):
    with IndexStore.create(tmp_path / "i", DIM, "HNSW32", "l2") as store:
        store.add(docs(0, 100), vecs[:100])
    store = IndexStore.open(tmp_path / "i")
    assert store.delete(["d1", "nope", "d2", "d1"]) == ["nope"]
    assert len(store) == 98 and store.get(["d1"]) == [None]
    store.rollback()
    assert len(store) == 100 and store.get(["d1"])[0]["id"] == "d1"
    assert store.search(vecs[1:2], 1).ids == [["d1"]]
    store.delete(["d5"])
    store.commit()
    store.close()
    store = IndexStore.open(tmp_path / "i")
    assert len(store) == 99 and store.vectors.tombstone_count == 1 and "d5" not in store.vectors
    assert store.manifest.counts["tombstones"] == 1
    store.close()


def test_add_is_all_or_nothing(tmp_path, vecs):
    store = IndexStore.create(tmp_path / "i", DIM, "Flat")
    store.add(docs(0, 10), vecs[:10])
    with pytest.raises(ValueError, match=r"already stored.*d9"):
        store.add(docs(9, 12), vecs[9:12])
    with pytest.raises(ValueError, match=rf"dimension {DIM + 1} but this index holds dimension {DIM}"):
        store.add(docs(20, 22), np.ones((2, DIM + 1), np.float32))
    with pytest.raises(ValueError, match=r"shape \(2, D\)"):
        store.add(docs(20, 22), vecs[:3])
    assert len(store) == store.docstore.count() == 10
    assert store.add(docs(9, 12), vecs[9:12], on_duplicate="skip") == 2
    assert store.add(docs(0, 1), vecs[50:51], on_duplicate="replace") == 1
    assert len(store) == store.docstore.count() == 12
    assert store.search(vecs[50:51], 1).ids == [["d0"]]
    store.close()


def test_close_discards_uncommitted_and_context_manager_commits(tmp_path, vecs):
    store = IndexStore.create(tmp_path / "i", DIM, "Flat")
    store.add(docs(0, 5), vecs[:5])
    store.close()
    with IndexStore.open(tmp_path / "i") as s:
        assert len(s) == 0
        s.add(docs(0, 5), vecs[:5])
    with pytest.raises(RuntimeError), IndexStore.open(tmp_path / "i") as s:
        s.add(docs(5, 7), vecs[5:7])
        raise RuntimeError("boom")
    with IndexStore.open(tmp_path / "i", readonly=True) as s:
        assert len(s) == 5


def test_single_writer_lock_and_readers(tmp_path, vecs):
    writer = IndexStore.create(tmp_path / "i", DIM, "Flat")
    with pytest.raises(IndexLockedError, match="already open for writing by another IndexStore of this process: "
                                               "close that one first, or open this one with readonly=True"):
        IndexStore.open(tmp_path / "i")
    writer.add(docs(0, 5), vecs[:5])
    writer.commit()
    reader = IndexStore.open(tmp_path / "i", readonly=True)
    assert len(reader) == 5
    writer.add(docs(5, 9), vecs[5:9])
    writer.delete(["d0"])
    writer.commit()  # the reader's generation file is deleted; its mmap keeps working
    assert len(reader) == 5 and reader.get(["d0"])[0] is not None  # pinned snapshot
    assert reader.search(vecs[0:1], 1).ids == [["d0"]]
    with pytest.raises(ValueError, match="read-only"):
        reader.add(docs(50, 51), vecs[:1])
    assert reader.refresh() is True
    assert len(reader) == 8 and reader.get(["d0"]) == [None] and reader.generation == 2
    writer.close()
    IndexStore.open(tmp_path / "i").close()  # lock released by close
    reader.close()


def test_open_removes_stray_files(tmp_path, vecs):
    with IndexStore.create(tmp_path / "i", DIM, "Flat") as s:
        s.add(docs(0, 5), vecs[:5])
    d = tmp_path / "i"
    (segment,) = (p.name for p in d.glob("seg-*.faiss"))
    (d / vectors_name(7)).write_bytes(b"half-written")
    (d / "seg-00000005-0badf00d.faiss").write_bytes(b"an interrupted commit's segment")
    (d / "vectors-00000002.faiss.tmp-abc").write_bytes(b"x")
    (d / "bm25-00000009.npz").write_bytes(b"x")
    with IndexStore.open(d) as s:
        assert len(s) == 5
    names = {p.name for p in d.iterdir()}
    assert segment in names and vectors_name(7) not in names and "seg-00000005-0badf00d.faiss" not in names
    assert not any("tmp" in n or n.startswith("bm25") for n in names)


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "corrupt manifest JSON"),
        ('["a list"]', "must be a JSON object"),
        (None, "manifest not found"),
    ],
)
def test_bad_manifest_is_a_clear_error(tmp_path, content, message):
    IndexStore.create(tmp_path / "i", DIM, "Flat").close()
    path = tmp_path / "i" / "manifest.json"
    if content is None:
        path.unlink()
    else:
        path.write_text(content)
    with pytest.raises(IndexFormatError, match=rf"manifest.json: .*{message}"):
        IndexStore.open(tmp_path / "i")


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("format_version", 2, "newer than this code supports"),
        ("format", "other", "field 'format'"),
        ("dim", "twelve", "field 'dim'"),
        ("metric", "hamming", "field 'metric'"),
        ("dim", DIM + 1, "manifest says dim=13"),
    ],
)
def test_manifest_fields_are_validated(tmp_path, field, value, message):
    IndexStore.create(tmp_path / "i", DIM, "Flat").close()
    path = tmp_path / "i" / "manifest.json"
    m = json.loads(path.read_text())
    m[field] = value
    path.write_text(json.dumps(m))
    with pytest.raises(IndexFormatError, match=message):
        IndexStore.open(tmp_path / "i")


def test_documents_and_vectors_disagreeing_is_detected(tmp_path, vecs):
    with IndexStore.create(tmp_path / "i", DIM, "Flat") as s:
        s.add(docs(0, 5), vecs[:5])
    from twotower.indexing import DocStore

    with DocStore(tmp_path / "i" / "docs.sqlite") as ds:
        ds.delete(["d0"])
    with pytest.raises(IndexFormatError, match="hold 5 vectors but docs.sqlite holds 4 documents"):
        IndexStore.open(tmp_path / "i")


def test_set_extra_is_written_at_commit(tmp_path):
    with IndexStore.create(tmp_path / "i", DIM, "Flat") as s:
        s.set_extra(encoder={"name": "minilm", "sha": "123"}, pooling="mean")
    m = IndexStore.open(tmp_path / "i", readonly=True).manifest
    assert m.extra == {"encoder": {"name": "minilm", "sha": "123"}, "pooling": "mean"}


def test_copy_to_holds_the_committed_generation_only(tmp_path, vecs):
    src = IndexStore.create(tmp_path / "i", DIM, "Flat", bm25=True, extra={"encoder": "abc"})
    src.add(docs(0, 20), vecs[:20])
    src.commit()
    assert src.search_bm25(["word3"], 1).ids == [["d3"]]  # BM25 built in memory ...
    src.commit()  # ... and saved with the generation
    src.add(docs(20, 25), vecs[20:25])  # staged, not committed: not part of the copy
    target = src.copy_to(tmp_path / "sub" / "copy")
    assert target == tmp_path / "sub" / "copy"
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["copy"]  # nothing left beside it
    with IndexStore.open(target) as copy:  # a writer: the copy has its own LOCK
        assert copy.generation == src.generation and len(copy) == 20
        assert copy.manifest.extra == {"encoder": "abc"}
        assert copy.get(["d7"])[0]["metadata"] == {"i": 7} and copy.get(["d21"]) == [None]
        assert copy.search(vecs[7:8], 1).ids == [["d7"]]
        assert copy.search_bm25(["word11"], 1).ids == [["d11"]]
    assert (target / f"bm25-{src.generation:08d}.npz").exists()  # the BM25 cache came along
    assert len(src) == 25 and src.has_pending  # the source keeps working on its own directory
    with pytest.raises(FileExistsError, match="not an empty directory"):
        src.copy_to(target)
    src.close()


def test_bm25_follows_the_documents(tmp_path, vecs):
    d = tmp_path / "i"
    with IndexStore.create(d, DIM, "Flat", bm25={"k1": 1.2, "b": 0.75}) as s:
        s.add(docs(0, 30), vecs[:30])
    s = IndexStore.open(d)
    assert s.bm25.k1 == 1.2
    assert s.search_bm25(["word7"], 2).ids == [["d7", ""]]  # rebuilt from docs (no file yet)
    s.add(docs(30, 31), vecs[30:31])
    s.delete(["d7"])
    assert s.search_bm25(["word7 word30"], 2).ids == [["d30", ""]]  # staged changes visible
    s.commit()
    assert (d / "bm25-00000002.npz").exists()
    s.close()
    r = IndexStore.open(d, readonly=True)
    assert r.search_bm25(["title word30"], 1).ids == [["d30"]]
    r.close()
    with IndexStore.create(tmp_path / "nobm", DIM, "Flat") as s2:
        assert s2.bm25 is None
        with pytest.raises(ValueError, match="without BM25"):
            s2.search_bm25(["x"], 1)


def test_writes_keep_the_bm25_cache_of_each_generation(tmp_path, vecs, monkeypatch):
    """A writer that never searched with BM25 (`twotower index add`, the service) still leaves the cache of the
    generation it commits, equal to one rebuilt from the documents. Before, the commit saved none and the sweep
    removed the old one, so every reader rebuilt BM25 from all documents, in every process."""
    from twotower.indexing.bm25 import BM25

    d = tmp_path / "i"
    with IndexStore.create(d, DIM, "Flat", bm25=True) as s:
        s.add(docs(0, 30), vecs[:30])
    for change in ("add", "delete", "replace"):
        with IndexStore.open(d) as w:
            if change == "add":
                w.add(docs(30, 33), vecs[30:33])
            elif change == "delete":
                w.delete(["d3", "d31"])
            else:
                w.add([{**docs(5, 6)[0], "text": "word30 word30"}], vecs[5:6], on_duplicate="replace")
            generation = w.commit()
        assert (d / f"bm25-{generation:08d}.npz").exists(), change
        with IndexStore.open(d, readonly=True) as r:
            rebuilt = BM25(**r.manifest.bm25)
            for batch in r.docstore.iter_batches(100):
                rebuilt.add([x["id"] for x in batch], [document_text(x) for x in batch])
            monkeypatch.setattr(BM25, "add", lambda *a, **k: pytest.fail("a reader rebuilt BM25"))
            queries = ["word7", "word30 title", "word31", "word3 word5"]
            assert r.search_bm25(queries, 5).ids == rebuilt.search(queries, 5).ids, change
            monkeypatch.undo()


def test_info_is_json_serialisable(tmp_path, vecs):
    with IndexStore.create(tmp_path / "i", DIM, "Flat", bm25=True) as s:
        s.add(docs(0, 3), vecs[:3])
        info = s.info()
    json.dumps(info)
    assert info["documents"] == info["vectors"] == 3
    # a bool: the build's options are {} for a default BM25, which read as false in `if info["bm25"]:`
    assert info["bm25"] is True and info["bm25_params"]["k1"] == 0.9 and info["bm25_params"]["stemmer"] == "english"


def test_directory_of_the_one_file_layout_opens_and_upgrades(tmp_path, vecs):
    """An index written before segments (vectors-<gen>.faiss, no commit record) still opens; a writer upgrades it."""
    from twotower.indexing import DocStore, Manifest, VectorIndex

    d = tmp_path / "old"
    d.mkdir()
    VectorIndex.build([f"d{i}" for i in range(30)], vecs[:30], factory="Flat").save(d / vectors_name(3))
    with DocStore(d / "docs.sqlite") as ds, ds.transaction():
        ds.add(docs(0, 30))
        ds.set_meta("generation", "3")
        for key in ("vector_layout", "ids_digest", "docs_digest"):  # as an earlier version wrote it
            ds._conn.execute("DELETE FROM meta WHERE key = ?", (key,))
    Manifest(dim=DIM, metric="cosine", factory="Flat").write(d / "manifest.json")
    (d / "LOCK").touch()
    with IndexStore.open(d, readonly=True) as ro:
        assert ro.generation == 3 and len(ro) == 30 and ro.search(vecs[4:5], 1).ids == [["d4"]]
    with IndexStore.open(d) as w:  # records the old file as the first segment, then works as usual
        w.add(docs(30, 40), vecs[30:40])
        w.delete(["d0"])
    with IndexStore.open(d, readonly=True, verify="full") as ro:
        assert ro.generation == 4 and len(ro) == 39 and ro.search(vecs[35:36], 1).ids == [["d35"]]
        assert {s.name for s in ro.vectors.segments} >= {vectors_name(3)}


def _tied_store(path, **kw) -> IndexStore:
    """Seven documents with one vector, added over two commits (two segments), and one other document."""
    order = ["d5", "d12", "d3", "d40", "d1", "d100", "d7"]
    v = np.zeros((len(order) + 1, 4), dtype=np.float32)
    v[:, 0] = 1.0
    v[-1] = [0.0, 1.0, 0.0, 0.0]
    rows = [{"id": i, "text": "same", "metadata": {"n": int(i[1:])}} for i in order] + [{"id": "other", "text": "x"}]
    store = IndexStore.create(path, 4, kw.pop("factory", "Flat"), "ip", **kw)
    store.add(rows[:3], v[:3])
    store.commit()
    store.add(rows[3:], v[3:])
    store.commit()
    return store


def test_tied_documents_come_in_id_order_and_a_smaller_k_is_a_prefix(tmp_path):
    """FAISS kept the earliest-added of tied documents at the cut and listed them newest first, so top-1 was d5 and
    top-2 "d12, d5"; a run file lists them by id descending (trec_eval), fusion listed them ascending."""
    store = _tied_store(tmp_path / "idx")
    tied = sorted(["d5", "d12", "d3", "d40", "d1", "d100", "d7"], reverse=True)  # trec_eval's order
    q = np.array([[1.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    for k in range(1, 9):
        assert store.search(q, k).ids == [(tied + ["other"])[:k]], k
    assert store.search(q, 3, filter="n < 40").ids == [[i for i in tied if int(i[1:]) < 40][:3]]
    with pytest.raises(ValueError, match="k must be a positive int"):
        store.search(q, 0)
    store.close()


def test_a_writer_on_a_directory_it_cannot_write_is_told_so(tmp_path, monkeypatch):
    """The writer's first write is its lock file: a read-only mount or a missing permission was a bare OSError."""
    import errno

    from twotower.indexing import IndexNotWritableError
    from twotower.indexing import store as store_module

    d = tmp_path / "idx"
    IndexStore.create(d, DIM, "Flat").close()

    def refused(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(store_module, "try_lock", refused)
    with pytest.raises(IndexNotWritableError, match=r"idx: not writable \(permission denied\); it can be searched"):
        IndexStore.open(d)
    with IndexStore.open(d, readonly=True) as reader:  # searching it still works
        assert reader.generation == 0


def test_an_interrupt_after_the_commit_point_keeps_the_change_and_says_so(tmp_path, vecs, monkeypatch):
    """Ctrl-C while the manifest is written: the commit stands, `last_commit` says so, and the BM25 cache is
    still saved (it was left missing, rebuilt by every process at its first BM25 search until the next commit)."""
    d = tmp_path / "idx"
    store = IndexStore.create(d, DIM, "Flat", bm25=True)
    assert store.last_commit is None
    store.add(docs(0, 5), vecs[:5])

    def interrupted(self, force=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(IndexStore, "_refresh_manifest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.commit()
    assert store.last_commit == 1
    store.close()
    monkeypatch.undo()
    with IndexStore.open(d, readonly=True) as reader:
        assert reader.generation == 1 and len(reader) == 5 and reader.info()["bm25_cache"]


def test_a_bare_string_is_no_list_of_ids(tmp_path, vecs):
    """delete("ab") deleted "a" and "b", and delete("4983") the documents "4", "9", "8" and "3": a string is an
    iterable of one-character ids. get, contains_many and delete, of the store and of its DocStore, refuse it."""
    store = IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine", bm25=True)
    rows = [{"id": i, "text": f"word{i}"} for i in ("4", "9", "8", "3", "4983", "a", "b")]
    store.add(rows, vecs[:len(rows)])
    store.commit()
    for call in (store.delete, store.get, store.contains_many, store.docstore.delete, store.docstore.get,
                 store.docstore.contains_many):
        for single in ("4983", "ab"):
            with pytest.raises(TypeError, match=rf"{call.__name__} takes a list of ids; wrap a single id in a "
                                                rf"list: {call.__name__}\(\['{single}'\]\)"):
                call(single)
    assert len(store) == len(rows) and not store.has_pending  # nothing was deleted
    assert store.delete(["4983"]) == [] and store.contains_many(["4", "4983", "a"]) == [True, False, True]
    assert [d["id"] for d in store.get(["9", "b"])] == ["9", "b"]
    store.close()


def test_search_keywords_are_checked_and_named(tmp_path, vecs):
    """store.search(v, top_k=1) failed inside the backend ("VectorIndex.search() got an unexpected keyword
    argument 'top_k'"), nprobe=4 on a Flat index was ignored, and search_bm25("green tea") named BM25.search."""
    store = IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine", bm25=True)
    store.add(docs(0, 20), vecs[:20])
    with pytest.raises(TypeError, match=r"^search\(\) got an unexpected keyword argument 'top_k' \(the number of "
                                        r"hits is k\); it takes queries, k, filter, and ef_search"):
        store.search(vecs[:1], top_k=1)
    for name in ("nprobe", "ef_search"):
        with pytest.raises(ValueError, match=rf"^{name}=4: {name} tunes the search of an (IVF|HNSW) index, but this "
                                             r"index is 'Flat'; leave it out"):
            store.search(vecs[:1], 3, **{name: 4})
    assert store.search(vecs[:1], 3, nprobe=None).ids == store.search(vecs[:1], 3).ids  # None: not given
    with pytest.raises(TypeError, match=r"^search_bm25 takes a list of query strings; wrap a single query in a "
                                        r"list: search_bm25\(\['green tea'\]\)"):
        store.search_bm25("green tea")
    store.close()
    hnsw = IndexStore.create(tmp_path / "hnsw", DIM, "HNSW16", "cosine")
    hnsw.add(docs(0, 50), vecs[:50])
    assert hnsw.search(vecs[7:8], 1, ef_search=64).ids == [["d7"]]
    with pytest.raises(ValueError, match="nprobe tunes the search of an IVF index, but this index is 'HNSW16'"):
        hnsw.search(vecs[:1], 3, nprobe=4)
    hnsw.close()


def test_a_writer_dropped_without_close_releases_its_lock(tmp_path, vecs):
    """Like a file object, a writer nobody closed gives its lock back when it is collected: the directory
    can be opened for writing again in this process, and its staged, uncommitted change is gone."""
    import gc

    with IndexStore.create(tmp_path / "i", DIM, "Flat") as s:
        s.add(docs(0, 3), vecs[:3])
    writer = IndexStore.open(tmp_path / "i")
    writer.add(docs(3, 5), vecs[3:5])
    del writer
    gc.collect()
    with IndexStore.open(tmp_path / "i") as again:
        assert len(again) == 3


def test_a_k_past_the_index_searches_the_stored_vectors_and_pads_at_the_end(tmp_path, vecs, monkeypatch):
    """k=3_000_000 on four documents took 3.8 s and 632 MB for one query: every layer was asked for k rows and
    padded to k. The backend is now asked for the stored count; the (Q, k) padding comes once, at the end."""
    from twotower.indexing.vector_index import VectorIndex

    store = IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine")
    store.add(docs(0, 4), vecs[:4])
    store.commit()
    asked = []
    search = VectorIndex.search
    monkeypatch.setattr(VectorIndex, "search", lambda self, q, k=10, **kw: (asked.append(k), search(self, q, k, **kw))[1])
    k = 3_000_000
    res = store.search(vecs[:2], k)
    assert asked and max(asked) <= 4 + 1  # the stored count, plus the one more that finds ties at the cut
    assert len(res.ids) == 2 and all(len(row) == k for row in res.ids) and res.scores.shape == (2, k)
    assert sorted(res.ids[0][:4]) == ["d0", "d1", "d2", "d3"] and res.ids[0][0] == "d0"
    assert set(res.ids[0][4:]) == {""} and np.isneginf(res.scores[:, 4:]).all()
    assert np.isfinite(res.scores[:, :4]).all()
    asked.clear()
    assert store.vectors.segments[0].index.search(vecs[:1], 10).ids[0][4:] == [""] * 6  # the backend pads too
    store.close()


def test_k_is_any_integer_but_not_a_bool(tmp_path, vecs):
    store = IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine")
    store.add(docs(0, 4), vecs[:4])
    assert store.search(vecs[:1], np.int64(2)).scores.shape == (1, 2)
    with pytest.raises(ValueError, match="k must be a positive int, got True"):
        store.search(vecs[:1], True)  # it was taken as k=1
    store.close()


def test_create_without_a_factory_names_its_own_arguments(tmp_path):
    """It said "VectorIndex: pass factory=... or expected_size=... (for auto_factory)": internal names."""
    with pytest.raises(ValueError, match=r"^IndexStore\.create: pass factory= .* or expected_size=") as e:
        IndexStore.create(tmp_path / "b", DIM)
    assert "VectorIndex" not in str(e.value) and "auto_factory" not in str(e.value)


def test_add_checks_each_document_once_and_a_parent_field_is_metadata(tmp_path, vecs, monkeypatch):
    """IndexStore.add checked each document, then DocStore.add checked it again. A record with `parent` was
    taken for a passage row: refused without a span, "field 'id' must be a non-empty string" with `_id`, and
    past the id and metadata checks with a span; the pipeline stores it with `parent` as metadata."""
    import twotower.indexing.docstore as docstore
    from twotower.common.errors import DataError

    real, calls = docstore.check_for_index, []
    monkeypatch.setattr(docstore, "check_for_index", lambda *a, **k: calls.append(a[0].doc_id) or real(*a, **k))
    with IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine") as store:
        store.add([{"id": "c1", "text": "t", "parent": "thread-7"},
                   {"_id": "c2", "text": "u", "parent": "p", "start": 0, "end": 1}], vecs[:2])
        assert calls == ["c1", "c2"]  # once each
        assert store.get(["c1", "c2"]) == [
            {"id": "c1", "title": "", "text": "t", "metadata": {"parent": "thread-7"}},
            {"id": "c2", "title": "", "text": "u", "metadata": {"parent": "p", "start": 0, "end": 1}}]
        with pytest.raises(DataError, match="contains whitespace"):
            store.add([{"id": "a b", "text": "t", "parent": "p", "start": 0, "end": 1}], vecs[2:3])
        with pytest.raises(DataError, match="has the key 'a.b'"):
            store.add([{"id": "a", "text": "t", "parent": "p", "start": 0, "end": 1, "metadata": {"a.b": 1}}],
                      vecs[2:3])


def test_add_checks_every_document_a_user_gives_it(tmp_path, vecs):
    """A checked-row type was public, and IndexStore.add stored any such row unchecked: the id "a b", the metadata
    key "x.y", an orphan passage row; wrong types gave AttributeError or sqlite's IntegrityError. Only the
    pipeline's private rows skip the checks (`_add_rows`), and even they are looked at for their types."""
    from twotower.common.errors import DataError
    from twotower.indexing import as_document

    refused = r"^docs\[0\] \(id 'a b'\): document id 'a b' contains whitespace"
    with IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine") as store:
        made = type(as_document({"id": "a", "text": "t"}))  # the type a user gets (it was the checked row's)
        with pytest.raises(DataError, match=refused):
            store.add([made(id="a b", title="", text="t", metadata={"x.y": 1})], vecs[:1])
        from twotower.indexing.docstore import _Row

        with pytest.raises(DataError, match=refused):  # even the pipeline's private row, given to the public add
            store.add([_Row(id="a b", title="", text="t", metadata={"x.y": 1})], vecs[:1])
        with pytest.raises(TypeError, match=r"^docs\[0\]: a checked row needs string 'id', 'title' and 'text'"):
            store._add_rows([_Row(id="a", title=None, text="t", metadata={})], vecs[:1])
        assert len(store) == 0


def test_add_says_a_passage_row_is_the_pipelines_to_write(tmp_path, vecs):
    """A row read back from a passage index (`get(["doc\\x1f0"])`) given to IndexStore.add was refused with the
    TREC message ("contains whitespace or a control character ... rename it"), advice for a user's own id."""
    from twotower.common.errors import DataError

    row = {"id": "doc\x1f0", "title": "", "text": "t", "metadata": {}, "parent": "doc", "start": 0, "end": 1}
    with IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine") as store:
        with pytest.raises(DataError, match=re.escape(
                "docs[0] (id 'doc\\x1f0'): a passage row (a window of document 'doc'), which only the pipeline "
                "writes: add the whole document through SearchPipeline.add, which splits it")):
            store.add([row], vecs[:1])


def test_add_reads_tuples_and_refuses_one_document_as_the_pipeline_does(tmp_path, vecs):
    """docs/formats.md says IndexStore.add reads documents as the pipeline does; it refused (id, text) tuples,
    and a single mapping was iterated by its keys ("docs[0]: expected a JSON object, got str")."""
    with IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine") as store:
        store.add([("a", "green tea"), ("b", "black coffee", {"lang": "fr"})], vecs[:2])
        assert store.get(["a", "b"]) == [{"id": "a", "title": "", "text": "green tea", "metadata": {}},
                                         {"id": "b", "title": "", "text": "black coffee", "metadata": {"lang": "fr"}}]
        with pytest.raises(TypeError, match=re.escape("docs must be an iterable of documents (mappings, or (id, "
                                                      "text[, metadata]) tuples), got dict; wrap a single document "
                                                      "in a list")):
            store.add({"id": "c", "text": "t"}, vecs[2:3])


def test_bm25_search_takes_k_by_the_one_rule(tmp_path, vecs):
    """search_bm25(["tea"], k=True) failed with numpy's TypeError; k follows `check_k`, as in search."""
    with IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine", bm25=True) as store:
        store.add(docs(0, 3), vecs[:3])
    with IndexStore.open(tmp_path / "idx", readonly=True) as store:
        for bad in (True, 0, 2.0):
            with pytest.raises(ValueError, match=re.escape(f"search_bm25: k must be a positive int, got {bad!r}")):
                store.search_bm25(["word1"], k=bad)
        assert store.search_bm25(["word1"], k=np.int64(2)).ids[0][0] == "d1"


def test_bm25_search_without_bm25_says_what_needs_it(tmp_path, vecs):
    store = IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine")
    with pytest.raises(ValueError, match=r"created without BM25, which BM25 search \(search_bm25.*bm25=True.*--bm25"):
        store.search_bm25(["tea"])
    store.close()


def test_create_over_an_index_says_so_and_an_unborn_one_says_how_to_go_on(tmp_path, vecs):
    """A `with IndexStore.create(...)` block that raised before its first commit leaves an empty index at
    generation 0 (nothing removes a directory an exception passed through: it could be a committed index or
    someone's own); creating it again said only "already exists and is not an empty directory"."""
    d = tmp_path / "idx"
    with pytest.raises(RuntimeError), IndexStore.create(d, DIM, "Flat", "cosine") as store:
        store.add(docs(0, 2), vecs[:2])
        raise RuntimeError("boom")
    assert (d / "manifest.json").is_file()  # left in place
    with pytest.raises(FileExistsError, match=re.escape(
            f"{d}: already an index, empty at generation 0 (nothing was ever committed to it, as when the with "
            "block of an earlier IndexStore.create raised before its first commit); open it with "
            f"IndexStore.open({str(d)!r}), or remove the directory")):
        IndexStore.create(d, DIM, "Flat", "cosine")
    with IndexStore.open(d) as store:  # the way on it names
        store.add(docs(0, 2), vecs[:2])
    with pytest.raises(FileExistsError, match=re.escape(
            f"{d}: already an index; open it with IndexStore.open({str(d)!r}) to change it, or remove the "
            "directory first")):
        IndexStore.create(d, DIM, "Flat", "cosine")
    (tmp_path / "own").mkdir()
    (tmp_path / "own" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match="own: a directory that is not empty; give IndexStore.create a new"):
        IndexStore.create(tmp_path / "own", DIM, "Flat", "cosine")
    with pytest.raises(FileExistsError, match="notes.txt: a file; give IndexStore.create the name of a new"):
        IndexStore.create(tmp_path / "own" / "notes.txt", DIM, "Flat", "cosine")


def test_occupant_tells_a_writers_first_commit_and_a_milvus_index_from_an_empty_index(tmp_path, vecs):
    """`occupant` called an index "empty" while another writer held its lock and staged its first commit, and
    advised removing the directory (deleting that work); a Milvus-backed empty index got the same advice,
    which leaves staged rows in the collection; a manifest without docs.sqlite (someone's own files) was
    called an index."""
    import sqlite3

    from twotower.common.file_lock import try_lock
    from twotower.indexing.store import occupant

    d = tmp_path / "idx"
    store = IndexStore.create(d, DIM, "Flat", "cosine")
    store.add(docs(0, 2), vecs[:2])  # staging its first commit
    assert occupant(d) == "being written"  # by this process
    with pytest.raises(FileExistsError, match=re.escape(
            f"{d}: an index another writer holds open and is writing its first commit to; leave it to that "
            "writer and give IndexStore.create a new directory")):
        IndexStore.create(d, DIM, "Flat", "cosine")
    store.close()
    assert occupant(d) == "empty index"
    fd = try_lock(d / "LOCK")  # as another process's writer holds it
    try:
        assert occupant(d) == "being written"
    finally:
        os.close(fd)
    with sqlite3.connect(d / "docs.sqlite") as conn:  # as IndexStore.create(..., milvus=...) records it
        conn.execute("INSERT INTO meta (key, value) VALUES ('milvus', '{}')")
    conn.close()
    assert occupant(d) == "empty milvus index"
    with pytest.raises(FileExistsError, match=re.escape(
            f"open it with IndexStore.open({str(d)!r}) (removing the directory would leave its staged rows")):
        IndexStore.create(d, DIM, "Flat", "cosine")
    (d / "docs.sqlite").write_bytes(b"not a database at all" * 100)
    assert occupant(d) == "index"  # damaged: an index all the same
    (d / "docs.sqlite").unlink()
    assert occupant(d) == "directory"  # a manifest alone: someone's own files


def test_create_for_milvus_says_what_occupies_the_directory(tmp_path):
    """`IndexStore.create(..., milvus=...)` had its own older check ("already exists and is not an empty
    directory"), and never said that an index was there or how to go on; it runs before Milvus is reached."""
    from twotower.indexing.milvus import MilvusSpec

    d = tmp_path / "idx"
    IndexStore.create(d, DIM, "Flat", "cosine").close()
    with pytest.raises(FileExistsError, match=re.escape(
            f"{d}: already an index, empty at generation 0 (nothing was ever committed to it")):
        IndexStore.create(d, DIM, None, "cosine", milvus=MilvusSpec("http://127.0.0.1:9", "c"))


def test_add_reads_documents_as_the_pipeline_does(tmp_path, vecs):
    """`{"_id": "A", "id": "B"}` was stored as B by IndexStore.add and as A (id B kept as metadata) by
    SearchPipeline.build, as docs/formats.md says; extra fields were dropped, integer ids refused."""
    from twotower.common.errors import DataError

    store = IndexStore.create(tmp_path / "idx", DIM, "Flat", "cosine")
    store.add([{"_id": "A", "id": "B", "text": "t", "lang": "en"}, {"id": 7, "text": "u"}], vecs[:2])
    assert store.get(["A", "B", "7"]) == [{"id": "A", "title": "", "text": "t", "metadata": {"id": "B", "lang": "en"}},
                                         None, {"id": "7", "title": "", "text": "u", "metadata": {}}]
    assert store.search(vecs[:1], 1, filter='lang == "en"').ids == [["A"]]
    with pytest.raises(DataError, match=r"^docs\[0\] \(id 'm'\): field 'metadata' must be an object, got list"):
        store.add([{"id": "m", "text": "t", "metadata": []}], vecs[2:3])
    store.close()
