"""Two builds into one --out: the second is refused while the first runs; a killed build's lock is taken over.

Real processes throughout: build A runs in a child and is held at a gate after its first shard (the moment the
issue describes: "wait for cc.build/shards/shard-000000.npy"), build B starts in another child, then A is let go
(or killed with SIGKILL).  Every vector of the finished index is checked against the encoder that built it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tests.retrieval.pipeline_fixtures import tiny_model_dir, write_corpus
from tests.retrieval.test_pipeline_build import NumberEncoder
from twotower.indexing import IndexStore
from twotower.retrieval.build import LOCK_NAME, build_index, shard_path

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TWOTOWER_BF16": "0"}


def _corpus(path: Path, first: int, n: int) -> str:
    """Documents ``d<k>`` with text ``doc <k>`` for k in [first, first + n): NumberEncoder's vector is seeded by k."""
    return write_corpus(str(path), [{"_id": f"d{k}", "text": f"doc {k}"} for k in range(first, first + n)])


def _gated_build(tmp_path: Path, corpus: str, out: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """Start a build of `corpus` in a child; it encodes shard 0, then waits at shard 1 until the file `go` exists."""
    go = tmp_path / f"{name}.go"
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tests.retrieval.test_pipeline_build import NumberEncoder
        from twotower.retrieval.build import build_index

        class Gated(NumberEncoder):
            calls = 0
            def encode_documents(self, texts, batch_size=64, progress=False):
                Gated.calls += 1
                if Gated.calls == 2:  # shard 0 is on disk
                    deadline = time.monotonic() + 300
                    while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
                        time.sleep(0.01)
                return super().encode_documents(texts, batch_size, progress)

        build_index({corpus!r}, {str(out)!r}, Gated(), shard_size=50, progress=False)
        print("A done")
    """))
    proc = subprocess.Popen([sys.executable, str(script)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = Path(shard_path(f"{out}.build", 0))
    deadline = time.monotonic() + 120
    while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if not first.exists():
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"build A never wrote its first shard: {err[-2000:]}")
    return proc, go


def _check_index(out: Path, first: int, n: int) -> None:
    """Every document of the index carries the vector of its own text (cosine index: unit vectors)."""
    want = NumberEncoder().encode_documents([f"doc {k}" for k in range(first, first + n)])  # (n, 8)
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    with IndexStore.open(out, readonly=True) as store:
        ids = store.vectors.ids()
        assert ids == [f"d{k}" for k in range(first, first + n)]
        np.testing.assert_allclose(store.vectors.reconstruct(ids), want, atol=1e-6)
        docs = store.get(ids)
        assert [d["text"] for d in docs] == [f"doc {k}" for k in range(first, first + n)]


def _finish(proc: subprocess.Popen, go: Path) -> tuple[int, str, str]:
    go.touch()
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def test_second_build_of_another_corpus_is_refused_and_the_first_is_intact(tmp_path):
    """The issue's case: B (another corpus and model, through the CLI) used to delete A's shards; now it exits 2."""
    out = tmp_path / "cc"
    corpus_a = _corpus(tmp_path / "a.jsonl", 0, 400)
    corpus_b = _corpus(tmp_path / "b.jsonl", 5000, 400)
    proc, go = _gated_build(tmp_path, corpus_a, out, "A")
    try:
        b = subprocess.run([sys.executable, "-m", "twotower", "index", "build", "--corpus", corpus_b, "--out", str(out),
                            "--model", tiny_model_dir(), "--no-progress"],
                           env=ENV, cwd=REPO, capture_output=True, text=True, timeout=300)
        shards_while_a_waits = sorted(os.listdir(tmp_path / "cc.build" / "shards"))
    finally:
        rc, stdout, err = _finish(proc, go)
    assert b.returncode == 2, b.stderr[-2000:]
    assert f"another build of {out} is running (pid {proc.pid})" in b.stderr
    assert "Traceback" not in b.stderr
    assert shards_while_a_waits == ["shard-000000.npy"]  # B touched nothing
    assert rc == 0 and "A done" in stdout, err[-2000:]
    _check_index(out, 0, 400)
    assert sorted(os.listdir(tmp_path)) == ["A.go", "A.py", "a.jsonl", "b.jsonl", "cc"]


def test_second_build_of_the_same_corpus_is_refused_and_leaves_nothing(tmp_path):
    """Same corpus and encoder (B would "resume" A's shards): B exits 2, writes nothing, A finishes exactly."""
    out = tmp_path / "cc"
    corpus = _corpus(tmp_path / "a.jsonl", 0, 400)
    proc, go = _gated_build(tmp_path, corpus, out, "A")
    script = tmp_path / "B.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.retrieval.test_pipeline_build import NumberEncoder
        from twotower.indexing import IndexLockedError
        from twotower.retrieval.build import build_index
        try:
            build_index({corpus!r}, {str(out)!r}, NumberEncoder(), shard_size=50, progress=False)
        except IndexLockedError as exc:
            print(exc, file=sys.stderr)
            sys.exit(2)
    """))
    try:
        before = sorted(os.listdir(tmp_path / "cc.build"))
        b = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True, text=True, timeout=300)
        after = sorted(os.listdir(tmp_path / "cc.build"))
        shards = sorted(os.listdir(tmp_path / "cc.build" / "shards"))
    finally:
        rc, _, err = _finish(proc, go)
    assert b.returncode == 2, b.stderr[-2000:]
    assert f"another build of {out} is running (pid {proc.pid})" in b.stderr
    assert before == after and shards == ["shard-000000.npy"]
    assert not out.exists() or rc == 0
    assert rc == 0, err[-2000:]
    _check_index(out, 0, 400)
    assert not (tmp_path / "cc.build").exists()


def test_lock_of_a_killed_build_is_taken_over_and_the_resume_is_exact(tmp_path):
    """kill -9 A while it holds the lock: the lock file stays (with A's pid), the kernel released the flock,
    and B resumes from A's finished shard, encoding only the rest."""
    out = tmp_path / "cc"
    corpus = _corpus(tmp_path / "a.jsonl", 0, 400)
    proc, _ = _gated_build(tmp_path, corpus, out, "A")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    lock = tmp_path / "cc.build" / LOCK_NAME
    assert lock.is_file() and str(proc.pid) in lock.read_text()
    resume = NumberEncoder()
    assert build_index(corpus, str(out), resume, shard_size=50, progress=False)
    assert resume.encoded == list(range(50, 400))  # shard 0 was A's; nothing else was reused or redone
    _check_index(out, 0, 400)
    assert not (tmp_path / "cc.build").exists()


def test_a_lock_held_in_this_process_refuses_the_cli_build(tmp_path, capsys):
    """The CLI turns the library's lock error into exit 2 naming OUT and the holder's pid."""
    from tests.cli.cli_run import run_cli
    from twotower.retrieval.build import BuildLock

    out = tmp_path / "cc"
    corpus = _corpus(tmp_path / "a.jsonl", 0, 20)
    with BuildLock(f"{out}.build", str(out)):
        rc, _, err = run_cli(capsys, "index", "build", "--corpus", corpus, "--out", str(out), "--model",
                             tiny_model_dir(), "--no-progress")
    assert rc == 2 and f"another build of {out} is running (pid {os.getpid()})" in err
    assert not out.exists()


def test_out_occupied_error_survives_a_pickle_round_trip():
    """An OSError pickles as (errno, strerror), which OutOccupiedError's constructor took for (out, kind): the
    unpickling failed with KeyError (e.g. an error sent back from a worker process)."""
    import pickle
    from typing import get_args

    from twotower.cli.index_cmd import _out_occupied
    from twotower.indexing.store import Occupant
    from twotower.retrieval.build import OutOccupiedError

    for kind in get_args(Occupant):  # every case has its words, in Python's and in the command line's
        err = OutOccupiedError("/data/idx", kind)
        back = pickle.loads(pickle.dumps(err))
        assert (type(back), back.out, back.kind, str(back), back.errno) == \
            (OutOccupiedError, "/data/idx", kind, str(err), err.errno)
        assert _out_occupied("/data/idx", kind, "c.jsonl").startswith("--out /data/idx: ")
