"""The Milvus backend (Milvus Lite in a temporary directory) against the FAISS one, and its commit protocol.

One Milvus Lite database is shared by the module (each test has its own collection): starting one
costs about a second. The killed-writer test uses its own database, because Milvus Lite locks its
file for one process.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")

from twotower.indexing import IndexFormatError, IndexStore, check_index  # noqa: E402
from twotower.indexing import milvus as mv  # noqa: E402
from twotower.indexing.vectors import VectorBackend  # noqa: E402

from .helpers import brute_force, clustered  # noqa: E402
from .procs import kill_at_flag  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_names = itertools.count()


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    return mv.resolve_uri(str(tmp_path_factory.mktemp("milvus") / "lite.db"))


def spec(uri: str, **kw) -> mv.MilvusSpec:
    return mv.MilvusSpec(uri, f"t{next(_names)}_{os.getpid()}", **kw)


def docs(ids, meta=None):
    return [{"id": i, "text": f"text {i}", "metadata": (meta(i) if meta else {})} for i in ids]


def pair(tmp_path: Path, uri: str, dim: int, metric: str) -> tuple[IndexStore, IndexStore]:
    """The same empty index twice: FAISS Flat, and Milvus FLAT."""
    faiss_store = IndexStore.create(tmp_path / "faiss", dim, "Flat", metric)
    milvus_store = IndexStore.create(tmp_path / "milvus", dim, None, metric, milvus=spec(uri))
    return faiss_store, milvus_store


def same_search(a: IndexStore, b: IndexStore, queries: np.ndarray, k: int) -> list[list[str]]:
    ra, rb = a.search(queries, k), b.search(queries, k)
    assert ra.ids == rb.ids
    np.testing.assert_allclose(ra.scores, rb.scores, rtol=1e-4, atol=1e-4)
    return ra.ids


@pytest.mark.parametrize("metric", ["cosine", "ip", "l2"])
def test_same_top_k_as_faiss_flat_through_add_replace_delete_commit_rollback(tmp_path, uri, metric):
    x = clustered(400, 16, seed=1)
    q = clustered(12, 16, seed=2)
    ids = [f"d{i}" for i in range(400)]
    fs, ms = pair(tmp_path, uri, 16, metric)
    assert isinstance(ms.vectors, VectorBackend) and isinstance(fs.vectors, VectorBackend)
    for store in (fs, ms):
        store.add(docs(ids[:300]), x[:300])
    same_search(fs, ms, q, 10)  # staged: the writer sees its own additions
    for store in (fs, ms):
        store.commit()
    before = same_search(fs, ms, q, 10)
    truth, _ = brute_force(x[:300], ids[:300], q, 10, metric)
    assert before == truth
    # replace the best hit of each query with a far-away vector, delete the second, add 100 new ones
    replaced = sorted({row[0] for row in before})
    deleted = sorted({row[1] for row in before} - set(replaced))
    far = -x[: len(replaced)] * 3
    for store in (fs, ms):
        store.add(docs(replaced), far, on_duplicate="replace")
        assert store.delete(deleted + ["nope"]) == ["nope"]
        store.add(docs(ids[300:]), x[300:])
    same_search(fs, ms, q, 10)  # staged replace / delete
    for store in (fs, ms):
        store.commit()
    after = same_search(fs, ms, q, 10)
    live = {i: v for i, v in zip(ids, x)}
    for i, v in zip(replaced, far):
        live[i] = v
    for i in deleted:
        del live[i]
    truth, _ = brute_force(np.stack(list(live.values())), list(live), q, 10, metric)
    assert after == truth and len(ms) == len(fs) == len(live)
    # rollback: staged changes vanish from both
    for store in (fs, ms):
        store.delete([after[0][0]])
        store.add(docs(["new"]), q[:1])
        store.rollback()
    assert same_search(fs, ms, q, 10) == after
    assert sorted(ms.vectors.ids()) == sorted(fs.vectors.ids())
    for store in (fs, ms):
        store.close()
    # reopened (writer and reader) the Milvus index answers the same
    with IndexStore.open(tmp_path / "milvus", readonly=True) as r:
        assert r.search(q, 10).ids == after
    with IndexStore.open(tmp_path / "milvus") as w:
        assert w.search(q, 10).ids == after
        assert w.vectors.tombstone_count == 0  # a closing writer deletes the superseded rows


def test_big_staged_batches_are_flushed_to_milvus_but_invisible_until_commit(tmp_path, uri, monkeypatch):
    monkeypatch.setattr(mv, "FLUSH_ROWS", 7)  # every 7 staged vectors go to Milvus before the commit
    x = clustered(120, 8, seed=7)
    q = clustered(6, 8, seed=8)
    ids = [f"d{i}" for i in range(120)]
    fs, ms = pair(tmp_path, uri, 8, "cosine")
    for store in (fs, ms):
        store.add(docs(ids[:40]), x[:40])
        store.commit()
    r = IndexStore.open(tmp_path / "milvus", readonly=True)
    before = r.search(q, 10).ids
    for store in (fs, ms):
        for s in range(40, 120, 20):
            store.add(docs(ids[s:s + 20]), x[s:s + 20])
        store.add(docs(ids[45:50] + ids[2:4]), -x[45:50 + 2][:7], on_duplicate="replace")  # flushed + committed
        store.delete(ids[50:55] + ids[5:6])  # flushed and committed ids
    assert mv.row_count(ms.vectors.client, ms.vectors.collection, "gen == 2") > 0  # flushed before the commit
    same_search(fs, ms, q, 10)
    assert r.search(q, 10).ids == before  # the reader's commit does not change
    for store in (fs, ms):
        store.commit()
    same_search(fs, ms, q, 10)
    assert r.refresh() and r.search(q, 10).ids == fs.search(q, 10).ids
    r.close()
    for store in (fs, ms):
        store.close()
    assert check_index(tmp_path / "milvus").ok


def _reopened_with_two(tmp_path, uri, x) -> IndexStore:
    """A Milvus-backed index of d0 and d1 (``x[:2]``), committed and closed, opened again for writing."""
    w = IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=spec(uri))
    w.add(docs(["d0", "d1"]), x[:2])
    w.commit()
    w.close()
    return IndexStore.open(tmp_path / "idx")


def test_a_flushed_row_deleted_then_added_again_in_one_transaction_stays(tmp_path, uri, monkeypatch):
    """The delete put the flushed row's key in the garbage table; the add wrote the same key again, and the commit
    (or close) deleted the live row: the next writable open said the index "lacks the vectors of 1 live
    document(s)". The add takes its keys back out of the garbage."""
    monkeypatch.setattr(mv, "FLUSH_ROWS", 1)  # every staged vector goes to Milvus at once
    x = clustered(4, 8, seed=5)
    w = _reopened_with_two(tmp_path, uri, x)
    w.add(docs(["d2"]), x[2:3])
    w.delete(["d2"])
    w.add(docs(["d2"]), -x[2:3])
    w.commit()
    w.close()  # alone in the process: every superseded row is deleted now
    with IndexStore.open(tmp_path / "idx") as w:  # raised IndexFormatError
        assert w.vectors.missing_keys() is None
        assert w.search(-x[2:3], 1).ids == [["d2"]]
    assert check_index(tmp_path / "idx").ok


