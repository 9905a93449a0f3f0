"""Resuming a retrieval training run: an interrupted run resumed ends bit for bit where the uninterrupted one does,
and a resume that would continue another run is refused naming what differs."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict

import pytest

from tests.common.out_fixtures import adding_a_file
from tests.retrieval.training_fixtures import interrupted_at, tiny_beir_dir, tiny_model_dir
from twotower.retrieval.training import loop
from twotower.retrieval.training.train_dual import DualTrainConfig, train_dual
from twotower.retrieval.training.train_reranker import RerankerTrainConfig, train_reranker
from twotower.retrieval.training.training_run import STATE_DIR

pytestmark = pytest.mark.usefixtures("one_thread")


def _reranker(tmp_path, name="rr", **kw):
    base = dict(model=tiny_model_dir(0.2), pairs=tiny_beir_dir(), out=str(tmp_path / name), group_size=4,
                batch_size=4, max_length=48, lr=2e-3, progress=False, dev_fraction=0.25, dev_rerank_k=10, bf16=False,
                max_steps=9, eval_every=4, save_every=3, save_last=True)
    return RerankerTrainConfig(**{**base, **kw})


def _dual(tmp_path, name="dual", **kw):
    base = dict(model=tiny_model_dir(), data=tiny_beir_dir(), out=str(tmp_path / name), batch_size=4,
                hard_negatives=1, lr=3e-3, doc_max_length=48, progress=False, dev_fraction=0.25, bf16=False,
                max_steps=9, eval_every=4, save_every=3, save_last=True)
    return DualTrainConfig(**{**base, **kw})


def _records(out: str) -> list[dict]:
    with open(os.path.join(out, "train_log.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _what_was_computed(out: str) -> list[dict]:
    """The step and eval records without their clock times."""
    return [{k: v for k, v in r.items() if k != "time"} for r in _records(out) if r["event"] in ("step", "eval")]


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("kind", ["reranker", "dual"])
def test_an_interrupted_run_resumed_ends_where_the_uninterrupted_one_does(tmp_path, monkeypatch, kind):
    make, train = (_reranker, train_reranker) if kind == "reranker" else (_dual, train_dual)
    whole = train(make(tmp_path, "whole"))

    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(8))  # after the state saved at step 6
        with pytest.raises(KeyboardInterrupt):
            train(make(tmp_path, "cut"))
    cut = str(tmp_path / "cut")
    assert os.path.isfile(os.path.join(cut, STATE_DIR, "state.json"))
    assert max(r["step"] for r in _records(cut) if r["event"] == "step") == 7  # step 7 is done again

    resumed = train(make(tmp_path, "cut", resume=True))
    whole_dir = str(tmp_path / "whole")
    weights = "model.safetensors" if kind == "reranker" else "query/model.safetensors"
    if not os.path.isfile(os.path.join(whole_dir, "last", weights)):
        weights = next(os.path.relpath(os.path.join(d, f), os.path.join(whole_dir, "last"))
                       for d, _, fs in os.walk(os.path.join(whole_dir, "last")) for f in fs if f.endswith(".safetensors"))
    for name in ("last", "best"):  # the final weights and the checkpoint chosen, bit for bit
        assert _bytes(os.path.join(whole_dir, name, weights)) == _bytes(os.path.join(cut, name, weights)), name
    # every step's loss, rate and gradient norm, and every evaluation, as the uninterrupted run logged them
    assert _what_was_computed(cut) == _what_was_computed(whole_dir)
    assert (resumed.best_step, resumed.best_score, resumed.steps) == (whole.best_step, whole.best_score, whole.steps)
    assert [r["from_step"] for r in _records(cut) if r["event"] == "resume"] == [6]
    assert not os.path.exists(os.path.join(cut, STATE_DIR))  # a finished run keeps no state
    summary = json.load(open(os.path.join(cut, "summary.json")))
    assert summary["steps"] == 9 and summary["best_step"] == whole.best_step


def test_a_resume_is_refused_when_it_would_continue_another_run(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(5))
        with pytest.raises(KeyboardInterrupt):
            train_reranker(_reranker(tmp_path))
    with pytest.raises(ValueError, match=r"--group-size 3 \(the run: 4\); --lr 0.001 \(the run: 0.002\)"):
        train_reranker(_reranker(tmp_path, resume=True, lr=1e-3, group_size=3))

    # the same files elsewhere are the same inputs; an edited one is not
    moved = str(tmp_path / "moved")
    shutil.copytree(tiny_beir_dir(), moved)
    with open(os.path.join(moved, "queries.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps({"_id": "extra", "text": "one more query"}) + "\n")
    with pytest.raises(ValueError, match=r"--pairs queries.jsonl has changed since the run read it"):
        train_reranker(_reranker(tmp_path, resume=True, pairs=moved))

    # a file beside the data is no input; the qrels split trained on is
    with open(os.path.join(moved, "queries.jsonl"), "w", encoding="utf-8") as f:
        f.write(open(os.path.join(tiny_beir_dir(), "queries.jsonl"), encoding="utf-8").read())
    with open(os.path.join(moved, "qrels", "train.tsv"), "a", encoding="utf-8") as f:
        f.write("extra\td0\t1\n")
    with pytest.raises(ValueError, match=r"--pairs qrels/train.tsv has changed since the run read it"):
        train_reranker(_reranker(tmp_path, resume=True, pairs=moved))
    shutil.copyfile(os.path.join(tiny_beir_dir(), "qrels", "train.tsv"), os.path.join(moved, "qrels", "train.tsv"))
    with open(os.path.join(moved, "README.md"), "w", encoding="utf-8") as f:
        f.write("notes\n")

    # how it watches and where it computes may differ, and the data may move: the resumed run finishes
    res = train_reranker(_reranker(tmp_path, resume=True, save_every=None, progress=True, pairs=moved))
    assert res.steps == 9
    with pytest.raises(ValueError, match="finished .*nothing is left to continue"):
        train_reranker(_reranker(tmp_path, resume=True))
    with pytest.raises(ValueError, match=r"no training state in .*start the run again without --resume"):
        train_reranker(_reranker(tmp_path, "never", resume=True))


def test_a_run_killed_before_its_first_save_has_nothing_to_resume_and_a_damaged_state_is_named(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(2))  # the step-0 evaluation saves no state
        with pytest.raises(KeyboardInterrupt):
            train_reranker(_reranker(tmp_path))
    with pytest.raises(ValueError, match="no training state.*start the run again with --overwrite instead of"):
        train_reranker(_reranker(tmp_path, resume=True))

    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(5))
        with pytest.raises(KeyboardInterrupt):
            train_reranker(_reranker(tmp_path, "damaged"))
    state = os.path.join(str(tmp_path / "damaged"), STATE_DIR)
    with open(os.path.join(state, "optimizer.safetensors"), "r+b") as f:
        f.truncate(100)
    from twotower.common.errors import DataError

    with pytest.raises(DataError, match="optimizer.safetensors"):
        train_reranker(_reranker(tmp_path, "damaged", resume=True))


def test_a_replacing_run_resumes_in_its_staging_directory_and_the_earlier_run_stays_whole(tmp_path, monkeypatch):
    first = train_reranker(_reranker(tmp_path, max_steps=2, eval_every=2))
    out = str(tmp_path / "rr")
    before = _bytes(os.path.join(out, "best", "model.safetensors"))
    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(5))
        with pytest.raises(KeyboardInterrupt):
            train_reranker(_reranker(tmp_path, overwrite=True))
    assert _bytes(os.path.join(out, "best", "model.safetensors")) == before and first.steps == 2
    assert os.path.isdir(os.path.join(out + ".unfinished", STATE_DIR))
    res = train_reranker(_reranker(tmp_path, overwrite=True, resume=True))
    assert res.steps == 9 and res.best_dir.startswith(out + os.sep) and not os.path.exists(out + ".unfinished")
    assert json.load(open(os.path.join(out, "summary.json")))["steps"] == 9


def _clocked_loop(out: str, monkeypatch, clock: list[float], resume: bool = False, stop_at: int | None = None):
    """A loop over one weight on a fake clock (each step 1 s) whose 30 s time budget binds from the fifth step,
    so that its learning rates follow re-planned schedules (`LrState`, the paces); resumed from `out`'s state."""
    import torch

    from twotower.encoder.training.train_state import read_train_user
    from twotower.retrieval.training.loop import Schedule, TrainingLoop
    from twotower.retrieval.training.training_run import TrainingRun

    monkeypatch.setattr(TrainingRun, "elapsed", property(lambda self: clock[0]))
    monkeypatch.setattr(loop.time, "perf_counter", lambda: clock[0])
    holder = torch.nn.Module()
    holder.w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([holder.w], lr=0.1)
    run = TrainingRun(out, resume=resume)
    if resume:
        user = read_train_user(run.state_dir)
        run.resume_at(user["steps"], user["elapsed"], user["log_records"])
        clock[0] = user["elapsed"]

    def step(done):
        if done == stop_at:
            raise KeyboardInterrupt
        clock[0] += 1.0
        loss = (holder.w - 1.0).pow(2).sum()
        loss.backward()
        return loss, {}

    schedule = Schedule(total_steps=40, eval_every=10, lr=0.1, warmup=0.2, time_budget=30.0)
    return TrainingLoop(run, schedule, opt, [holder.w], 1.0, [holder], step, lambda s: {"ndcg@10": 0.5},
                        lambda d, s, sc: None, progress=False, state_module=holder, skip=lambda done: None,
                        save_every=4)


