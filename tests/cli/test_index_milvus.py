"""`twotower index build --backend milvus` end to end (Milvus Lite): the CLI, search, add/delete, check,
the HTTP service, and a torchrun build whose rank 0 loads the vectors into Milvus."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")

from tests.cli.cli_run import build_with_an_empty_document, run_cli  # noqa: E402
from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus  # noqa: E402
from twotower.indexing import IndexStore  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The same 40 documents as a FAISS Flat index and as a Milvus FLAT index (a relative ./vectors.db)."""
    root = tmp_path_factory.mktemp("milvus-cli")
    corpus = write_corpus(str(root / "corpus.jsonl"), toy_docs(40))
    model = tiny_model_dir()
    common = ["index", "build", "--corpus", corpus, "--model", model, "--no-progress", "--bm25"]
    from twotower.cli import main

    assert main([*common, "--out", str(root / "faiss"), "--factory", "Flat"]) == 0
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main([*common, "--out", "milvus", "--backend", "milvus", "--milvus-uri", "./vectors.db"]) == 0
    finally:
        os.chdir(cwd)
    return root


def test_a_milvus_lite_build_prints_no_grpc_traceback(tmp_path, capsys, caplog):
    """Every build logged gRPC's "Method not implemented!" (pymilvus asks Milvus Lite for AllocTimestamp and
    carries on) with a traceback, although it succeeded."""
    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(5))
    rc, out, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--model", tiny_model_dir(), "--no-progress",
                           "--out", str(tmp_path / "idx"), "--backend", "milvus", "--milvus-uri",
                           str(tmp_path / "v.db"))
    assert rc == 0 and "built" in out, err
    assert not [r for r in caplog.records if r.name.startswith("grpc") and r.levelno >= 30], caplog.text


def test_on_empty_skip_with_milvus(tmp_path, capsys, caplog):
    build_with_an_empty_document(capsys, caplog, toy_docs(5), tmp_path, "--backend", "milvus", "--milvus-uri",
                                 str(tmp_path / "v.db"))
    with IndexStore.open(tmp_path / "idx", readonly=True) as store:
        assert len(store) == 5 and sorted(store.vectors.ids()) == [f"d{i}" for i in range(5)]


class Killed(BaseException):
    """A process dying at that point (`kill -9`): no `except Exception` handler runs."""


def test_a_build_killed_right_after_creating_its_collection_reruns(tmp_path, capsys, monkeypatch):
    """Killed between `create_collection` and the call that marked the collection as twotower's, every rerun
    said "exists and was not created by twotower; choose another --collection" (2 of 5 timed kills)."""
    from pymilvus import MilvusClient

    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(6))
    argv = ["index", "build", "--corpus", corpus, "--model", tiny_model_dir(), "--no-progress", "--shard-size", "4",
            "--out", str(tmp_path / "idxm2"), "--backend", "milvus", "--milvus-uri", str(tmp_path / "m2.db")]
    create = MilvusClient.create_collection

    def dies_after(self, *a, **k):
        create(self, *a, **k)
        raise Killed

    monkeypatch.setattr(MilvusClient, "create_collection", dies_after)
    with pytest.raises(Killed):
        run_cli(capsys, *argv)
    monkeypatch.undo()
    assert not (tmp_path / "idxm2").exists() and (tmp_path / "idxm2.build").is_dir()
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0 and "built" in out and "6 documents" in out, err
    with IndexStore.open(tmp_path / "idxm2", readonly=True) as store:
        assert len(store) == 6 and sorted(store.vectors.ids()) == [f"d{i}" for i in range(6)]


def test_info_shows_the_backend_and_the_absolute_uri(built, capsys):
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(built / "milvus"))
    assert rc == 0
    assert f"milvus, collection twotower_milvus at {built / 'vectors.db'}" in out
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(built / "milvus"), "--json")
    info = json.loads(out)
    assert info["backend"] == "milvus" and info["factory"] == "FLAT" and info["documents"] == 40
    rc, out, _ = run_cli(capsys, "index", "info", "--index", str(built / "faiss"))
    assert "faiss (vector files in the directory)" in out


def test_search_cli_answers_as_on_faiss(built, capsys):
    queries = ["tea coffee", "gene cell", "drug dose"]
    results = {}
    for name in ("faiss", "milvus"):
        rc, out, _ = run_cli(capsys, "search", "--index", str(built / name), "-k", "5", "--json", *queries)
        assert rc == 0
        results[name] = [[(h["id"], h["score"]) for h in r["hits"]] for r in json.loads(out)]
    for got, want in zip(results["milvus"], results["faiss"], strict=True):  # float32 sums in another order
        assert [i for i, _ in got] == [i for i, _ in want]
        assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-3)
    rc, out, _ = run_cli(capsys, "search", "--index", str(built / "milvus"), "-k", "3", "--json", "--hybrid",
                         "tea coffee")
    assert rc == 0 and len(json.loads(out)[0]["hits"]) == 3


