"""Whether a resume continues the run that saved its state: a model named otherwise is the same model, and the
warning about another device is said once under torchrun."""

from __future__ import annotations

import logging

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