def test_a_resumed_run_whose_time_budget_binds_takes_the_rates_of_the_uninterrupted_one(tmp_path, monkeypatch):
    whole = _clocked_loop(str(tmp_path / "whole"), monkeypatch, [0.0]).train()
    rates = [r["lr"] for r in _step_records(tmp_path / "whole")]
    assert whole.stopped_by == "time budget" and len(set(rates)) > 10

    clock = [0.0]
    with pytest.raises(KeyboardInterrupt):
        _clocked_loop(str(tmp_path / "cut"), monkeypatch, clock, stop_at=18).train()  # saved at 16
    clock[0] += 500.0  # the time between the two processes is not the run's
    resumed = _clocked_loop(str(tmp_path / "cut"), monkeypatch, clock, resume=True).train()
    assert (resumed.stopped_by, resumed.steps) == (whole.stopped_by, whole.steps)
    assert [r["lr"] for r in _step_records(tmp_path / "cut")] == rates

    # killed after the loop, before the run finished (the trainer's last work): the state saved as the budget
    # ended the run resumes to that end, with no step more
    again = _clocked_loop(str(tmp_path / "whole"), monkeypatch, [0.0], resume=True).train()
    assert (again.stopped_by, again.steps) == ("time budget", whole.steps)
    assert [r["lr"] for r in _step_records(tmp_path / "whole")] == rates


