"""`twotower index add` on a full disk: exit 2 with one line naming the index, no traceback, last commit kept."""

from __future__ import annotations

import os

from tests.cli.cli_run import run_cli
from tests.indexing.test_store_diskfull import _fill, tiny_fs  # noqa: F401 - a 4 MiB tmpfs fixture
from tests.retrieval.pipeline_fixtures import tiny_model_dir, toy_docs, write_corpus
from twotower.indexing import IndexStore


def test_index_add_on_a_full_disk_is_a_user_error(tiny_fs, tmp_path, capsys):  # noqa: F811 - the fixture
    first = write_corpus(str(tmp_path / "first.jsonl"), toy_docs(30))
    more = write_corpus(str(tmp_path / "more.jsonl"), toy_docs(30, seed=1, prefix="new"))
    idx = tiny_fs / "idx"
    rc, _, err = run_cli(capsys, "index", "build", "--corpus", first, "--out", str(idx), "--model", tiny_model_dir(),
                         "--no-progress")
    assert rc == 0, err
    filler = _fill(tiny_fs)
    rc, out, err = run_cli(capsys, "index", "add", "--index", str(idx), "--corpus", more, "--no-progress")
    assert rc == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "no space left" in err.lower() and str(idx) in err, err
    os.unlink(filler)
    with IndexStore.open(idx, readonly=True) as store:  # the last commit, whole
        assert len(store) == 30 and store.docstore.count() == 30