def test_a_flushed_row_deleted_added_and_deleted_again_in_one_transaction_leaves_no_row(tmp_path, uri, monkeypatch):
    """The re-add staged d2 in memory beside its flushed row (the writer's searches found d2 twice), and the second
    delete dropped only the staged copy: Milvus kept a row ``2:d2`` that neither table named, never deleted, and
    hiding a missing live row from the count of `missing_keys`. The re-add now rewrites the flushed row."""
    monkeypatch.setattr(mv, "FLUSH_ROWS", 2)
    x = clustered(4, 8, seed=6)
    w = _reopened_with_two(tmp_path, uri, x)
    w.add(docs(["d2", "d3"]), x[2:4])  # flushed as 2:d2, 2:d3
    w.delete(["d2"])
    w.add(docs(["d2"]), -x[2:3])
    hits = w.search(-x[2:3], 5).ids[0]  # k above the 4 ids: a second d2 would show
    assert hits.count("d2") == 1 and hits[0] == "d2"  # its own searches: once, with the vector added last
    w.delete(["d2"])
    w.commit()
    w.close()  # alone in the process: every superseded row is deleted now
    with IndexStore.open(tmp_path / "idx") as w:
        v = w.vectors
        assert v.client.query(v.collection, filter='doc_id == "d2"', output_fields=["pk"],
                              consistency_level="Strong") == []
        assert sorted(w.vectors.ids()) == ["d0", "d1", "d3"]
        assert w.vectors.tombstone_count == 0
    assert check_index(tmp_path / "idx").ok