def _step_records(out) -> list[dict]:
    return [r for r in _records(str(out)) if r["event"] == "step"]


def _rank_worker(rank_id: int, world: int, init_file: str, settings: dict, stop_at: int | None) -> None:
    import torch
    import torch.distributed as dist

    from twotower.common.distributed import DistInfo, cleanup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_id, world_size=world)
    if stop_at is not None:  # every rank stops at the same step, as when the job is killed
        real = loop.TrainingLoop._step

        def _step(self, bar):
            if self.steps == stop_at - 1:
                raise RuntimeError("stopped")
            return real(self, bar)

        loop.TrainingLoop._step = _step
    train_reranker(RerankerTrainConfig(**settings))
    cleanup(DistInfo(world, rank_id, rank_id))


@pytest.mark.slow  # 20 s of spawned ranks on 2 cores: the default suite stays under 10 minutes
def test_under_torchrun_a_resumed_run_gives_each_rank_its_own_dropout_stream_back(tmp_path):
    """Each rank draws its own dropout masks (seeded seed + rank): rank 1's stream must come back as rank 1's."""
    import torch.multiprocessing as mp

    def spawn(out: str, init: str, stop_at: int | None = None, **kw) -> None:
        settings = {**asdict(_reranker(tmp_path, out, **kw)), "device": "cpu"}
        mp.spawn(_rank_worker, args=(2, str(tmp_path / init), settings, stop_at), nprocs=2, join=True)

    spawn("whole", "init-whole", max_steps=6, eval_every=3, save_every=None)
    with pytest.raises(Exception, match="stopped"):
        spawn("cut", "init-cut", stop_at=5, max_steps=6, eval_every=3, save_every=None)
    spawn("cut", "init-resumed", max_steps=6, eval_every=3, save_every=None, resume=True)
    for name in ("last", "best"):
        assert (_bytes(str(tmp_path / "whole" / name / "model.safetensors"))
                == _bytes(str(tmp_path / "cut" / name / "model.safetensors"))), name
    assert _what_was_computed(str(tmp_path / "cut")) == _what_was_computed(str(tmp_path / "whole"))


