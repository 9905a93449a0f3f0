"""Builds on a small real file system (a tmpfs mounted for the test): refused up front when the estimated size
does not fit; a disk that fills up during encoding or assembly gives a "no space left on device" error naming
the directory, removes the half-assembled index, keeps the finished shards, and the rerun resumes from them.

The file system is the `tiny_fs` fixture of the index store's full-disk tests (tests/retrieval/conftest.py);
mounting needs root (CAP_SYS_ADMIN), elsewhere these tests skip, saying why.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from tests.retrieval.pipeline_fixtures import tiny_model_dir, write_corpus
from tests.retrieval.test_pipeline_build import NumberEncoder
from twotower.common.atomic import TMP_MARKER
from twotower.indexing import IndexStore
from twotower.retrieval.build import DiskFullError, build_index, check_disk_space, estimated_bytes, shard_path

KB = 1024


def fill(directory: Path, leave: int = 0) -> Path:
    """Write a filler file until at most `leave` bytes are free in `directory`'s file system (0: until ENOSPC)."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        target = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize - leave
        written = 0
        block = b"\0" * (64 * KB)
        try:
            while written < target:
                n = f.write(block[: min(len(block), target - written)])
                f.flush()
                written += n
            if leave == 0:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


class WideEncoder(NumberEncoder):
    """NumberEncoder with 64 dimensions (256 bytes a vector), calling `hook(call)` before each encode."""

    dim = 64

    def __init__(self, hook=None) -> None:
        super().__init__()
        self.hook, self.calls = hook, 0

    def fingerprint(self) -> str:
        return "wide-number-encoder-1"

    def encode_documents(self, texts, batch_size=64, progress=False):
        self.calls += 1
        if self.hook is not None:
            self.hook(self.calls)
        numbers = [int(t.split()[-1]) for t in texts]
        self.encoded.extend(numbers)
        return np.stack([np.random.default_rng(n).normal(size=self.dim) for n in numbers]).astype(np.float32)


def _corpus(tmp_path: Path, n: int) -> str:
    return write_corpus(str(tmp_path / "c.jsonl"), [{"_id": f"d{i}", "text": f"doc {i}"} for i in range(n)])


def _check(out: Path, n: int) -> None:
    want = WideEncoder().encode_documents([f"doc {i}" for i in range(n)])
    want /= np.linalg.norm(want, axis=1, keepdims=True)
    with IndexStore.open(out, readonly=True) as store:
        ids = store.vectors.ids()
        assert ids == [f"d{i}" for i in range(n)]
        np.testing.assert_allclose(store.vectors.reconstruct(ids), want, atol=1e-6)


def test_estimate_counts_vectors_twice_and_the_texts():
    from twotower.retrieval.build import BuildPlan
    from twotower.retrieval.corpus import CorpusPlan

    plan = BuildPlan("x", "error", 100, "f", num_documents=1000, dim=384)
    corpus = CorpusPlan("c.jsonl", 1000, 0, set(), content_bytes=5_000_000)
    assert estimated_bytes(plan, corpus) == (1000 * 384 * 4 + 5_000_000, 1000 * 384 * 4)


def test_build_that_cannot_fit_is_refused_before_encoding(tmp_path, tiny_fs):
    """20k vectors of 64 floats = 5 MiB in the index alone, on a 4 MiB disk: refused, nothing written."""
    corpus = _corpus(tmp_path, 20_000)
    enc = WideEncoder()
    with pytest.raises(DiskFullError, match=f"not enough free disk space in {tiny_fs}: this build needs at least "
                                            r"10\.[0-9] MB .* but 4\.0 MB are free"):
        build_index(corpus, str(tiny_fs / "idx"), enc, shard_size=1000, progress=False)
    assert enc.calls == 0 and os.listdir(tiny_fs) == []


def test_resumed_build_counts_its_shards_as_written(tmp_path, tiny_fs):
    """The check subtracts shards already in the work directory (they hold their space already)."""
    from twotower.retrieval.build import BuildPlan
    from twotower.retrieval.corpus import CorpusPlan

    plan = BuildPlan("x", "error", 1000, "f", num_documents=5000, dim=64)  # 1.2 MiB of vectors
    corpus = CorpusPlan("c.jsonl", 5000, 0, set(), content_bytes=0)
    work = tiny_fs / "idx.build"
    (work / "shards").mkdir(parents=True)
    fill(tiny_fs, leave=2 * 1024 * KB)  # 2 MiB free: not enough for shards + index (2.4 MiB)
    with pytest.raises(DiskFullError):
        check_disk_space(str(tiny_fs / "idx"), str(work), plan, corpus)
    (tiny_fs / "filler").unlink()
    np.save(shard_path(str(work), 0), np.zeros((1000 * 4, 64), np.float32))  # 4 of 5 shards' bytes written
    fill(tiny_fs, leave=2 * 1024 * KB)
    check_disk_space(str(tiny_fs / "idx"), str(work), plan, corpus)  # needs 1.2 + 0.25 MiB now: fits


