"""common/paths.py: the path checks and the one wording of each refusal every directory-replacing command uses."""

from __future__ import annotations

import doctest
import os

import pytest

from twotower.common import paths
from twotower.common.paths import (
    beside_earlier_refusal,
    holds_working_directory,
    not_ours_refusal,
    working_directory_refusal,
)


def test_the_module_examples_hold():
    failed, tried = doctest.testmod(paths)
    assert tried >= 8 and failed == 0


def test_working_directory_refusal_names_where_the_shell_is(tmp_path, monkeypatch):
    (tmp_path / "here" / "below").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "here")
    monkeypatch.chdir(tmp_path / "here")
    assert holds_working_directory(".") == "the current directory"
    assert holds_working_directory(str(tmp_path / "link")) == "the current directory"  # the real path counts
    message = working_directory_refusal(".", "--out .", "the index", "--out my-index")
    assert message == ("--out .: the current directory; the index replaces its directory whole, which would leave "
                       "your shell in a removed directory; give a directory below it, e.g. --out my-index")
    assert working_directory_refusal("below", "--out below", "the index", "--out x") is None
    assert working_directory_refusal(str(tmp_path / "here2"), "--out here2", "the index", "--out x") is None  # a prefix, not a parent
    monkeypatch.chdir(tmp_path / "here" / "below")
    run = working_directory_refusal("..", "--out ..", "a run", "--out run", overwrite=True)
    assert run.startswith("--out ..: one above the current directory; a run replaces its directory whole "
                          "(--overwrite), which would delete your files there and leave your shell")


@pytest.mark.parametrize("n, shown", [(1, "f0"), (3, "f0, f1, f2"), (5, "f0, f1, f2 and 2 more")])
def test_refusals_name_a_few_of_the_users_files(n, shown):
    names = [f"f{i}" for i in range(n)]
    assert beside_earlier_refusal("--out r", "an earlier run", names) == (
        f"--out r: an earlier run and files of yours ({shown}), which --overwrite would remove with it: move them "
        "out, or give another --out")
    assert beside_earlier_refusal("out_dir='r'", "an earlier run", names, replaced="the new run would replace whole",
                                  another="another directory (--out)").endswith(
        f"({shown}), which the new run would replace whole: move them out, or give another directory (--out)")
    assert not_ours_refusal("--out r", names, "a soup") == (
        f"--out r: a directory holding other files ({shown}), not a soup; give a new or empty directory")


def test_every_command_that_replaces_a_directory_uses_the_one_wording():
    """No module spells the refusals by hand: a fix to the wording reaches every command."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spelled = []
    for top in ("twotower", "retrieval", "encoder", "indexing", "eval", "common"):
        for dirpath, _, files in os.walk(os.path.join(root, top)):
            for name in files:
                if not name.endswith(".py") or (top == "common" and name == "paths.py"):
                    continue
                text = open(os.path.join(dirpath, name), encoding="utf-8").read()
                for phrase in ("and files of yours (", "a directory holding other files (",
                               "leave your shell in a removed directory", "holds_working_directory("):
                    if phrase in text:
                        spelled.append((os.path.relpath(os.path.join(dirpath, name), root), phrase))
    assert spelled == []
