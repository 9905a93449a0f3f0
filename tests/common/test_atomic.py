"""The project's one atomic-write module: old-or-new content, no stray temp files, sweepable temp names."""

from __future__ import annotations

import json
import os
import stat

import pytest

from twotower.common.atomic import (
    TMP_MARKER,
    atomic_open,
    atomic_path,
    atomic_replace_dir,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
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