def test_reader_answers_from_its_commit_until_refresh(tmp_path, uri, monkeypatch):
    monkeypatch.setattr(mv, "RETAIN_SECONDS", 3600.0)  # superseded rows stay while this reader may use them
    x = clustered(200, 8, seed=3)
    q = x[:5] + 0.01
    s = spec(uri)
    w = IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=s)
    w.add(docs([f"d{i}" for i in range(200)]), x)
    w.commit()
    r = IndexStore.open(tmp_path / "idx", readonly=True)
    old = r.search(q, 10)
    # the next commit replaces every document of the old answers (more stale rows than k: the reader digs deeper)
    hit = sorted({i for row in old.ids for i in row})
    w.add(docs(hit), np.random.default_rng(0).normal(size=(len(hit), 8)).astype("float32"), on_duplicate="replace")
    w.delete(["d199"])
    w.commit()
    assert r.generation == 1 and r.search(q, 10).ids == old.ids  # the commit before
    new = w.search(q, 10)
    assert new.ids != old.ids
    assert r.refresh()
    assert r.search(q, 10).ids == new.ids  # the commit after
    assert "d199" not in r.vectors
    r.close()
    w.close()


def test_a_closing_writer_keeps_the_rows_a_reader_of_its_process_still_answers_from(tmp_path, uri):
    """`twotower serve` closed each write's store before its searches moved to the new commit, and the close deleted
    every superseded row at once: searches on the commit before answered 0 hits for the documents just replaced
    or deleted. Rows stay RETAIN_SECONDS while another store of the process holds the client; alone, it deletes
    them all (the first test)."""
    filters = pytest.importorskip("twotower.indexing.filters")
    x = clustered(40, 8, seed=8)
    meta = {"src": "a"}
    w = IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=spec(uri))
    w.add(docs([f"d{i}" for i in range(40)], lambda i: meta), x)
    w.commit()
    w.close()
    r = IndexStore.open(tmp_path / "idx", readonly=True)
    q, flt = x[:2] + 0.01, filters.parse_filter('src == "a"')
    before = r.search(q, 3, filter=flt).ids
    assert before[0][0] == "d0" and before[1][0] == "d1"
    w = IndexStore.open(tmp_path / "idx")
    w.add(docs(["d0"], lambda i: meta), -x[:1], on_duplicate="replace")
    w.delete(["d1"])
    w.commit()
    w.close()
    assert r.generation == 1 and r.search(q, 3, filter=flt).ids == before  # still the commit it is on
    assert r.refresh() and r.search(q, 3, filter=flt).ids[1][0] != "d1"
    r.close()
    IndexStore.open(tmp_path / "idx").close()  # a writer alone in the process deletes them
    with IndexStore.open(tmp_path / "idx", readonly=True) as r:
        assert r.vectors.tombstone_count == 0


