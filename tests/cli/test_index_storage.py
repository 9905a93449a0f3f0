"""`twotower index ...` and `search` where storage refuses or a Ctrl-C lands: read-only directories, interrupts."""

from __future__ import annotations

import os
import sys
import time

import pytest

from tests.cli.cli_run import build_index, run_cli
from tests.indexing.helpers import run_read_only
from tests.retrieval.pipeline_fixtures import tiny_model_dir
from twotower.common.file_lock import try_lock
from twotower.indexing import IndexStore


@pytest.fixture
def built(tmp_path):
    return build_index(tmp_path, 12, "--bm25")


def test_a_read_only_index_is_searched_and_refuses_changes_in_one_line(built):
    """A fresh index on read-only storage: its document store did not open ("unable to open database file"),
    `index check` called it damaged, and add/delete ended in an OSError traceback about LOCK."""
    idx, tw = built / "idx", f"{sys.executable} -m twotower"
    script = "; ".join([
        f"{tw} search --index {idx} tea -k 1 --hybrid --json >/dev/null; echo search=$?",
        f"{tw} index info --index {idx} >/dev/null; echo info=$?",
        f"{tw} index check {idx} >/dev/null; echo check=$?",
        f"{tw} index add --index {idx} --corpus {built / 'corpus.jsonl'} --on-duplicate skip --no-progress; "
        "echo add=$?",
        f"{tw} index delete --index {idx} d0; echo delete=$?",
    ])
    res = run_read_only(idx, script, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}, timeout=300)
    assert res.stdout.split() == ["search=0", "info=0", "check=0", "add=2", "delete=2"], res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2, res.stderr  # one line each, no traceback
    for line, action in zip(lines, ("add", "delete")):
        assert line.startswith(f"twotower index {action}: error: --index {idx}: not writable (read-only file system)")


@pytest.mark.parametrize("action", ["add", "delete"])
def test_ctrl_c_after_the_commit_says_the_change_is_in(built, capsys, monkeypatch, action):
    """A Ctrl-C while the manifest was written said "nothing was committed" of an index at the new generation."""
    calls = []

    def interrupted_at_the_commit(self, force=False):  # the first call is the writer's open, the second the commit's
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(IndexStore, "_refresh_manifest", interrupted_at_the_commit)
    idx = str(built / "idx")
    argv = (["index", "add", "--index", idx, "--corpus", str(built / "corpus.jsonl"), "--on-duplicate", "replace",
             "--model", tiny_model_dir(), "--no-progress"] if action == "add" else ["index", "delete", "--index", idx,
                                                                                     "d0"])
    rc, _, err = run_cli(capsys, *argv)
    monkeypatch.undo()
    with IndexStore.open(idx, readonly=True) as store:
        assert store.generation == 2
    assert rc == 130
    assert err.strip() == f"twotower index {action}: interrupted: the change was committed: {idx} is at generation 2 " \
                          "with it"


class _OtherWriterFinishes:
    """`time` for `twotower.indexing.store`: the first wait for the lock is when the other writer lets it go."""

    def __init__(self, fd: int) -> None:
        self.fd, self.waits = fd, 0

    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        self.waits += 1
        if self.fd is not None:
            os.close(self.fd)  # releases its flock
            self.fd = None


@pytest.mark.parametrize("action", ["add", "delete"])
def test_add_and_delete_wait_for_another_writers_lock(built, capsys, monkeypatch, action):
    """While `twotower serve` was writing, `index add` / `delete` failed at once ("open for writing by another
    process", exit 2), where the server waits 10 s for theirs; they wait up to --lock-wait seconds too."""
    from twotower.indexing import store as store_module

    idx = built / "idx"
    other = _OtherWriterFinishes(try_lock(idx / store_module.LOCK_NAME))  # as another process holds it
    assert other.fd is not None
    monkeypatch.setattr(store_module, "time", other)
    argv = (["index", "add", "--index", str(idx), "--corpus", str(built / "corpus.jsonl"), "--on-duplicate",
             "replace", "--model", tiny_model_dir(), "--no-progress"] if action == "add"
            else ["index", "delete", "--index", str(idx), "d0"])
    rc, _, err = run_cli(capsys, *argv)
    monkeypatch.undo()
    assert (rc, other.waits) == (0, 1), err
    with IndexStore.open(idx, readonly=True) as store:
        assert store.generation == 2


@pytest.mark.parametrize("action", ["add", "delete"])
def test_a_writer_that_keeps_the_lock_past_lock_wait_is_one_line_saying_who_and_to_retry(built, capsys, action):
    """It said "open for writing by another process" alone: not which (the server writes between searches) nor
    that the command may simply be run again."""
    from twotower.indexing.store import LOCK_NAME

    idx = built / "idx"
    fd = try_lock(idx / LOCK_NAME)
    try:
        argv = (["index", "add", "--index", str(idx), "--corpus", str(built / "corpus.jsonl"), "--no-progress"]
                if action == "add" else ["index", "delete", "--index", str(idx), "d0"])
        rc, _, err = run_cli(capsys, *argv, "--lock-wait", "0.05")
    finally:
        os.close(fd)
    assert rc == 2
    assert err.strip() == (f"twotower index {action}: error: --index {idx}: open for writing by another process (a "
                           "`twotower serve` writing to it, or another `twotower index add` or `delete`) for longer "
                           "than --lock-wait 0.05 s; nothing was written: retry once that write is done, or give a "
                           "longer --lock-wait")
    rc, _, err = run_cli(capsys, *argv, "--lock-wait", "-1")
    assert rc == 2 and "--lock-wait must be a number of seconds >= 0, got -1.0" in err
    rc, _, err = run_cli(capsys, *argv, "--lock-wait", "nan")  # it would wait for ever
    assert rc == 2 and "--lock-wait must be a number of seconds >= 0, got nan" in err


def test_lock_wait_help_names_the_default_the_server_uses_too():
    """The help said "as the server waits for them" but not how long; the 10 was written out in three places."""
    from twotower.cli.index_cmd import LOCK_WAIT_HELP
    from twotower.common.file_lock import LOCK_WAIT_S
    from twotower.indexing.store import wait_for_lock
    from twotower.serve.app import ServeConfig

    assert f"(default {LOCK_WAIT_S:g})" in LOCK_WAIT_HELP
    assert ServeConfig(index="x").lock_wait_s == wait_for_lock.__defaults__[0] == LOCK_WAIT_S