def test_disk_full_while_writing_shards_keeps_the_finished_ones_and_resumes(tmp_path, tiny_fs):
    corpus = _corpus(tmp_path, 2000)  # 2000 x 256 B = 0.5 MiB of vectors, in 10 shards of 200
    out = tiny_fs / "idx"
    enc = WideEncoder(hook=lambda call: fill(tiny_fs) if call == 4 else None)  # shards 0-2 are on disk
    with pytest.raises(DiskFullError) as info:
        build_index(corpus, str(out), enc, shard_size=200, progress=False)
    msg = str(info.value)
    assert msg.startswith(f"no space left on device while writing embedding shards to {out}.build/shards; the 3 "
                          f"finished shards (0.1 MB) are kept in {out}.build: free some space on that disk and rerun "
                          "the same command"), msg
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    shards = sorted(os.listdir(tiny_fs / "idx.build" / "shards"))
    assert shards == [f"shard-{i:06d}.npy" for i in range(3)]  # no half-written temp file
    assert not out.exists()
    (tiny_fs / "filler").unlink()
    resume = WideEncoder()
    assert build_index(corpus, str(out), resume, shard_size=200, progress=False)
    assert resume.encoded == list(range(600, 2000))
    _check(out, 2000)
    assert sorted(os.listdir(tiny_fs)) == ["idx"]


def test_disk_full_while_assembling_removes_the_partial_index(tmp_path, tiny_fs):
    """The disk fills up after the last shard: the staging index goes, all shards stay, the rerun only assembles."""
    corpus = _corpus(tmp_path, 2000)
    out = tiny_fs / "idx"
    last_shard = 200 * 64 * 4 + 128  # .npy header included

    def hook(call: int) -> None:
        if call == 10:  # the last shard is being encoded: leave room for it and a little more
            fill(tiny_fs, leave=-(-last_shard // (4 * KB)) * 4 * KB + 8 * KB)

    with pytest.raises(DiskFullError) as info:
        build_index(corpus, str(out), WideEncoder(hook), shard_size=200, progress=False)
    msg = str(info.value)
    assert msg.startswith(f"no space left on device while assembling the index in {out}.build/index; "
                          "the 10 finished shards (0.5 MB) are kept"), msg
    left = sorted(os.listdir(tiny_fs / "idx.build"))
    assert "index" not in left and not any(TMP_MARKER in name for name in left), left
    (tiny_fs / "filler").unlink()
    resume = WideEncoder()
    assert build_index(corpus, str(out), resume, shard_size=200, progress=False)
    assert resume.encoded == []
    _check(out, 2000)


def test_cli_reports_a_full_disk_in_one_line(tmp_path, tiny_fs, capsys, monkeypatch):
    """Through the CLI with the real (tiny) model: exit 2, the directory named, no traceback, then a resume."""
    from tests.cli.cli_run import run_cli
    from tests.retrieval.pipeline_fixtures import toy_docs
    from twotower.retrieval.dual_encoder import DualEncoder

    corpus = write_corpus(str(tmp_path / "c.jsonl"), toy_docs(100))
    real = DualEncoder.encode_documents
    calls = []

    def filling(self, texts, **kw):
        calls.append(len(texts))
        if len(calls) == 3:
            fill(tiny_fs)
        return real(self, texts, **kw)

    monkeypatch.setattr(DualEncoder, "encode_documents", filling)
    argv = ["index", "build", "--corpus", corpus, "--out", str(tiny_fs / "idx"), "--model", tiny_model_dir(),
            "--shard-size", "20", "--no-progress"]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2, err
    assert err.startswith(f"twotower index build: error: no space left on device while writing embedding shards to "
                          f"{tiny_fs}/idx.build/shards; the 2 finished shards (6 KB) are kept") \
        and len(err.strip().splitlines()) == 1, err
    (tiny_fs / "filler").unlink()
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 0 and "100 documents" in out, err
    assert calls[3:] == [20, 20, 20]  # the rerun encoded shards 2-4 only