def test_search_returns_k_live_hits_past_many_stale_rows(tmp_path, uri, monkeypatch):
    monkeypatch.setattr(mv, "RETAIN_SECONDS", 3600.0)
    x = clustered(300, 8, seed=4)
    w = IndexStore.create(tmp_path / "idx", 8, None, "ip", milvus=spec(uri))
    w.add(docs([f"d{i}" for i in range(300)]), x)
    w.commit()
    r = IndexStore.open(tmp_path / "idx", readonly=True)
    q = x[:1]
    near = r.search(q, 60).ids[0]
    w.delete(near)  # 60 rows deleted by a commit the reader does not know about
    w.commit()
    w.add(docs(["late"]), x[:1] * 0.5)
    w.commit()
    got = r.search(q, 5).ids[0]
    assert got == near[:5]  # the reader's commit still has them
    assert r.refresh()
    truth, _ = brute_force(np.concatenate([x, x[:1] * 0.5]), [f"d{i}" for i in range(300)] + ["late"], q, 400, "ip")
    expected = [i for i in truth[0] if i not in set(near)][:5]
    assert r.search(q, 5).ids[0] == expected
    r.close()
    w.close()


def test_metadata_filter_runs_in_milvus(tmp_path, uri):
    filters = pytest.importorskip("twotower.indexing.filters")
    x = clustered(300, 8, seed=5)
    ids = [f"d{i}" for i in range(300)]

    def meta(i: str) -> dict:
        n = int(i[1:])
        return {"lang": ["en", "fr", "de"][n % 3], "year": 2000 + n % 20, "src": {"name": f"s{n % 4}"}}

    w = IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=spec(uri))
    w.add(docs(ids[:250], meta), x[:250])
    w.commit()
    w.add(docs(ids[250:], meta), x[250:])  # staged rows are filtered too
    q = clustered(4, 8, seed=6)
    for text in ['lang == "fr"', 'year >= 2015 and not (src.name in ["s1", "s2"])', 'lang != "en" or year < 2003']:
        flt = filters.parse_filter(text)
        keep = [j for j, i in enumerate(ids) if flt.matches(meta(i))]
        truth, _ = brute_force(x[keep], [ids[j] for j in keep], q, 10, "cosine")
        assert w.vectors.search(q, 10, filter=flt).ids == truth, text
    allowed = set(ids[::7])
    keep = [j for j, i in enumerate(ids) if i in allowed]
    truth, _ = brute_force(x[keep], [ids[j] for j in keep], q, 10, "cosine")
    assert w.vectors.search(q, 10, allowed=allowed).ids == truth
    w.close()


def test_manifest_records_backend_and_info_shows_it(tmp_path, uri):
    s = spec(uri, fingerprint="enc-1")
    with IndexStore.create(tmp_path / "idx", 8, "HNSW", "cosine", milvus=s, ef_search=64) as st:
        info = st.info()
    assert info["backend"] == "milvus" and info["factory"] == "HNSW"
    assert info["milvus"] == {"uri": uri, "collection": s.collection}
    m = IndexStore.open(tmp_path / "idx", readonly=True)
    assert m.manifest.milvus["fingerprint"] == "enc-1" and m.manifest.milvus["index_id"] == s.index_id
    m.close()
    w = IndexStore.open(tmp_path / "idx")
    with pytest.raises(ValueError, match="collection"):
        w.copy_to(tmp_path / "copy")
    w.close()  # an open store of the process keeps a closing writer's superseded rows (the tests after this)


