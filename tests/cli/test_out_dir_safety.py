"""`twotower train|finetune|pretrain --out`: the working directory, and an earlier run beside the user's files,
are refused before anything loads (`--out . --overwrite` deleted the user's files there: the swap that replaces
a run's directory had come to succeed for ``.``)."""

from __future__ import annotations

import json
import os

import pytest

from twotower.cli import main
from twotower.common.paths import foreign_entries

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py

SST = "sentence\tlabel\n" + "i love this movie\t1\ngreat acting\t1\ni hate this movie\t0\nterrible\t0\n" * 2


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def _earlier_train_run(directory) -> None:
    """What `twotower train` leaves (its checkpoint, summary and log), and the user's own file beside it."""
    (directory / "best").mkdir(parents=True)
    (directory / "best" / "config.json").write_text("{}\n")
    (directory / "summary.json").write_text("{}\n")
    (directory / "train_log.jsonl").write_text("")
    (directory / "mycode.py").write_text("print('mine')\n")


def _files(directory) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_foreign_entries_leaves_out_a_runs_names_and_its_temporaries(tmp_path):
    for name in ("best", "best.old-123", ".best.tmp-9", "summary.json", "notes.txt", "best.old-x", "zz"):
        (tmp_path / name).mkdir()
    assert foreign_entries(tmp_path, {"best", "summary.json"}) == ["best.old-x", "notes.txt", "zz"]


@pytest.mark.parametrize("command", ["dual", "reranker"])
def test_train_refuses_the_working_directory_and_a_run_beside_the_users_files(tmp_path, capsys, monkeypatch,
                                                                            command):
    proj = tmp_path / "proj"
    _earlier_train_run(proj)
    before = _files(proj)
    data = "--pairs" if command == "reranker" else "--data"
    args = ["train", command, "--model", str(tmp_path / "model"), data, str(tmp_path / "data"), "--overwrite",
            "--out"]
    monkeypatch.chdir(proj)
    err = _error(capsys, [*args, "."])
    assert "--out .: the current directory; a run replaces its directory whole (--overwrite)" in err
    assert "give a directory below it" in err
    monkeypatch.chdir(tmp_path)  # not the working directory: refused for the user's file
    err = _error(capsys, [*args, "proj"])
    assert ("--out proj: an earlier run and files of yours (mycode.py), which --overwrite would remove with it: "
            "move them out, or give another --out") in err
    assert _files(proj) == before


def test_a_training_run_told_to_replace_an_earlier_run_beside_the_users_files_refuses(tmp_path):
    """The library's own check (`TrainingRun`, replace=True), for a caller that is not the CLI."""
    from twotower.retrieval.training.training_run import TrainingRun, holds_run

    _earlier_train_run(tmp_path)
    assert not holds_run(str(tmp_path))
    with pytest.raises(ValueError, match=r"an earlier run and files of yours \(mycode.py\)"):
        TrainingRun(str(tmp_path), replace=True)
    (tmp_path / "mycode.py").unlink()
    assert holds_run(str(tmp_path))


def test_finetune_refuses_the_working_directory_and_a_run_beside_the_users_files(tiny_dir, tmp_path, capsys,
                                                                                monkeypatch):
    from twotower.encoder.finetuning.finetune import out_dir_state

    train = tmp_path / "train.tsv"
    train.write_text(SST, encoding="utf-8")
    proj = tmp_path / "proj"
    proj.mkdir()
    args = ["finetune", "classify", "--model", tiny_dir, "--train", str(train), "--dev", str(train),
            "--max-steps", "1", "--no-progress", "--overwrite", "--out"]
    assert main([*args, str(proj)]) == 0  # an earlier run
    (proj / "mycode.py").write_text("print('mine')\n")
    before = _files(proj)
    assert out_dir_state(str(proj)) == "mixed"
    monkeypatch.chdir(proj)
    err = _error(capsys, [*args, "."])
    assert "--out .: the current directory; a run replaces its directory whole (--overwrite)" in err
    monkeypatch.chdir(tmp_path)
    err = _error(capsys, [*args, "proj"])
    assert ("--out proj: an earlier fine-tuning run and files of yours (mycode.py), which --overwrite would remove "
            "with it: move them out, or give another --out") in err
    assert _files(proj) == before
    (proj / "mycode.py").unlink()
    assert out_dir_state(str(proj)) == "run"


def test_pretrain_refuses_the_working_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "below").mkdir()
    monkeypatch.chdir(tmp_path / "below")
    err = _error(capsys, ["pretrain", "--corpus", "c.txt", "--valid", "v.txt", "--tokenizer", "tok", "--steps", "1",
                          "--out", "..", "--overwrite"])
    assert "--out ..: one above the current directory; a run replaces its directory whole" in err


