"""A training run's directory: a replacing run is built apart until complete; a killed save's leftovers are swept."""

from __future__ import annotations

import json
import os
import shutil

from twotower.retrieval.training.training_run import TrainingRun


def _earlier_run(out) -> dict[str, str]:
    """A finished run in `out` (best/, last/, summary.json, its log); returns its files and their text."""
    files = {"best/model.safetensors": "A best", "last/model.safetensors": "A last",
             "summary.json": '{"best_step": 15}', "train_log.jsonl": '{"event": "config"}\n'}
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
    return files


def _files(out) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, n), out): open(os.path.join(d, n)).read()
            for d, _, names in os.walk(out) for n in names}


def _save_best(run: TrainingRun, text: str) -> str:
    def write(directory: str) -> None:
        with open(os.path.join(directory, "model.safetensors"), "w") as f:
            f.write(text)

    return run.save_checkpoint("best", write)


def test_a_replacing_run_stopped_midway_leaves_the_earlier_run_whole(tmp_path):
    """Before, `--overwrite` wrote straight into the earlier run: a kill after the first evaluation left the new
    run's best/ beside the earlier run's summary.json and last/ (a mixed, mislabelled directory)."""
    out = str(tmp_path / "rr")
    earlier = _earlier_run(out)
    run = TrainingRun(out, replace=True)
    run.log("config", seed=2)
    _save_best(run, "B step 0")
    run.plot()
    assert _files(out) == earlier  # stopped here: nothing of run B in out


def test_a_replacing_run_replaces_the_earlier_one_once_complete(tmp_path):
    out = str(tmp_path / "rr")
    earlier = _earlier_run(out)
    TrainingRun(out, replace=True).open()  # a replacing run that was stopped: its leftovers are started over
    run = TrainingRun(out, replace=True)
    best = _save_best(run, "B best")
    summary = run.finish({"best_dir": best, "best_step": 5})
    assert run.final_path(best) == os.path.join(out, "best") == summary["best_dir"]
    files = _files(out)
    assert files["best/model.safetensors"] == "B best" and "last/model.safetensors" not in files
    assert json.loads(files["summary.json"])["best_dir"] == os.path.join(out, "best")
    assert files["train_log.jsonl.previous"] == earlier["train_log.jsonl"]
    assert sorted(os.listdir(tmp_path)) == ["rr"]  # no rr.unfinished


def test_opening_a_run_sweeps_what_killed_saves_left(tmp_path):
    """A kill during a save left ``.best.tmp-PID/`` (a whole checkpoint) and ``.dev_ndcg.png.tmp-*.tmp``."""
    out = tmp_path / "rr"
    (out / ".best.tmp-4242").mkdir(parents=True)
    (out / ".best.tmp-4242" / "model.safetensors").write_text("x")
    (out / ".dev_ndcg.png.tmp-k3j2.tmp").write_text("x")
    (out / "notes.txt").write_text("mine")
    TrainingRun(str(out)).open()
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_a_checkpoint_moved_aside_by_a_killed_save_counts_as_the_earlier_run(tmp_path):
    """A kill between the two renames of a save left ``best.old-PID`` and no ``best/``; it is put back, so the
    run is still known as one (and replaced only once a new one is complete)."""
    out = str(tmp_path / "rr")
    _earlier_run(out)
    os.remove(os.path.join(out, "summary.json"))
    shutil.rmtree(os.path.join(out, "last"))  # killed before its end: best/ is all it saved
    os.rename(os.path.join(out, "best"), os.path.join(out, "best.old-4242"))
    run = TrainingRun(out, replace=True)
    assert run.staged and os.path.isfile(os.path.join(out, "best", "model.safetensors"))