def test_existing_collection_of_another_dimension_encoder_or_index_is_refused(tmp_path, uri):
    s = spec(uri, fingerprint="enc-1")
    with IndexStore.create(tmp_path / "a", 8, None, "cosine", milvus=s) as a:
        a.add(docs(["x"]), np.ones((1, 8), np.float32))
    other = mv.MilvusSpec(uri, s.collection, fingerprint="enc-1")
    with pytest.raises(ValueError, match="dimension 8.*makes 16"):
        IndexStore.create(tmp_path / "b", 16, None, "cosine", milvus=other)
    with pytest.raises(ValueError, match="another encoder"):
        IndexStore.create(tmp_path / "b", 8, None, "cosine", milvus=mv.MilvusSpec(uri, s.collection, "enc-2"))
    with pytest.raises(ValueError, match="already holds 1 vectors"):
        IndexStore.create(tmp_path / "b", 8, None, "cosine", milvus=other)
    assert not (tmp_path / "b").exists()
    with IndexStore.open(tmp_path / "a") as a:  # the refused builds did not touch it
        assert len(a) == 1 and a.search(np.ones((1, 8), np.float32), 1).ids == [["x"]]


def test_the_empty_collection_of_a_live_index_is_refused_and_taken_over_once_that_index_is_removed(tmp_path, uri):
    """A collection with no rows was dropped and remade whoever owned it: an index whose documents were all
    deleted was broken for good by a build naming its collection. Only a failed build's leftover of the same
    directory is taken over: not a moved index's collection either, though no index is at its path now."""
    s = spec(uri)
    with IndexStore.create(tmp_path / "live", 8, None, "cosine", milvus=s) as live:
        live.add(docs(["a"]), np.ones((1, 8), np.float32))
        live.commit()
        live.delete(["a"])
        live.commit()
    other = mv.MilvusSpec(uri, s.collection)
    with pytest.raises(ValueError, match=rf"{s.collection}' at .* is empty but belongs to the index "
                                         rf"{tmp_path / 'live'}; choose another --collection"):
        IndexStore.create(tmp_path / "b", 8, None, "cosine", milvus=other)
    assert not (tmp_path / "b").exists()
    with IndexStore.open(tmp_path / "live") as live:  # untouched: still opens and takes documents
        live.add(docs(["c"]), np.ones((1, 8), np.float32))
        live.commit()
        assert live.search(np.ones((1, 8), np.float32), 1).ids == [["c"]]
    os.rename(tmp_path / "live", tmp_path / "live.build")  # an unfinished build of that directory
    with pytest.raises(ValueError, match=r"already holds 1 vectors of the unfinished build of .*live \(rerun"):
        IndexStore.create(tmp_path / "b", 8, None, "cosine", milvus=other)
    os.rename(tmp_path / "live.build", tmp_path / "moved")  # moved: it opens by its collection's id, not its path
    with pytest.raises(ValueError, match=r"already holds 1 vectors of the index .*live \(no index there now: if it "
                                         r"was moved, it still uses this collection\)"):
        IndexStore.create(tmp_path / "b", 8, None, "cosine", milvus=other)
    with IndexStore.open(tmp_path / "moved") as moved:
        assert moved.search(np.ones((1, 8), np.float32), 1).ids == [["c"]]
    # nor by a new index at the moved one's old path (a failed build there has no vectors, or its OUT.build)
    with pytest.raises(ValueError, match=r"already holds 1 vectors of the index .*live \(no index there now"):
        IndexStore.create(tmp_path / "live", 8, None, "cosine", milvus=mv.MilvusSpec(uri, s.collection))
    with IndexStore.open(tmp_path / "moved") as moved:
        assert moved.search(np.ones((1, 8), np.float32), 1).ids == [["c"]]


class Killed(BaseException):
    """A process dying at that point: no `except Exception` handler runs."""


def test_a_create_killed_right_after_the_collection_is_made_is_taken_over_by_the_rerun(tmp_path, uri, monkeypatch):
    """The properties were set by a second call: killed between the two, the empty collection was refused
    on every rerun as "not created by twotower", although it was this directory's."""
    s, client = spec(uri), mv.connect(uri)
    create = client.create_collection

    def dies_after(*a, **k):
        create(*a, **k)
        raise Killed

    monkeypatch.setattr(client, "create_collection", dies_after)
    with pytest.raises(Killed):
        IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=s)
    monkeypatch.undo()
    assert client.has_collection(s.collection) and not (tmp_path / "idx").exists()
    with IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=mv.MilvusSpec(uri, s.collection)) as store:
        store.add(docs(["x"]), np.ones((1, 8), np.float32))
        store.commit()
        assert store.search(np.ones((1, 8), np.float32), 1).ids == [["x"]]


