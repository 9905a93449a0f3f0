"""The project's one atomic-write module: old-or-new content, no stray temp files, sweepable temp names."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from twotower.common.atomic import (
    TMP_MARKER,
    atomic_open,
    atomic_path,
    atomic_replace_dir,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    recover_replaced_dir,
    staging_dir,
    sweep_temporaries,
)


def test_write_keeps_old_file_on_error_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "file.txt"  # parents are created
    with atomic_open(target) as handle:
        handle.write("old\n")
    with pytest.raises(RuntimeError), atomic_open(target) as handle:
        handle.write("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old\n"
    assert os.listdir(target.parent) == ["file.txt"]


def test_temp_name_carries_the_marker_and_sits_beside_the_target(tmp_path):
    target = tmp_path / "vectors.faiss"
    with atomic_path(target) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path)  # same directory: the rename is atomic
        assert TMP_MARKER in os.path.basename(tmp) and os.path.basename(tmp).startswith(".vectors.faiss")
        with open(tmp, "wb") as f:
            f.write(b"\x00\x01")
        assert not target.exists()  # nothing is visible before the rename
    assert target.read_bytes() == b"\x00\x01"
    assert os.listdir(tmp_path) == ["vectors.faiss"]


def test_new_files_get_the_mode_open_would_give(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # open() under the current umask
    atomic_write_text(tmp_path / "atomic.txt", "x")
    assert stat.S_IMODE(os.stat(tmp_path / "atomic.txt").st_mode) == stat.S_IMODE(os.stat(plain).st_mode)


def test_text_bytes_and_json(tmp_path):
    atomic_write_text(tmp_path / "t.txt", "a\nb\r\n")
    assert (tmp_path / "t.txt").read_bytes() == b"a\nb\r\n"  # written as given
    with atomic_open(tmp_path / "n.txt") as f:
        f.write("line\n")
    assert (tmp_path / "n.txt").read_bytes() == b"line\n"
    atomic_write_bytes(tmp_path / "b.bin", b"\xff\x00")
    assert (tmp_path / "b.bin").read_bytes() == b"\xff\x00"
    atomic_write_json(tmp_path / "m.json", {"b": 1, "a": "é"})
    text = (tmp_path / "m.json").read_text(encoding="utf-8")
    assert json.loads(text) == {"b": 1, "a": "é"} and text.index('"a"') < text.index('"b"') and "é" in text
    with pytest.raises(ValueError, match="modes 'w' and 'wb'"), atomic_open(tmp_path / "x", "a"):
        pass


def test_replace_dir_swaps_a_whole_directory(tmp_path):
    target = tmp_path / "model"
    for content in ("one", "two"):
        build = tmp_path / f"build-{content}"
        build.mkdir()
        (build / "weights").write_text(content)
        atomic_replace_dir(str(build), str(target))
        assert (target / "weights").read_text() == content and not build.exists()
    assert sorted(os.listdir(tmp_path)) == ["model"]  # the old copy was removed


# Dies (os._exit, as a kill) on the AT-th file-system step of atomic_replace_dir: a rename or a removal.
_DIE_AT_STEP = """
import os, shutil, sys
from twotower.common import atomic
if sys.argv[4] == "fallback":  # as where the kernel cannot exchange two names
    atomic._exchange = lambda a, b: False
count = [0]
def dying(fn):
    def step(*args, **kwargs):
        count[0] += 1
        if count[0] == int(sys.argv[3]):
            os._exit(9)
        return fn(*args, **kwargs)
    return step
