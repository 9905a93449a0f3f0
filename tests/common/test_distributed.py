"""Joining torchrun's process group: the backend follows the device the command computes on."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from twotower.common.distributed import COLLECTIVE_TIMEOUT_HOURS, init_distributed


@pytest.fixture()
def joined(monkeypatch):
    """A torchrun world of 2 on a machine that reports a GPU; records what init_process_group was asked for."""
    calls: list[dict] = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    return calls


@pytest.mark.parametrize("device, backend", [("cpu", "gloo"), (None, "nccl"), ("cuda", "nccl"), ("cuda:1", "nccl")])
def test_the_backend_follows_the_device(joined, device, backend):
    """`--device cpu` on a machine with a GPU joined NCCL, whose collectives refuse CPU tensors."""
    info = init_distributed(device)
    assert (info.world_size, info.rank) == (2, 0)
    assert joined == [{"backend": backend, "timeout": datetime.timedelta(hours=COLLECTIVE_TIMEOUT_HOURS)}]


def test_alone_nothing_is_joined(joined, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE")
    assert init_distributed("cpu").world_size == 1 and joined == []


class _Joined(Exception):
    """Raised by the stand-in init_process_group once it has recorded its arguments: the test stops there."""


@pytest.mark.parametrize("command", ["dual", "reranker"])
def test_train_joins_with_the_backend_of_its_device_flag(joined, monkeypatch, tmp_path, command):
    """The trainers joined without their --device, so `--device cpu` beside a GPU joined NCCL."""
    from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
    from twotower.cli import main

    def record(**kw):
        joined.append(kw)
        raise _Joined

    monkeypatch.setattr(dist, "init_process_group", record)
    data = ["--data", tiny_beir_dir()] if command == "dual" else ["--pairs", tiny_beir_dir()]
    with pytest.raises(_Joined):
        main(["train", command, "--model", tiny_model_dir(), *data, "--out", str(tmp_path / "o"), "--device", "cpu",
              "--no-progress"])
    assert [kw["backend"] for kw in joined] == ["gloo"]