def test_a_collection_twotower_did_not_create_is_refused_and_kept(tmp_path, uri):
    s, client = spec(uri), mv.connect(uri)
    client.create_collection(s.collection, dimension=8)  # someone else's, empty
    with pytest.raises(ValueError, match="was not created by twotower; choose another --collection"):
        IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=s)
    assert client.has_collection(s.collection) and mv.describe(client, s.collection) == {}
    assert not (tmp_path / "idx").exists()


def test_unreachable_uri_is_a_clear_error_and_writes_nothing(tmp_path):
    with pytest.raises(mv.MilvusUnavailableError, match=r"127\.0\.0\.1:1 \(--milvus-uri\)"):
        IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=mv.MilvusSpec("http://127.0.0.1:1", "c"))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="must end in .db"):
        mv.resolve_uri("vectors.sqlite")


def test_cli_build_with_unreachable_uri_fails_before_encoding(tmp_path, capsys):
    from twotower.cli import main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"_id": "a", "text": "hello"}\n')
    out = tmp_path / "idx"
    rc = main(["index", "build", "--corpus", str(corpus), "--out", str(out), "--backend", "milvus",
               "--milvus-uri", "http://127.0.0.1:1", "--no-progress"])
    assert rc == 2
    assert "--milvus-uri" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl"]  # no OUT, no OUT.build
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(out), "--collection", "c"]) == 2
    assert "--collection needs --backend milvus" in capsys.readouterr().err


def test_lite_path_holding_a_file_or_foreign_directory_is_refused(tmp_path, capsys):
    """Milvus Lite fails on a file with a traceback and a lock hint, and adopts a directory of other files."""
    notes = tmp_path / "notes.db"
    notes.write_text("my notes\n")
    with pytest.raises(ValueError, match=r"--milvus-uri .*notes\.db is an ordinary file"):
        mv.resolve_uri(str(notes))
    mine = tmp_path / "mine.db"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="is a directory of other files"):
        mv.resolve_uri(str(mine))
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt"] and notes.read_text() == "my notes\n"
    (tmp_path / "empty.db").mkdir()
    assert mv.resolve_uri(str(tmp_path / "empty.db")) == str(tmp_path / "empty.db")

    from twotower.cli import main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"_id": "a", "text": "hello"}\n')
    rc = main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "idx"), "--backend", "milvus",
               "--milvus-uri", str(notes), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "ordinary file" in err and "Traceback" not in err and not (tmp_path / "idx").exists()


def test_an_existing_lite_store_is_accepted(uri):
    mv.connect(uri)  # Milvus Lite creates its store
    assert (Path(uri) / "LOCK").exists() or any(Path(uri).iterdir())
    assert mv.resolve_uri(uri) == uri


def test_the_last_store_to_close_unlocks_a_lite_file_for_other_processes(tmp_path):
    """Stores of one process share a client (a service's reader and writer): closing one leaves the other
    working, and closing the last one closes the client and the Milvus Lite server, which locked the file
    until the process exited."""
    db = mv.resolve_uri(str(tmp_path / "own.db"))
    x = np.eye(8, dtype=np.float32)
    with IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=mv.MilvusSpec(db, "own")) as w:
        w.add(docs([f"d{i}" for i in range(8)]), x)
    reader, writer = IndexStore.open(tmp_path / "idx", readonly=True), IndexStore.open(tmp_path / "idx")
    writer.close()
    assert reader.search(x[:2], 1).ids == [["d0"], ["d1"]]
    reader.close()
    probe = f"from twotower.indexing import milvus as mv; print(mv.connect({db!r}).has_collection('own'))"
    res = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "True", res.stderr[-2000:]


