"""Whether a resume continues the run that saved its state: a model named otherwise is the same model, and the
warning about another device is said once under torchrun."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest

from twotower.encoder.training.same_run import check_same_run


def _identity(model: str, device: str = "cpu") -> dict:
    return {"settings": {"model": model, "lr": 0.1}, "inputs": {}, "world_size": 1,
            "compute": {"device": device, "bf16": False}}


def test_a_model_is_compared_by_the_directory_it_names_not_as_typed(tmp_path, monkeypatch):
    """`./m` against `/abs/m` (or `m` from another working directory) was refused as another run."""
    (tmp_path / "m").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    saved = _identity(str(tmp_path / "m"))
    check_same_run(saved, _identity("./m"), "run", {}, "", "", paths=("model",))
    check_same_run(_identity("m"), _identity(str(tmp_path / "m") + "/"), "run", {}, "", "", paths=("model",))
    with pytest.raises(ValueError, match=r"--model .*other \(the run: .*m\)"):
        check_same_run(saved, _identity("other"), "run", {}, "", "", paths=("model",))
    with pytest.raises(ValueError, match="--model"):  # not a path setting: as typed
        check_same_run(saved, _identity("./m"), "run", {}, "", "")


def test_another_device_is_warned_of_by_rank_0_alone(caplog, monkeypatch):
    """Every rank checks the resume: the warning came once per rank."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    said = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="twotower.encoder.training.same_run"):
            check_same_run(_identity("m", "cuda"), _identity("m", "cpu"), "run", {}, "", "--device")
        said.append(sum("computed differently" in r.getMessage() for r in caplog.records))
    assert said == [1, 0]


@dataclass
class _Cfg:
    """The settings of a run as the trainers' configs hold them (`resume.run_identity`)."""

    model: str
    lr: float = 0.1


def _run(model: str) -> dict:
    from twotower.retrieval.training import resume

    return resume.run_identity(_Cfg(model), 1, {"device": "cpu", "bf16": False})


def test_a_run_whose_project_directory_moved_is_resumed_by_the_same_command(tmp_path, monkeypatch):
    """Started in /A with `--model m`, resumed after /A moved to /A2: refused "--model /A2/m (the run: /A/m)",
    since only the real path was recorded; `m` was `m` before real paths were compared."""
    from twotower.retrieval.training import resume

    (tmp_path / "A" / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "A")
    saved = _run("m")
    resume.check_same_run(saved, _run(str(tmp_path / "A" / "m")), "run")  # `/abs/m` for `m`: the same model
    (tmp_path / "A" / "m2").mkdir()
    with pytest.raises(ValueError, match=r"--model .*/A/m2 \(the run: .*/A/m\)"):  # another model: refused
        resume.check_same_run(saved, _run("m2"), "run")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "A").rename(tmp_path / "A2")
    monkeypatch.chdir(tmp_path / "A2")
    resume.check_same_run(saved, _run("m"), "run")
    resume.check_same_run(saved, _run("./m"), "run")  # typed otherwise after the move: the same directory
    with pytest.raises(ValueError, match=r"--model .*/A2/m2 \(the run: .*/A/m\)"):
        resume.check_same_run(saved, _run("m2"), "run")


def test_a_model_typed_the_same_that_names_another_directory_is_refused(tmp_path, monkeypatch):
    """`--model m` from another working directory, while the run's own `m` still exists, is another model."""
    from twotower.retrieval.training import resume

    for d in ("A", "B"):
        (tmp_path / d / "m").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "A")
    saved = _run("m")
    monkeypatch.chdir(tmp_path / "B")
    with pytest.raises(ValueError, match=r"--model .*/B/m \(the run: .*/A/m\)"):
        resume.check_same_run(saved, _run("m"), "run")
