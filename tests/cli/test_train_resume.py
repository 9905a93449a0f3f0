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


def _argv(tmp_path, command: str, model: str, out: str) -> list[str]:
    data = ["--pairs" if command == "reranker" else "--data", tiny_beir_dir()]
    return ["train", command, "--model", model, *data, "--out", out, "--max-steps", "5", "--eval-every", "2",
            "--save-every", "2", "--no-bf16", "--no-progress", "--lr", "0.002", "--dev-fraction", "0.25",
            "--batch-size", "4", "--max-length" if command == "reranker" else "--doc-max-length", "48"]


class _Terminated(Exception):
    """What the test's own SIGTERM handler raises: a SIGTERM the command let through reaches it."""


@pytest.mark.parametrize("command", ["reranker", "dual"])
def test_sigterm_ends_a_training_as_ctrl_c_does_saying_what_resume_continues(tmp_path, capsys, monkeypatch, command):
    """SIGTERM (SLURM's scancel; torchrun passes it on to its ranks) killed the run where it stood, with no word
    of what --resume would continue from; Ctrl-C said it. Now both end the same way, and the handler the
    process had is put back."""
    import os
    import signal

    real = loop.TrainingLoop._step

    def terminated_at_5(self, bar):
        if self.steps == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, bar)

    def own(signum, frame):
        raise _Terminated

    before = signal.signal(signal.SIGTERM, own)
    try:
        with monkeypatch.context() as m:
            m.setattr(loop.TrainingLoop, "_step", terminated_at_5)
            rc, _, err = run_cli(capsys, *_argv(tmp_path, command, tiny_model_dir(0.2), str(tmp_path / "run")))
        assert rc == 143, err  # SIGTERM's status (128 + 15), not Ctrl-C's 130
        assert ("interrupted: the run's state after step 4 is saved; run the same command with --resume to continue "
                "from there") in err
        assert signal.getsignal(signal.SIGTERM) is own
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("command", ["reranker", "dual"])
def test_a_resume_may_name_the_run_and_the_model_otherwise_and_the_run_may_have_moved(tmp_path, capsys, monkeypatch,
                                                                                      command):
    """`--out runs/s1/`, an absolute --out, a run directory moved elsewhere and `./m` for `/abs/m` were each
    refused as "this command differs from the run it continues": --out and --model were compared as typed."""
    import os
    import shutil

    shutil.copytree(tiny_model_dir(0.2), tmp_path / "m")
    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(5))
        rc, _, err = run_cli(capsys, *_argv(tmp_path, command, str(tmp_path / "m"), str(tmp_path / "run")))
    assert rc == 130 and "the run's state after step 4 is saved" in err
    shutil.move(tmp_path / "run", tmp_path / "moved")
    shutil.copytree(tmp_path / "m", tmp_path / "m2")
    monkeypatch.chdir(tmp_path)
    rc, _, err = run_cli(capsys, *_argv(tmp_path, command, "m2", "moved/"), "--resume")  # another model is not
    real = os.path.realpath(tmp_path)
    assert rc == 2 and f"--model {real}/m2 (the run: {real}/m)" in err
    rc, out, err = run_cli(capsys, *_argv(tmp_path, command, "./m", "moved/"), "--resume")
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 5
