"""Joining torchrun's process group: the backend follows the device the command computes on."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

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


def _shards_worker(rank_id: int, world: int, init_file: str, failing: tuple[int, ...], out: str) -> None:
    """`gather_shards` on a gloo world of `world` whose compute fails on the ranks in `failing`; writes what this
    rank raised to OUT/rank<r>.json."""
    import json

    from twotower.common.distributed import (
        DistInfo,
        PeerStopped,
        cleanup,
        gather_shards,
        met_by_this_rank_only,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_id, world_size=world)
    info = DistInfo(world, rank_id, rank_id)

    def compute(items):
        if rank_id in failing:
            raise ValueError(f"rank {rank_id}'s share is bad")
        import numpy as np

        return np.zeros((len(items), 2), dtype=np.float32)

    try:
        gather_shards(list(range(8)), compute, info)
        said = {"raised": None}
    except PeerStopped:
        said = {"raised": "PeerStopped"}
    except ValueError as exc:
        said = {"raised": str(exc), "this_rank_only": met_by_this_rank_only(exc)}
    with open(f"{out}/rank{rank_id}.json", "w", encoding="utf-8") as f:
        json.dump(said, f)
    cleanup(info)


@pytest.mark.parametrize("failing", [(1,), (0, 1)])
def test_a_share_that_failed_on_a_rank_rank_0_did_not_is_marked_for_that_rank_to_say(tmp_path, failing):
    """Rank 1's failed share was re-raised on rank 1 alone, whose errors the command line does not print (rank 0
    speaks for all): the run ended with no word of why. Marked `this_rank_only`, rank 1 says it; when rank 0
    failed too, rank 0's says it and rank 1's stays unmarked (not said twice)."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_shards_worker, args=(2, str(tmp_path / "init"), failing, str(tmp_path)), nprocs=2, join=True)
    said = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    if failing == (1,):
        assert said == [{"raised": "PeerStopped"}, {"raised": "rank 1's share is bad", "this_rank_only": True}]
    else:
        assert said == [{"raised": "rank 0's share is bad", "this_rank_only": False},
                        {"raised": "rank 1's share is bad", "this_rank_only": False}]


@pytest.fixture()
def group_calls(monkeypatch):
    """A joined group whose barrier and teardown are recorded instead of run."""
    calls: list[str] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *a, **kw: calls.append("barrier"))
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a, **kw: calls.append("destroy"))
    return calls


def test_cleanup_after_a_failure_leaves_without_the_barrier(group_calls):
    """The other ranks may still be working: a barrier after this rank alone failed waits for them until the
    group's timeout (12 h)."""
    from twotower.common.distributed import DistInfo, cleanup

    cleanup(DistInfo(2, 1, 1), failed=True)
    assert group_calls == ["destroy"]
    group_calls.clear()
    cleanup(DistInfo(2, 1, 1))
    assert group_calls == ["barrier", "destroy"]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, ValueError])
def test_pretrain_stopped_on_one_rank_does_not_wait_at_the_barrier(group_calls, monkeypatch, stop):
    """SIGTERM to one pretrain rank (KeyboardInterrupt there) hung the job: its cleanup waited at the barrier
    while the other ranks went on training."""
    from twotower.common.distributed import DistInfo
    from twotower.encoder.pretraining import pretrain as module

    def fail(args, info):
        raise stop("stopped")

    monkeypatch.setattr(module, "init_distributed", lambda device: DistInfo(2, 1, 1))
    monkeypatch.setattr(module, "_pretrain", fail)
    with pytest.raises(stop):
        module.pretrain(SimpleNamespace(device="cpu"))
    assert group_calls == ["destroy"]
    monkeypatch.setattr(module, "_pretrain", lambda args, info: {"done": True})
    group_calls.clear()
    assert module.pretrain(SimpleNamespace(device="cpu")) == {"done": True} and group_calls == ["barrier", "destroy"]


def test_index_build_stopped_on_one_rank_does_not_wait_at_the_barrier(group_calls, monkeypatch, tmp_path):
    """`index build` left its group with the barrier after any failure, as pretrain did."""
    from twotower.common.distributed import DistInfo
    from twotower.retrieval import build as module

    joined = iter([False])  # not yet joined when the build starts (the build joins and leaves the group)
    monkeypatch.setattr(dist, "is_initialized", lambda: next(joined, True))
    monkeypatch.setattr(module, "init_build_group", lambda: DistInfo(2, 1, 1))

    def stopped(info, compute, share=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "from_main", stopped)
    with pytest.raises(KeyboardInterrupt):
        module.build_index(str(tmp_path / "corpus.jsonl"), str(tmp_path / "out"), None)
    assert group_calls == ["destroy"]


def test_pretrain_swap_is_rank_0s_decision_that_every_rank_hears(monkeypatch, tmp_path):
    """Every rank looked at --out itself before rank 0 swapped (rank 0 later, after writing the checkpoint):
    a file that came or went between those moments made one rank refuse alone, and the others hung at the
    barrier or swapped anyway. Rank 0 decides now, and the others take its outcome."""
    from twotower.common.distributed import DistInfo
    from twotower.encoder.pretraining import pretrain as module

    out, work = tmp_path / "run", tmp_path / "run.unfinished"
    out.mkdir()
    work.mkdir()
    (out / "notes.txt").write_text("a file rank 1 sees, which rank 0 will not")
    heard = []
    monkeypatch.setattr(module, "stopped_anywhere", lambda error, info, who: heard.append((info.rank, error)),
                        raising=False)
    monkeypatch.setattr(module, "commit_staged_run", lambda *a, **k: heard.append("swapped"))
    args = SimpleNamespace(out=str(out))
    assert module.finish_out_dir(args, str(work), DistInfo(2, 1, 1)) == str(out)
    assert heard == [(1, None)]  # rank 1 neither refused nor swapped: it waits for rank 0's outcome
    heard.clear()
    assert module.finish_out_dir(args, str(work), DistInfo(2, 0, 0)) == str(out)
    assert heard == ["swapped", (0, None)]