os.replace, shutil.rmtree = dying(os.replace), dying(shutil.rmtree)
atomic.atomic_replace_dir(sys.argv[1], sys.argv[2])
"""


def _killed_swap(tmp_path, at: int, how: str) -> tuple[str, str]:
    """An old `model/` being replaced by a complete new one, the swap killed at step `at`: (target, build)."""
    target, build = tmp_path / "model", tmp_path / f".model{TMP_MARKER}1"
    for directory, content in ((target, "old"), (build, "new")):
        directory.mkdir()
        (directory / "weights").write_text(content)
    done = subprocess.run([sys.executable, "-c", _DIE_AT_STEP, str(build), str(target), str(at), how],
                          capture_output=True, text=True)
    assert done.returncode in (0, 9), done.stderr
    return str(target), str(build)


@pytest.mark.parametrize("at", [1, 2, 3, 99])
def test_a_kill_at_any_step_of_a_directory_swap_leaves_the_target_complete(tmp_path, at):
    """Before, a kill between the two renames left no `model/` at all (a resume found no training state)."""
    target, _ = _killed_swap(tmp_path, at, "exchange")
    assert open(os.path.join(target, "weights")).read() in ("old", "new")
    sweep_temporaries(str(tmp_path))
    recover_replaced_dir(target)
    assert os.listdir(tmp_path) == ["model"]


@pytest.mark.parametrize("at", [1, 2, 3, 99])
def test_without_an_exchange_a_killed_swap_is_recovered(tmp_path, at):
    """Where the names cannot be exchanged, what a kill left (``model.old-PID``, no ``model/``) is put
    back by the next reader, and the next swap goes through."""
    target, _ = _killed_swap(tmp_path, at, "fallback")
    recover_replaced_dir(target)
    assert open(os.path.join(target, "weights")).read() in ("old", "new")
    assert not [n for n in os.listdir(tmp_path) if ".old-" in n]
    build = tmp_path / "build"
    build.mkdir()
    (build / "weights").write_text("newer")
    atomic_replace_dir(str(build), target)
    sweep_temporaries(str(tmp_path))
    assert open(os.path.join(target, "weights")).read() == "newer" and os.listdir(tmp_path) == ["model"]


def test_sweep_removes_only_temporary_names(tmp_path):
    """What killed saves left (a checkpoint copy, a half-written PNG) goes; a user's files stay."""
    (tmp_path / f".best{TMP_MARKER}123").mkdir()
    (tmp_path / f".best{TMP_MARKER}123" / "model.safetensors").write_text("x")
    (tmp_path / f".dev_ndcg.png{TMP_MARKER}ab12.tmp").write_text("x")
    for keep in ("notes.tmp-1", ".hidden", "best"):
        (tmp_path / keep).write_text("mine")
    assert sorted(sweep_temporaries(str(tmp_path))) == [f".best{TMP_MARKER}123", f".dev_ndcg.png{TMP_MARKER}ab12.tmp"]
    assert sorted(os.listdir(tmp_path)) == [".hidden", "best", "notes.tmp-1"]


def test_sweep_of_one_entry_leaves_the_temporaries_of_others(tmp_path):
    """In a directory shared with others (the parent of a run's --out), only that run's copies go."""
    for name in (f".run{TMP_MARKER}7", f".run.unfinished{TMP_MARKER}7", f".other{TMP_MARKER}7", "run"):
        (tmp_path / name).mkdir()
    assert sweep_temporaries(str(tmp_path), of="run") == [f".run{TMP_MARKER}7"]
    assert sorted(os.listdir(tmp_path)) == [f".other{TMP_MARKER}7", f".run.unfinished{TMP_MARKER}7", "run"]


def test_replace_dir_takes_a_relative_dot_target(tmp_path, monkeypatch):
    """``.`` as the target was a traceback (EBUSY: the kernel refuses to rename ``.``); it is resolved first."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "old.txt").write_text("old")
    build = tmp_path / "build"
    build.mkdir()
    (build / "new.txt").write_text("new")
    monkeypatch.chdir(target)
    atomic_replace_dir(str(build), ".")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"] and not build.exists()


def test_staging_dir_of_dot_sits_beside_the_directory_not_inside_it(tmp_path, monkeypatch):
    """``--out .`` was staged in ``./..unfinished``, inside the directory it was to replace."""
    monkeypatch.chdir(tmp_path)
    assert staging_dir(".") == f"{tmp_path}.unfinished"
    assert staging_dir("..") == f"{tmp_path.parent}.unfinished"
    assert staging_dir("runs/a/") == "runs/a.unfinished"  # other names are kept as given