def _dev_scores(score):
    """A `TrainingLoop.__post_init__` whose dev nDCG@10 at each step is ``score(step)``: which evaluations improve."""
    from twotower.retrieval.training.loop import TrainingLoop

    real = TrainingLoop.__post_init__

    def post_init(self):
        real(self)
        evaluate = self.evaluate
        self.evaluate = lambda step: {**evaluate(step), "ndcg@10": score(step)}

    return post_init


def test_a_kill_between_a_better_checkpoint_and_the_state_leaves_best_and_the_summary_naming_the_same_step(
        tmp_path, monkeypatch):
    """The state is saved after ``best/``: killed between the two, ``best/`` is a step ahead of the state. Where the
    steps done again score lower (a GPU, another device), the summary named an older step than ``best/`` held."""
    from twotower.retrieval.training.loop import TrainingLoop

    real = TrainingLoop._save_state

    def killed_after_best(self, last_eval, stopped_by):
        if self.steps == 8:  # best/ of step 8 is saved; the state is not
            raise KeyboardInterrupt
        return real(self, last_eval, stopped_by)

    cfg = dict(max_steps=12, eval_every=4, save_every=None, collapse_std=0.0)
    with monkeypatch.context() as m:
        m.setattr(TrainingLoop, "_save_state", killed_after_best)
        m.setattr(TrainingLoop, "__post_init__", _dev_scores(lambda step: step / 100))  # each evaluation better
        with pytest.raises(KeyboardInterrupt):
            train_reranker(_reranker(tmp_path, **cfg))
    out = str(tmp_path / "rr")
    assert json.load(open(os.path.join(out, "best", "training_args.json")))["step"] == 8
    orphan = _bytes(os.path.join(out, "best", "model.safetensors"))
    with monkeypatch.context() as m:  # the steps done again score lower now
        m.setattr(TrainingLoop, "__post_init__", _dev_scores(lambda step: step / 100 if step <= 4 else 0.0))
        res = train_reranker(_reranker(tmp_path, resume=True, **cfg))
    assert (res.best_step, res.best_score) == (8, 0.08)  # what best/ holds
    assert _bytes(os.path.join(out, "best", "model.safetensors")) == orphan


def test_a_new_run_in_the_directory_of_a_stopped_one_sets_its_state_aside(tmp_path, monkeypatch):
    """A run stopped before any checkpoint (no ``best/``) may be started again without --overwrite; stopped again
    before its first save, a --resume continued the earlier run's state under the new run's log."""
    cfg = dict(eval_at_start=False, eval_every=8, save_every=2)
    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(4))  # saved at step 2, no checkpoint yet
        with pytest.raises(KeyboardInterrupt):
            train_reranker(_reranker(tmp_path, **cfg))
    out = str(tmp_path / "rr")
    assert os.path.isdir(os.path.join(out, STATE_DIR)) and not os.path.exists(os.path.join(out, "best"))
    with monkeypatch.context() as m:
        m.setattr(loop.TrainingLoop, "_step", interrupted_at(2))  # the new run stops before its first save
        with pytest.raises(KeyboardInterrupt):
            train_reranker(_reranker(tmp_path, **cfg))
    with pytest.raises(ValueError, match="no training state"):
        train_reranker(_reranker(tmp_path, resume=True, **cfg))


def test_a_rank_whose_own_generator_is_missing_from_the_state_says_so_itself(tmp_path, monkeypatch):
    """Rank 1 found no generator of its own and raised; rank 0, which alone prints errors, had nothing to say
    (it failed in its next collective, "Connection closed by peer"), so a torchrun resume ended with no word of
    ours. The ranks now learn of it together: rank 1's error is marked as its alone, naming the file, and rank 0
    stops quietly (`PeerStopped`)."""
    import twotower.common.distributed as distributed
    from twotower.common.distributed import DistInfo, PeerStopped, met_by_this_rank_only
    from twotower.common.errors import DataError

    clock = [0.0]
    with pytest.raises(KeyboardInterrupt):
        _clocked_loop(str(tmp_path / "cut"), monkeypatch, clock, stop_at=6).train()  # saved at 4, by one process
    resumed = _clocked_loop(str(tmp_path / "cut"), monkeypatch, clock, resume=True)
    # the ranks' exchange, stood in for: of two ranks, rank 1 failed (the state holds rank 0's generator alone)
    monkeypatch.setattr(distributed, "_comm_device", lambda: "cpu")
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda values, info, device: [1.0, 0.0])
    resumed._dist = DistInfo(2, 1)
    with pytest.raises(DataError, match=r"rng.safetensors: damaged: it holds no random generator of rank 1") as info:
        resumed._resume()
    assert met_by_this_rank_only(info.value)
    resumed._dist = DistInfo(2, 0)  # rank 0's is there: it stops with rank 1
    with pytest.raises(PeerStopped):
        resumed._resume()


