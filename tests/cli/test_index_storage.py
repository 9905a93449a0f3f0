"""`twotower index ...` and `search` where storage refuses or a Ctrl-C lands: read-only directories, interrupts."""

from __future__ import annotations

import sys

import pytest

from tests.cli.cli_run import build_index, run_cli
from tests.indexing.helpers import run_read_only
from tests.retrieval.pipeline_fixtures import tiny_model_dir
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