def test_add_delete_check_on_a_milvus_index(built, tmp_path, capsys):
    extra = write_corpus(str(tmp_path / "more.jsonl"), toy_docs(5, seed=9, prefix="n"))
    for name in ("faiss", "milvus"):
        assert run_cli(capsys, "index", "add", "--index", str(built / name), "--corpus", extra)[0] == 0
        assert run_cli(capsys, "index", "delete", "--index", str(built / name), "d3", "n1")[0] == 0
    with IndexStore.open(built / "faiss", readonly=True) as f, IndexStore.open(built / "milvus", readonly=True) as m:
        assert sorted(m.vectors.ids()) == sorted(f.vectors.ids()) and len(m) == 43
        q = f.vectors.reconstruct(["n2", "d7"])  # (2, D)
        assert m.search(q, 6).ids == f.search(q, 6).ids
    rc, out, _ = run_cli(capsys, "index", "check", str(built / "milvus"))
    assert rc == 0 and "ok" in out


def test_http_service_searches_a_milvus_index(built):
    pytest.importorskip("fastapi")
    from tests.serve.serve_fixtures import client

    with client(str(built / "faiss")) as c:
        want = c.get("/search", params={"q": "tea coffee", "k": 4}).json()["hits"]
    with client(str(built / "milvus")) as c:
        got = c.get("/search", params={"q": "tea coffee", "k": 4}).json()["hits"]
        assert c.get(f"/documents/{got[0]['id']}").status_code == 200
    assert [h["id"] for h in got] == [h["id"] for h in want]


