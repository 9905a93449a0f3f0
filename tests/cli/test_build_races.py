"""`twotower index build` when something else creates ``--out`` while it runs: the user's files are kept,
the encoded shards too, and the message says what happened and how to go on (exit status 2, one line)."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from tests.cli.cli_run import run_cli
from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus
from twotower.retrieval import build


def _user_creates(out: str) -> None:
    os.mkdir(out)
    with open(os.path.join(out, "user-file.txt"), "w") as f:
        f.write("mine\n")


def _before_the_rename(monkeypatch, out: str) -> None:
    """The directory appears between the assembly and the final rename (the last moment it can)."""
    rename = os.rename

    def racing(src, dst, *a, **k):
        if os.fspath(dst) == out and os.path.basename(os.fspath(src)) == "index":
            _user_creates(out)
        return rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", racing)


def _during_the_encoding(monkeypatch, out: str) -> None:
    encode = build.encode_shards

    def racing(*a, **k):
        encode(*a, **k)
        _user_creates(out)

    monkeypatch.setattr(build, "encode_shards", racing)


BACKENDS = {"faiss": [], "milvus": ["--backend", "milvus", "--milvus-uri", "{tmp}/v.db"]}


@pytest.mark.parametrize("when,backend", [(_before_the_rename, "faiss"), (_during_the_encoding, "faiss"),
                                          (_before_the_rename, "milvus")])
def test_an_out_that_appears_during_the_build_is_left_alone_and_the_rerun_resumes(tmp_path, capsys, caplog,
                                                                                   monkeypatch, when, backend):
    """Ended, after all the encoding, in a traceback `OSError: [Errno 39] Directory not empty`, rc 1."""
    if backend == "milvus":
        pytest.importorskip("pymilvus")
        pytest.importorskip("milvus_lite")
    corpus = write_corpus(str(tmp_path / "corpus.jsonl"), toy_docs(5))
    out = str(tmp_path / "idx9")
    argv = ["index", "build", "--corpus", corpus, "--model", tiny_model_dir(), "--no-progress", "--out", out,
            "--shard-size", "2", *[a.format(tmp=tmp_path) for a in BACKENDS[backend]]]
    when(monkeypatch, out)
    rc, _, err = run_cli(capsys, *argv)
    monkeypatch.undo()
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert (f"--out {out}: appeared while the index was being built; nothing in it was touched, and the encoded "
            f"shards are kept in {out}.build: remove {out}") in err
    assert os.listdir(out) == ["user-file.txt"] and open(os.path.join(out, "user-file.txt")).read() == "mine\n"
    assert sorted(os.listdir(os.path.join(f"{out}.build", "shards"))) == [f"shard-{i:06d}.npy" for i in range(3)]
    if backend == "milvus":  # the collection this build filled is dropped with its assembly
        from twotower.indexing import milvus as mv

        assert not mv.connect(mv.resolve_uri(str(tmp_path / "v.db"))).has_collection("twotower_idx9")

    shutil.rmtree(out)  # as the message says: remove it and rerun the same command
    with caplog.at_level(logging.WARNING):
        rc, stdout, err = run_cli(capsys, *argv)
    assert rc == 0 and f"built {out}: 5 documents" in stdout, err
    assert "resuming a build, 3 of 3 shards already encoded" in caplog.text