def test_train_resumes_an_in_place_run_beside_the_users_files(tmp_path, capsys, monkeypatch):
    """Only a run that swaps its directory in (--overwrite, or resuming one built in OUT.unfinished) is refused
    for the user's files and the working directory: resuming a run stopped in its own directory replaces
    nothing."""
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)  # stopped at its step-500 save, the user's notes beside it
    (run / "best" / "config.json").write_text("{}\n")
    (run / "trainer_state").mkdir()
    (run / "train_log.jsonl").write_text("")
    (run / "notes.txt").write_text("mine\n")
    args = ["train", "dual", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "data"), "--resume",
            "--out"]
    for cwd, out in ((tmp_path, "run"), (run, ".")):
        monkeypatch.chdir(cwd)
        assert main([*args, out]) != 0  # on the state or the inputs, which are not there: not on --out
        err = capsys.readouterr().err
        assert "which --overwrite would remove" not in err and "the current directory" not in err, err
    assert (run / "notes.txt").read_text() == "mine\n"


def test_a_replacing_training_run_is_not_swapped_over_files_added_while_it_ran(tmp_path):
    """A file the user puts in --out while the run replacing it is built (or stopped) stops the swap: the
    finished run stays in OUT.unfinished, and a --resume swaps it in once the file is moved out."""
    from twotower.retrieval.training.training_run import TrainingRun

    out = tmp_path / "run"
    _earlier_train_run(out)
    (out / "mycode.py").unlink()
    run = TrainingRun(str(out), replace=True)
    assert run.staged
    run.save_checkpoint("best", lambda d: open(os.path.join(d, "config.json"), "w").close())
    os.makedirs(run.state_dir)
    (out / "notes.txt").write_text("mine\n")  # while the run trains
    with pytest.raises(ValueError, match=r"files of yours \(notes.txt\).*nothing was swapped.*--resume"):
        run.finish({"best_step": 1})
    assert (out / "notes.txt").read_text() == "mine\n" and (out / "summary.json").read_text() == "{}\n"
    assert os.path.isfile(os.path.join(run.out, "summary.json"))  # the complete run, kept where it was built
    with pytest.raises(ValueError, match=r"files of yours \(notes.txt\)"):
        TrainingRun(str(out), resume=True)  # its swap is still to come
    (out / "notes.txt").unlink()
    assert TrainingRun(str(out), resume=True).out == run.out


def test_a_replacing_finetune_run_is_not_swapped_over_files_added_while_it_ran(tiny_dir, tmp_path, capsys,
                                                                              monkeypatch):
    from twotower.encoder.finetuning import finetune

    train = tmp_path / "train.tsv"
    train.write_text(SST, encoding="utf-8")
    proj = tmp_path / "proj"
    args = ["finetune", "classify", "--model", tiny_dir, "--train", str(train), "--dev", str(train),
            "--max-steps", "1", "--no-progress", "--out", str(proj)]
    assert main(args) == 0  # an earlier run
    earlier = (proj / finetune.REPORT_NAME).read_text()
    write_report = finetune._write_report

    def user_adds_a_file(report, work):  # the moment the run is complete, before its swap
        write_report(report, work)
        if report.finished:
            (proj / "notes.txt").write_text("mine\n")

    monkeypatch.setattr(finetune, "_write_report", user_adds_a_file)
    err = _error(capsys, [*args, "--overwrite"])
    assert "files of yours (notes.txt)" in err and "nothing was swapped" in err, err
    monkeypatch.setattr(finetune, "_write_report", write_report)
    assert (proj / "notes.txt").read_text() == "mine\n" and (proj / finetune.REPORT_NAME).read_text() == earlier
    staged = tmp_path / "proj.unfinished"
    assert json.loads((staged / finetune.REPORT_NAME).read_text())["finished"] is True
    err = _error(capsys, [*args, "--resume"])  # still there: the resume would swap over it
    assert "files of yours (notes.txt)" in err, err
    (proj / "notes.txt").unlink()
    assert main([*args, "--resume"]) == 0
    assert not staged.exists() and (proj / finetune.REPORT_NAME).read_text() != earlier


def test_finetune_and_pretrain_resume_an_in_place_run_from_inside_it(tiny_dir, tmp_path, capsys, monkeypatch):
    """`--resume --out .` inside a run stopped in its own directory replaces nothing: not refused as the
    working directory (only a run built in OUT.unfinished is swapped in)."""
    run = tmp_path / "run"
    (run / "trainer_state").mkdir(parents=True)  # a stopped run's state (here unreadable: refused on that)
    (run / "finetune_report.json").write_text('{"finished": false}\n')
    (run / "run.json").write_text("{}\n")
    monkeypatch.chdir(run)
    for argv in (["finetune", "classify", "--model", tiny_dir, "--train", "t.tsv", "--dev", "t.tsv",
                  "--resume"],
                 ["pretrain", "--corpus", "c.txt", "--tokenizer", "tok", "--steps", "1", "--resume"]):
        assert main([*argv, "--out", "."]) != 0
        err = capsys.readouterr().err
        assert "the current directory" not in err, err