def test_a_stopping_server_deletes_the_rows_its_writes_superseded(tmp_path, capsys):
    """Each write's close keeps the rows it superseded while the server's own store may still search them, and
    readers never delete them: after the server's last write they stayed until some writer opened the index."""
    pytest.importorskip("fastapi")
    from tests.serve.serve_fixtures import AUTH, TOKEN, client

    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(5))
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--model", tiny_model_dir(), "--no-progress",
                         "--out", str(tmp_path / "idx"), "--backend", "milvus", "--milvus-uri", str(tmp_path / "v.db"))
    assert rc == 0, err
    with client(str(tmp_path / "idx"), token=TOKEN) as c:
        r = c.request("DELETE", "/documents", json={"ids": ["d0"]}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert c.app.state.service.owner.view.generation == r.json()["generation"]
    with IndexStore.open(tmp_path / "idx", readonly=True) as store:
        assert (len(store), store.vectors.tombstone_count) == (4, 0)


def test_a_stopping_server_opens_a_writer_only_when_it_has_rows_to_delete(tmp_path, monkeypatch):
    """`collect_garbage` opened a whole writer (Milvus Lite restarted, the collection loaded and checked) whenever
    the server had written: with an empty garbage table too, and on a Milvus server, where a writer deletes only
    the rows retired more than 10 s ago."""
    from twotower.indexing import milvus as mv
    from twotower.indexing.docstore import DocStore
    from twotower.indexing.store import DOCS_NAME
    from twotower.serve import writer as writer_module

    idx = tmp_path / "idx"
    spec = mv.MilvusSpec(mv.resolve_uri(str(tmp_path / "v.db")), f"gc_{os.getpid()}")
    with IndexStore.create(idx, 4, None, "cosine", milvus=spec) as store:
        store.add([{"id": "d0", "text": "t", "metadata": {}}], np.ones((1, 4), dtype=np.float32))
        store.commit()
    opened = []

    class Counted:
        @staticmethod
        def open(*a, **kw):
            opened.append(a[0])
            return IndexStore.open(*a, **kw)

    monkeypatch.setattr(writer_module, "IndexStore", Counted)
    writer = writer_module.IndexWriter(str(idx), None)
    writer.writes = 1
    writer.collect_garbage()
    assert opened == []  # nothing in the garbage table
    with DocStore(idx / DOCS_NAME) as docs:  # a row a write superseded
        docs.write("INSERT INTO vector_garbage (key, generation, retired) VALUES ('1:gone', 1, 0)")
    with monkeypatch.context() as m:
        m.setattr(mv, "is_local", lambda uri: False)  # as for http://host:19530
        writer.collect_garbage()
    assert opened == []
    writer.collect_garbage()
    assert opened == [str(idx)]
    with IndexStore.open(idx, readonly=True) as store:
        assert store.vectors.tombstone_count == 0


def test_close_lets_another_process_open_the_milvus_lite_file(built):
    """`SearchPipeline.close()` left the process's Milvus Lite client, and the in-process server that locks the
    file, open: `twotower search` in another process failed with "cannot reach Milvus ... used by one process at
    a time" until this one exited, even after `gc.collect()`."""
    from twotower.retrieval import SearchPipeline

    pipe = SearchPipeline.load(built / "milvus", tiny_model_dir(), bf16=False)
    assert len(pipe.search("tea coffee", k=3)) == 3
    pipe.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TWOTOWER_BF16": "0", "PYTHONPATH": REPO}
    res = subprocess.run([sys.executable, "-m", "twotower", "search", "--index", str(built / "milvus"), "-k", "3",
                          "--json", "tea coffee"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(json.loads(res.stdout)[0]["hits"]) == 3
    with SearchPipeline.load(built / "milvus", tiny_model_dir(), bf16=False) as again:  # and this one again
        assert len(again.search("tea coffee", k=3)) == 3


def test_dimension_mismatch_is_refused_before_encoding(built, tmp_path, capsys):
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(3))
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", str(tmp_path / "other"),
                         "--model", tiny_model_dir(hidden=24), "--backend", "milvus",
                         "--milvus-uri", str(built / "vectors.db"), "--collection", "twotower_milvus",
                         "--no-progress")
    assert rc == 2 and "dimension 36" in err and "makes 24" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


@pytest.mark.slow
def test_torchrun_ranks_encode_and_rank_0_loads_milvus(tmp_path):
    """Encoding split over 2 gloo ranks; rank 0 alone writes to Milvus; the vectors equal a one-process build."""
    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(50, seed=3))
    model = tiny_model_dir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TWOTOWER_BF16": "0", "PYTHONPATH": REPO}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    res = subprocess.run([*torchrun, "-m", "twotower", "index", "build", "--corpus", corpus, "--model", model,
                          "--shard-size", "16", "--no-progress", "--out", str(tmp_path / "two"),
                          "--backend", "milvus", "--milvus-uri", str(tmp_path / "v.db")],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "50 documents" in res.stdout
    from twotower.retrieval import DualEncoder, SearchPipeline

    SearchPipeline.build(corpus, tmp_path / "one", DualEncoder.from_pretrained(model, bf16=False), shard_size=16,
                         factory="Flat", progress=False).close()
    with IndexStore.open(tmp_path / "one", readonly=True) as one, \
            IndexStore.open(tmp_path / "two", readonly=True) as two:
        ids = one.vectors.ids()
        assert sorted(two.vectors.ids()) == sorted(ids)
        q = one.vectors.reconstruct(ids[:10])
        np.testing.assert_allclose(two.vectors.reconstruct(ids[:10]), q, atol=1e-5)
        assert two.search(q, 5).ids == one.search(q, 5).ids


@pytest.mark.parametrize("backend", [[], ["--backend", "milvus", "--milvus-uri", "http://127.0.0.1:1"]])
def test_an_empty_collection_name_is_refused_by_its_flag(tmp_path, capsys, backend):
    """--collection "" built into the default collection (Milvus) or was ignored (FAISS), with exit 0."""
    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(3))
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--model", tiny_model_dir(), "--no-progress",
                         "--out", str(tmp_path / "idx"), "--collection", "", *backend)
    want = ("--collection '': a Milvus collection name is letters, digits and underscores" if backend
            else "--collection needs --backend milvus")  # only the flag given is named
    assert rc == 2 and want in err
    assert not (tmp_path / "idx").exists()


def test_a_lite_file_held_by_another_process_is_one_line_and_check_says_busy(built):
    """While another process (`twotower serve`) holds the Milvus Lite file, every command printed Milvus Lite's
    20-line DataDirLockedError traceback before its own line, and `index check` exited 2 ("damaged")."""
    from twotower.indexing import IndexStore

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    tw = [sys.executable, "-m", "twotower", "index"]
    with IndexStore.open(built / "milvus", readonly=True):  # this process holds the file
        check = subprocess.run([*tw, "check", str(built / "milvus")], env=env, capture_output=True, text=True,
                               timeout=120)
        info = subprocess.run([*tw, "info", "--index", str(built / "milvus")], env=env, capture_output=True,
                              text=True, timeout=120)
    assert check.returncode == 3 and check.stderr.startswith("twotower index check: busy: "), check.stderr
    assert "in use by another process" in check.stderr and len(check.stderr.strip().splitlines()) == 1
    assert info.returncode == 2 and len(info.stderr.strip().splitlines()) == 1, info.stderr
    assert "in use by another process" in info.stderr