def test_relative_lite_path_resolves_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert mv.resolve_uri("./v.db") == str(tmp_path / "v.db")
    assert mv.resolve_uri("http://h:19530") == "http://h:19530"
    assert mv.default_collection(tmp_path / "my-index") == "twotower_my_index"


@pytest.mark.parametrize("name", ["", "9lives", "a-b", "a" * 256])
def test_an_invalid_collection_name_is_refused_before_connecting(tmp_path, name):
    """An empty name meant the default collection (twotower_<directory>), which nobody had asked for."""
    with pytest.raises(ValueError, match=r"--collection .*: a Milvus collection name is letters, digits and "):
        mv.milvus_spec("milvus", "http://127.0.0.1:1", name, tmp_path / "idx")  # unreachable: the name fails first
    with pytest.raises(ValueError, match="^--collection needs --backend milvus$"):  # only the flag given
        mv.milvus_spec("faiss", None, name, tmp_path / "idx")
    with pytest.raises(ValueError, match="^--milvus-uri and --collection need --backend milvus$"):
        mv.milvus_spec("faiss", "http://127.0.0.1:1", name, tmp_path / "idx")
    assert mv.check_collection_name("_a" + "b" * 253) == "_a" + "b" * 253  # 255 characters: Milvus's limit


def test_rows_missing_from_milvus_are_reported(tmp_path, uri):
    s = spec(uri)
    with IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=s) as st:
        st.add(docs(["a", "b", "c"]), np.eye(3, 8, dtype=np.float32))
    assert check_index(tmp_path / "idx").ok
    mv.connect(uri).delete(s.collection, ids=["1:b"])  # lost outside twotower
    report = check_index(tmp_path / "idx")
    assert not report.ok and any(s.collection in p and "'b'" in p for p in report.problems)
    with pytest.raises(IndexFormatError, match=f"{s.collection}.*lacks the vectors of 1 live"):
        IndexStore.open(tmp_path / "idx")


CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {repo!r})
    import numpy as np
    import twotower.indexing.store as st
    from twotower.indexing import IndexStore
    from twotower.indexing.milvus import MilvusSpec

    directory, uri, stage, signal_file, flush = sys.argv[1:]
    import twotower.indexing.milvus as mv
    mv.FLUSH_ROWS = int(flush)
    x = np.random.default_rng(0).normal(size=(200, 8)).astype("float32")
    docs = lambda lo, hi: [{{"id": f"d{{i}}", "text": f"w{{i}}"}} for i in range(lo, hi)]

    def stop_here(name):
        with open(signal_file + ".tmp", "w") as f:
            f.write(name)
        os.replace(signal_file + ".tmp", signal_file)
        time.sleep(120)  # the parent kills us here

    store = IndexStore.create(directory, 8, None, "cosine", bm25=True, milvus=MilvusSpec(uri, "crash"))
    store.add(docs(0, 100), x[:100])
    store.commit()
    st.CRASH_HOOK = lambda name: stop_here(name) if name == stage else None
    store.add(docs(100, 200), x[100:200])
    store.add(docs(1, 2), -x[1:2], on_duplicate="replace")
    store.delete(["d0"])
    store.commit()
    stop_here("done")
    """
)


@pytest.mark.parametrize("stage,committed,flush", [("milvus_written", False, 20000), ("files_written", False, 30),
                                                   ("sqlite_committed", True, 30)])
def test_writer_killed_around_the_commit_point_reopens_consistent(tmp_path, stage, committed, flush):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    directory, flag, db = tmp_path / "idx", tmp_path / "signal", str(tmp_path / "crash.db")
    proc = subprocess.Popen([sys.executable, str(script), str(directory), db, stage, str(flag), str(flush)])
    kill_at_flag(proc, flag, stage, timeout=120, poll=0.05)
    x = np.random.default_rng(0).normal(size=(200, 8)).astype("float32")
    client = mv.connect(db)
    client.load_collection("crash")
    if not committed:
        assert mv.row_count(client, "crash", "gen > 1") > 0  # the killed commit did write to Milvus
    with IndexStore.open(directory) as store:  # the writable open repairs
        assert mv.row_count(client, "crash", f"gen > {store.generation}") == 0
        live = {f"d{i}": x[i] for i in range(200 if committed else 100)}
        if committed:
            live["d1"] = -x[1]
            del live["d0"]
        assert store.generation == (2 if committed else 1) and len(store) == len(live)
        assert sorted(store.vectors.ids()) == sorted(live)
        truth, _ = brute_force(np.stack(list(live.values())), list(live), x[:20], 5, "cosine")
        assert store.search(x[:20], 5).ids == truth
        assert store.search_bm25(["w150"], 1).ids[0] == (["d150"] if committed else [""])
    assert check_index(directory).ok


def test_tied_documents_come_in_id_order_as_in_faiss(tmp_path, uri):
    """Milvus returns equal scores in an order of its own; the store orders them by id descending, as for FAISS."""
    from tests.indexing.test_store import _tied_store

    q = np.array([[1.0, 0.0, 0.0, 0.0]], dtype=np.float32)
    faiss_store = _tied_store(tmp_path / "faiss")
    milvus_store = _tied_store(tmp_path / "milvus", factory=None, milvus=spec(uri))
    for k in (1, 2, 3, 7, 8):
        assert same_search(faiss_store, milvus_store, q, k) == [sorted(
            ["d5", "d12", "d3", "d40", "d1", "d100", "d7"], reverse=True)[:k] + ["other"][: max(0, k - 7)]]
    faiss_store.close()
    milvus_store.close()


def test_a_moved_lite_file_is_reported_missing_and_not_created_again(tmp_path):
    """Moving the index with its .db said "collection ... does not exist (dropped?); rebuild the index", and
    that read created a new, empty Milvus Lite store at the recorded path."""
    db = mv.resolve_uri(str(tmp_path / "own.db"))
    with IndexStore.create(tmp_path / "idx", 8, None, "cosine", milvus=mv.MilvusSpec(db, "own")) as w:
        w.add(docs(["a"]), np.eye(1, 8, dtype=np.float32))
    os.rename(db, tmp_path / "moved.db")
    with pytest.raises(IndexFormatError, match=f"the Milvus Lite file {db} is missing; .*move the file back"):
        IndexStore.open(tmp_path / "idx", readonly=True)
    report = check_index(tmp_path / "idx")
    assert not report.ok and any("is missing" in p for p in report.problems)
    assert not os.path.exists(db)


@pytest.mark.parametrize("index_type, takes, refuses", [("HNSW", "ef_search", "nprobe"),
                                                         ("IVF_FLAT", "nprobe", "ef_search"),
                                                         ("FLAT", None, "ef_search")])
def test_a_search_option_is_taken_by_the_milvus_index_type_it_tunes_and_refused_by_others(
        tmp_path, uri, index_type, takes, refuses):
    """The backend names the kind of index its options tune, as FAISS's does; `IndexStore.search` asks it."""
    store = IndexStore.create(tmp_path / "m", 8, index_type, "cosine", milvus=spec(uri))
    vecs = clustered(40, 8, seed=3)
    store.add(docs([f"d{i}" for i in range(40)]), vecs)
    store.commit()
    if takes:
        assert store.search(vecs[:2], 5, **{takes: 16}).ids[0][0] == "d0"
    with pytest.raises(ValueError, match=rf"^{refuses}=16: {refuses} tunes the search of an .* index, but this "
                                         rf"index is '{index_type}'"):
        store.search(vecs[:2], 5, **{refuses: 16})
    store.close()
