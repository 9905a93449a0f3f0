"""`twotower finetune --resume`: Ctrl-C says what is kept, a resume in other flags is refused in those flags, the
same command continues a replacing run in OUT.unfinished to the uninterrupted run's checkpoint, leaving the
earlier run whole until then; a finished run and a directory without a state are refused, saying why."""

from __future__ import annotations

import json
import os

import pytest

from tests.cli.cli_run import run_cli
from tests.encoder.task_fixtures import interrupted_at
from twotower.encoder.finetuning import finetune as ft

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py

SST = "sentence\tlabel\n" + ("i love this movie\t1\ngreat acting\t1\ni hate this movie\t0\nterrible\t0\n"
                             "a good film with a great cast\t1\na bad film and a boring plot\t0\n") * 2


def _files(directory: str) -> dict[str, bytes]:
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


def test_an_interrupted_replacing_finetune_is_continued_by_the_same_command_with_resume(tiny_dir, tmp_path, capsys,
                                                                                         monkeypatch):
    train = tmp_path / "train.tsv"
    train.write_text(SST, encoding="utf-8")
    out, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    # 12 rows: 3 steps an epoch, 6 a seed, evaluated at batches 2 and 3 of each epoch
    argv = ["finetune", "classify", "--model", tiny_dir, "--train", str(train), "--dev", str(train), "--seeds",
            "0,1", "--epochs", "2", "--batch-size", "4", "--lr", "0.002", "--evals-per-epoch", "2", "--bf16",
            "off", "--no-progress"]
    rc, _, err = run_cli(capsys, *argv, "--out", ref)
    assert rc == 0, err
    rc, _, err = run_cli(capsys, *argv, "--out", out, "--seeds", "5", "--max-steps", "1")  # the earlier run
    assert rc == 0, err
    earlier = _files(out)

    with monkeypatch.context() as m:
        m.setattr(ft, "set_lr", interrupted_at(1))
        rc, _, err = run_cli(capsys, *argv, "--out", out, "--overwrite")
    assert rc == 130 and "no state was saved yet" in err and "run the command again with --overwrite" in err
    with monkeypatch.context() as m:
        m.setattr(ft, "set_lr", interrupted_at(6 + 4))  # the second seed's step 4
        rc, _, err = run_cli(capsys, *argv, "--out", out, "--overwrite")
    assert rc == 130 and ("interrupted: the run's state after step 3 of seed 1 (2 of 2 seeds) is saved; run the "
                          "same command with --resume to continue from there") in err
    assert _files(out) == earlier  # the replacing run is in OUT.unfinished

    rc, _, err = run_cli(capsys, *argv, "--out", out)
    assert rc == 2 and f"(or --resume to continue the run stopped in {out}.unfinished)" in err
    other = [a if a != "0.002" else "0.003" for a in argv]
    rc, _, err = run_cli(capsys, *other, "--out", out, "--overwrite", "--resume")
    assert rc == 2 and "this command differs from the run it continues: --lr 0.003 (the run: 0.002)" in err
    assert _files(out) == earlier

    # the same model and run named otherwise, from another working directory: --model ./m for /abs/m was refused
    monkeypatch.chdir(tmp_path)
    same = [os.path.join(".", os.path.relpath(tiny_dir, tmp_path)) if a == tiny_dir else a for a in argv]
    rc, stdout, err = run_cli(capsys, *same, "--out", "run/", "--overwrite", "--resume")
    assert rc == 0, err
    assert "dev accuracy" in stdout and not os.path.exists(out + ".unfinished")
    assert not os.path.exists(os.path.join(out, "trainer_state"))
    assert _files(out)["model.safetensors"] == _files(ref)["model.safetensors"]
    # every evaluation of both seeds as the uninterrupted run's (the checkpoint is seed 0's, from before)
    resumed, whole = (json.loads(_files(d)["finetune_report.json"]) for d in (out, ref))
    assert [(s["history"], s["dev"]) for s in resumed["seeds"]] == [(s["history"], s["dev"]) for s in whole["seeds"]]

    rc, _, err = run_cli(capsys, *argv, "--out", out, "--resume")
    assert rc == 2 and "finished (finetune_report.json says so); nothing is left to continue" in err
    rc, _, err = run_cli(capsys, *argv, "--out", str(tmp_path / "new"), "--resume")
    assert rc == 2 and "no training state in" in err and "start the run again without --resume" in err