@pytest.mark.parametrize("where", ["load_train_state", "restore_train_state"])
def test_a_rank_that_fails_alone_loading_or_restoring_the_state_says_so_itself(tmp_path, monkeypatch, where):
    """Only the missing generator went through the ranks' exchange: a state that failed to load on rank 1 alone
    (before it), or to restore (after it), was raised on rank 1 alone, unmarked, so rank 1 said nothing and rank
    0 failed in its next collective. One exchange now covers the whole load and restore."""
    import dataclasses

    import twotower.common.distributed as distributed
    from twotower.common.distributed import DistInfo, met_by_this_rank_only
    from twotower.common.errors import DataError
    from twotower.retrieval.training import loop as loop_module

    clock = [0.0]
    with pytest.raises(KeyboardInterrupt):
        _clocked_loop(str(tmp_path / "cut"), monkeypatch, clock, stop_at=6).train()  # saved at 4, by one process
    resumed = _clocked_loop(str(tmp_path / "cut"), monkeypatch, clock, resume=True)

    real_load = loop_module.load_train_state

    def with_rank_1s(*args, **kwargs):  # as two ranks save it: rank 1's generator too
        state = real_load(*args, **kwargs)
        return dataclasses.replace(state, rng={**state.rng, **{f"rank1/{k}": v for k, v in state.rng.items()}})

    def unreadable(*args, **kwargs):
        raise DataError(str(tmp_path / "cut"), None, "unreadable on this node")

    monkeypatch.setattr(loop_module, "load_train_state", with_rank_1s)
    monkeypatch.setattr(loop_module, where, unreadable)
    # the ranks' exchange, stood in for: of two ranks, rank 1 failed
    monkeypatch.setattr(distributed, "_comm_device", lambda: "cpu")
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda values, info, device: [1.0, 0.0])
    resumed._dist = DistInfo(2, 1)
    with pytest.raises(DataError, match="unreadable on this node") as info:
        resumed._resume()
    assert met_by_this_rank_only(info.value)


def test_a_replacing_run_is_not_swapped_over_files_added_while_it_ran_and_resume_swaps_it_in(tmp_path,
                                                                                            monkeypatch):
    """A file the user put in --out while the replacing run trained was deleted by the swap at its end: the
    complete run now stays in OUT.unfinished, and once the file is moved out --resume swaps it in."""
    from twotower.retrieval.training import training_run

    train_reranker(_reranker(tmp_path, max_steps=2, eval_every=2))
    out = str(tmp_path / "rr")
    with monkeypatch.context() as m:  # the user adds a file at the moment of the swap
        m.setattr(training_run, "commit_staged_run",
                  adding_a_file(training_run.commit_staged_run, os.path.join(out, "notes.txt")))
        with pytest.raises(ValueError, match=r"files of yours \(notes.txt\).*nothing was swapped"):
            train_reranker(_reranker(tmp_path, overwrite=True))
    assert _bytes(os.path.join(out, "notes.txt")) == b"mine\n"
    assert json.load(open(os.path.join(out, "summary.json")))["steps"] == 2
    assert json.load(open(os.path.join(out + ".unfinished", "summary.json")))["steps"] == 9
    os.remove(os.path.join(out, "notes.txt"))
    res = train_reranker(_reranker(tmp_path, overwrite=True, resume=True))
    assert res.steps == 9 and not os.path.exists(out + ".unfinished")
    assert json.load(open(os.path.join(out, "summary.json")))["steps"] == 9
    assert not os.path.exists(os.path.join(out, STATE_DIR))
