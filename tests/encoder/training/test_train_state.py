"""The training state's directory under a kill: the last complete state stays readable, a save's leftovers sweepable."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from twotower.common import atomic
from twotower.common.atomic import sweep_temporaries
from twotower.encoder.training import train_state
from twotower.encoder.training.optim import make_optimizer
from twotower.encoder.training.train_state import load_train_state, save_train_state


class Killed(BaseException):
    """Stands for a SIGKILL at one point of a save (raised, as nothing else can stop a save there in-process)."""


def _save(directory: str, step: int) -> None:
    model = torch.nn.Linear(3, 2)
    save_train_state(directory, model.state_dict(), make_optimizer(model, lr=1e-2), {"step": step})


def test_a_state_moved_aside_by_a_killed_save_is_read_back(tmp_path, monkeypatch):
    """Where names cannot be exchanged, a kill between the two renames of a save left ``trainer_state.old-PID``
    and no ``trainer_state/``: a resume said there was no training state."""
    directory = str(tmp_path / "trainer_state")
    _save(directory, 1)
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: False, raising=False)
    real_replace = os.replace

    def replace(src, dst):
        if dst == directory:  # the new state's rename into place
            raise Killed
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Killed):
        _save(directory, 2)
    monkeypatch.undo()
    assert load_train_state(directory).user == {"step": 1}
    assert sorted(os.listdir(tmp_path)) == ["trainer_state"]


def test_a_save_killed_before_its_swap_leaves_a_copy_the_next_start_sweeps(tmp_path, monkeypatch):
    """Its temporary copy (the whole model and optimizer) carries the project's temporary-name marker."""
    directory = str(tmp_path / "trainer_state")
    _save(directory, 1)

    def killed(build, target):
        raise Killed

    monkeypatch.setattr(train_state, "atomic_replace_dir", killed)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: None)  # a killed process cleans nothing up
    with pytest.raises(Killed):
        _save(directory, 2)
    monkeypatch.undo()
    assert len(os.listdir(tmp_path)) == 2
    sweep_temporaries(str(tmp_path))
    assert os.listdir(tmp_path) == ["trainer_state"] and load_train_state(directory).user == {"step": 1}


def test_a_gpu_resume_reads_the_optimizer_on_the_cpu_and_torch_moves_only_the_moments(tmp_path, monkeypatch):
    """The model is read onto the training device, the optimizer onto the CPU: AdamW's ``step`` must stay there
    (on a GPU each step would sync once per parameter to read it), and load_state_dict moves the moments to
    the parameters' device itself. The meta device stands in for a GPU."""
    directory = str(tmp_path / "trainer_state")
    model = torch.nn.Linear(3, 2)
    optimizer = make_optimizer(model, lr=1e-2)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    save_train_state(directory, model.state_dict(), optimizer, {"step": 1})
    read_on: dict[str, str] = {}
    real = train_state.load_safetensors

    def recording(path, device="cpu", **kwargs):
        read_on[os.path.basename(path)] = device
        return real(path, device="cpu", **kwargs)  # no GPU here: the tensors come from the CPU all the same

    monkeypatch.setattr(train_state, "load_safetensors", recording)
    state = load_train_state(directory, map_location="cuda:1")
    assert read_on["model.safetensors"] == "cuda:1" and read_on["optimizer.safetensors"] == "cpu"
    on_gpu = torch.nn.Linear(3, 2, device="meta")
    moved = make_optimizer(on_gpu, lr=1e-2)
    moved.load_state_dict(state.optimizer)
    for s in moved.state.values():
        assert s["step"].device.type == "cpu" and s["exp_avg"].device.type == "meta"


def test_each_rank_restores_the_gpu_generator_rank_0_trained_with(monkeypatch):
    """Under torchrun only rank 0 saves; rank 1 resumes on cuda:1 with the state rank 0's cuda:0 drew from
    (every rank starts from the same seed), not with rank 0's unused cuda:1 generator. States saved before
    (``torch_cuda_<index>`` for every GPU) still restore the device's own. Fake generators: no GPU here."""
    states = {0: torch.tensor([10], dtype=torch.uint8), 1: torch.tensor([11], dtype=torch.uint8)}
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i: states[i].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, i: states.__setitem__(i, state.clone()))

    saved = train_state.capture_rng("cuda")  # rank 0, on its current GPU cuda:0
    assert set(saved) == {"torch_cpu", "torch_cuda"}
    states[1] = torch.tensor([99], dtype=torch.uint8)
    current[0] = 1  # rank 1
    train_state.restore_rng(saved, "cuda:1")
    assert states[1].item() == 10
    train_state.restore_rng({"torch_cuda_0": torch.tensor([20], dtype=torch.uint8),
                             "torch_cuda_1": torch.tensor([21], dtype=torch.uint8)}, "cuda")
    assert (states[0].item(), states[1].item()) == (10, 21)
    train_state.restore_rng(saved, "cpu")  # a CPU resume leaves the GPU generators alone
    assert states[1].item() == 21
