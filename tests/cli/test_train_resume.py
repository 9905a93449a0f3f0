"""`twotower train reranker|dual --resume`: Ctrl-C says what is kept, a resume in other flags is refused in
those flags, the same command continues the run to its end."""

from __future__ import annotations

import json

import pytest

from tests.cli.cli_run import run_cli
from tests.retrieval.training_fixtures import interrupted_at, tiny_beir_dir, tiny_model_dir
from twotower.retrieval.training import loop

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("command", ["reranker", "dual"])
def test_an_interrupted_training_is_continued_by_the_same_command_with_resume(tmp_path, capsys, monkeypatch,
                                                                               command):
    data = ["--pairs" if command == "reranker" else "--data", tiny_beir_dir()]
    argv = ["train", command, "--model", tiny_model_dir(0.2), *data, "--out", str(tmp_path / "run"),
            "--max-steps", "5", "--eval-every", "2", "--save-every", "3", "--no-bf16", "--no-progress",
            "--lr", "0.002", "--dev-fraction", "0.25", "--batch-size", "4",
            "--max-length" if command == "reranker" else "--doc-max-length", "48"]
    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(1))
        rc, _, err = run_cli(capsys, *argv)
    assert rc == 130 and "no state was saved yet" in err and "run the command again with --overwrite" in err
    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(5))
        rc, _, err = run_cli(capsys, *argv, "--overwrite")
    assert rc == 130 and "the run's state after step 4 is saved; run the same command with --resume" in err

    rc, _, err = run_cli(capsys, *[a if a != "0.002" else "0.003" for a in argv], "--overwrite", "--resume")
    assert rc == 2 and "--lr 0.003 (the run: 0.002)" in err
    rc, out, err = run_cli(capsys, *argv, "--overwrite", "--resume")
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 5
    rc, _, err = run_cli(capsys, *argv, "--resume")
    assert rc == 2 and "finished (summary.json); nothing is left to continue" in err
