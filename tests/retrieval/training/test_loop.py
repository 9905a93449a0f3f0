"""The shared training loop: schedule, learning rate, evaluation steps, best checkpoint, guard, stops.

A one-parameter model and scripted dev scores make every expectation a worked example.
"""

from __future__ import annotations

import json
import os
import random
import re
from types import SimpleNamespace

import pytest
import torch

from twotower.retrieval.training.loop import (
    LoopResult,
    Schedule,
    StopTraining,
    TrainingLoop,
    TrainSettings,
    start_run,
    step_pace,
)
from twotower.retrieval.training.training_run import TrainingRun


class _Halt(StopTraining):
    kind = "halted"


def _loop(tmp_path, scores, schedule, main_process=True, losses=None, **kw):
    """A loop over w (one weight, loss (w - 1)^2 or scripted losses) whose dev scores are `scores` in order."""
    w = torch.nn.Parameter(torch.zeros(1))
    module = torch.nn.Linear(1, 1)  # only its train/eval mode is observed
    opt = torch.optim.SGD([{"params": [w]}, {"params": module.parameters(), "lr_scale": 10.0}], lr=0.0)
    run = TrainingRun(str(tmp_path / "run"), enabled=main_process)
    modes = []
    scripted = iter(scores)
    saved = []

    def step(done):
        modes.append(("step", done, module.training))
        loss = (w - 1.0).pow(2).sum() if losses is None else w.sum() * 0 + losses[done]
        loss.backward()
        return loss, {"done_before": done}

    def evaluate(step):
        modes.append(("eval", step, module.training))
        return {"ndcg@10": next(scripted), "extra": step}

    def save(directory, step, score):
        saved.append((step, score))
        with open(os.path.join(directory, "step.json"), "w") as f:
            json.dump({"step": step, "score": score}, f)

    loop = TrainingLoop(run, schedule, opt, [w], 1.0, [module], step, evaluate, save, main_process=main_process,
                        progress=False, **kw)
    return loop, SimpleNamespace(run=run, opt=opt, modes=modes, saved=saved, w=w)


def _records(parts, event):
    return [r for r in parts.run.records if r["event"] == event]


def test_schedule_from_settings():
    cfg = TrainSettings()  # an epoch, evaluated once an epoch
    assert Schedule.of(cfg, steps_per_epoch=10, lr=1e-3) == Schedule(10, 10, 1e-3, 0.1)
    cfg.epochs, cfg.eval_every = 2.5, 4
    assert (Schedule.of(cfg, 10, 1e-3).total_steps, Schedule.of(cfg, 10, 1e-3).eval_every) == (25, 4)
    cfg.max_steps = 7  # max_steps wins over epochs
    assert Schedule.of(cfg, 10, 1e-3).total_steps == 7
    cfg.dry_run = True
    assert Schedule.of(cfg, 10, 1e-3, eval_at_start=False) == Schedule(1, 4, 1e-3, 0.1, eval_at_start=False)


def test_steps_lr_and_evaluation_schedule(tmp_path):
    # 5 steps, warmup a quarter: progress p = 0, .2, .4, .6, .8 before each step
    schedule = Schedule(total_steps=5, eval_every=2, lr=0.5, warmup=0.25)
    loop, parts = _loop(tmp_path, [0.1, 0.4, 0.3, 0.2], schedule)
    result = loop.train()
    steps = _records(parts, "step")
    expected_factor = [0.0, 0.8, 0.8, 0.5333333, 0.2666667]  # p / .25 while p < .25, then 1 - (p - .25) / .75
    assert [r["lr"] for r in steps] == pytest.approx([0.5 * f for f in expected_factor])
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5] and [r["done_before"] for r in steps] == [0, 1, 2, 3, 4]
    # the group with lr_scale 10 trains at 10x the rate of the last step
    assert parts.opt.param_groups[1]["lr"] == pytest.approx(10 * 0.5 * expected_factor[-1])
    # at start, every eval_every steps, and at the last step; evaluations run in eval mode, steps in train mode
    assert [r["step"] for r in _records(parts, "eval")] == [0, 2, 4, 5]
    assert [r["extra"] for r in _records(parts, "eval")] == [0, 2, 4, 5]
    assert all(training for kind, _, training in parts.modes if kind == "step")
    assert not any(training for kind, _, training in parts.modes if kind == "eval")
    assert result == LoopResult(str(tmp_path / "run" / "best"), 2, 0.4, 0.1, 5, "steps", _records(parts, "eval"))
    # the best checkpoint is the one saved at its step; a lower score later never replaces it
    assert parts.saved == [(0, 0.1), (2, 0.4)]
    assert json.load(open(os.path.join(result.best_dir, "step.json"))) == {"step": 2, "score": 0.4}
    assert os.path.isfile(tmp_path / "run" / "dev_ndcg.png")
    # the optimizer did step: SGD on (w - 1)^2 moves w towards 1 whenever the rate is positive
    assert 0 < float(parts.w.detach()) < 1


def test_no_start_eval_and_a_tie_keeps_the_first(tmp_path):
    schedule = Schedule(total_steps=4, eval_every=2, lr=0.1, warmup=0.0, eval_at_start=False)
    loop, parts = _loop(tmp_path, [0.3, 0.3], schedule)
    result = loop.train()
    assert [r["step"] for r in _records(parts, "eval")] == [2, 4]
    assert result.initial_score is None and result.best_step == 2 and parts.saved == [(2, 0.3)]


def test_guard_stops_the_run_and_keeps_the_best(tmp_path):
    def guard(record):
        if record["event"] == "step" and record["step"] == 3:
            raise _Halt("enough at step 3")

    last = []
    schedule = Schedule(total_steps=10, eval_every=2, lr=0.1, warmup=0.0)
    loop, parts = _loop(tmp_path, [0.1, 0.5, 0.9], schedule, guard=guard,
                        save_last=lambda directory, steps: last.append(steps))
    result = loop.train()
    assert result.steps == 3 and result.stopped_by == "halted: enough at step 3"
    assert [(r["step"], r["reason"]) for r in _records(parts, "stop")] == [(3, "enough at step 3")]
    assert result.best_step == 2 and result.best_score == 0.5 and last == [3]
    assert os.path.isdir(tmp_path / "run" / "last")


def test_a_guard_on_eval_records_stops_before_that_checkpoint_is_kept(tmp_path):
    def guard(record):
        if record["event"] == "eval" and record["ndcg@10"] > 0.8:
            raise _Halt("too good to be true")

    schedule = Schedule(total_steps=10, eval_every=2, lr=0.1, warmup=0.0)
    loop, parts = _loop(tmp_path, [0.1, 0.9], schedule, guard=guard)
    result = loop.train()
    assert result.steps == 2 and result.best_step == 0 and parts.saved == [(0, 0.1)]
    assert [r["step"] for r in _records(parts, "eval")] == [0, 2]  # the eval that tripped the guard is logged


def test_non_finite_loss_stops_with_a_record(tmp_path):
    schedule = Schedule(total_steps=5, eval_every=5, lr=0.1, warmup=0.0)
    loop, parts = _loop(tmp_path, [0.1], schedule, losses=[1.0, float("nan"), 1.0, 1.0, 1.0])
    with pytest.raises(FloatingPointError, match="training loss became nan at step 2"):
        loop.train()
    assert [(r["step"], r["reason"]) for r in _records(parts, "stop")] == [(2, "loss is nan")]


def test_time_budget_stops_after_the_step_that_spends_it_and_evaluates_there(tmp_path):
    schedule = Schedule(total_steps=100, eval_every=50, lr=0.1, warmup=0.0, time_budget=1e-9)
    loop, parts = _loop(tmp_path, [0.1, 0.2], schedule)
    result = loop.train()
    assert result.steps == 1 and result.stopped_by == "time budget"
    assert [r["step"] for r in _records(parts, "eval")] == [0, 1]
    assert _records(parts, "step")[0]["lr"] == 0.0  # the budget is spent: the schedule is at its end


def test_other_ranks_step_but_neither_log_evaluations_nor_save(tmp_path):
    schedule = Schedule(total_steps=2, eval_every=1, lr=0.1, warmup=0.0)
    loop, parts = _loop(tmp_path, [0.1, 0.2, 0.3], schedule, main_process=False,
                        save_last=lambda directory, steps: pytest.fail("saved on another rank"))
    result = loop.train()
    assert result.steps == 2 and result.best_dir is None and parts.saved == []
    assert not _records(parts, "eval") and len(_records(parts, "step")) == 2
    assert not os.path.exists(tmp_path / "run")


def _clocked(tmp_path, monkeypatch, schedule, seconds, before=0.0):
    """Train `schedule` on a fake clock: `before` seconds pass before the loop, step i takes ``seconds(i)`` (its
    pace is timed on the same clock) and the clock moves 1e-6 s between a step's start and its rate being set.
    Returns (the step records' factors, the steps planned before each step)."""
    from twotower.retrieval.training import loop as loop_module

    clock = [before]
    monkeypatch.setattr(TrainingRun, "elapsed", property(lambda self: clock[0]))
    monkeypatch.setattr(loop_module.time, "perf_counter", lambda: clock[0])
    planned, plan = [], Schedule.planned_steps

    def recorded(self, step, elapsed, pace):
        planned.append(plan(self, step, elapsed, pace))
        return planned[-1]

    monkeypatch.setattr(Schedule, "planned_steps", recorded)
    loop, parts = _loop(tmp_path, [0.1] * (schedule.total_steps + 2), schedule)
    step, real = loop.step, loop._step

    def timed_step(done):
        clock[0] += seconds(done)
        return step(done)

    def later_step(bar):
        clock[0] += 1e-6
        real(bar)

    loop.step, loop._step = timed_step, later_step
    loop.train()
    return [r["lr"] / schedule.lr for r in _records(parts, "step")], planned


def test_a_time_budget_that_never_binds_leaves_the_learning_rates_as_without_one(tmp_path, monkeypatch):
    # The clock leads the steps early in a run (150 s spent before the loop, the clock moving before the
    # first rate is set); when the time term could win, the rates followed the machine's speed and a seeded
    # run did not repeat itself. Steps are timed on the same fake clock, 1 s each, so the pace is judged too.
    def rates(budget, sub):  # a second a step: 10 s of training against a budget of 1,000
        schedule = Schedule(total_steps=10, eval_every=100, lr=0.1, warmup=0.5, time_budget=budget)
        return _clocked(tmp_path / sub, monkeypatch, schedule, lambda done: 1.0, before=150.0)[0]

    free = rates(None, "free")
    assert free[0] == 0.0 and free[4] == pytest.approx(0.8) and free[5] == pytest.approx(1.0)
    assert rates(1000.0, "budget") == free


@pytest.mark.parametrize("total, warmup", [(10, 0.5), (57, 0.1), (200, 0.0), (1, 0.1)])
def test_without_a_binding_budget_the_rates_are_the_totals_schedule_bit_for_bit(tmp_path, monkeypatch, total, warmup):
    """A re-planned schedule goes on from where its rate is (`Schedule.factor`); a plan that stays the total
    must keep the rates of ``lr_factor(step / total)`` exactly: the shipped reranker is reproduced from a seed."""
    from twotower.encoder.training.optim import lr_factor

    old = [lr_factor(step / total, warmup=warmup) for step in range(total)]
    for budget in (None, 10.0 * total):
        schedule = Schedule(total_steps=total, eval_every=total, lr=1.0, warmup=warmup, time_budget=budget)
        factors, planned = _clocked(tmp_path / str(budget), monkeypatch, schedule, lambda done: 1.0)
        assert planned == [total] * total and factors == old


def _jittered(seed: int):
    rng = random.Random(seed)
    return lambda done: rng.uniform(0.5, 1.5) * (3.0 if done >= 60 else 1.0)  # and the machine slows at step 60


@pytest.mark.parametrize("total, warmup, budget, seconds", [
    (200, 0.3, 60.0, lambda done: 1.0),  # the budget binds in warmup (at step 5, once the pace is known)
    (200, 0.1, 250.0, lambda done: 1.0 if done < 100 else 3.0),  # the steps slow down in the decay: it binds there
    (400, 0.1, 30.0, lambda done: 1.0),  # a plan cut to a tenth: the ramp meets the new plan's decay line
    *[(300, 0.1, budget, _jittered(seed)) for seed, budget in ((0, 150.0), (1, 200.0), (2, 90.0))],
    (300, 0.0, 150.0, _jittered(3)),  # no warmup: decaying from the first step
], ids=["in-warmup", "in-decay", "cut-to-a-tenth", "jitter-0", "jitter-1", "jitter-2", "no-warmup"])
def test_a_replanned_schedule_moves_the_rate_no_faster_than_its_own_slopes(tmp_path, monkeypatch, total, warmup,
                                                                           budget, seconds):
    """When the time budget re-plans the run, ``step / planned`` jumped: from 40 % of the peak in warmup straight
    to the peak, or down the decay. Now each step's factor moves up by at most the warmup slope and down by at
    most the slope of the straight line from the last factor to 0 at the end planned now, and still ends near 0."""
    schedule = Schedule(total_steps=total, eval_every=total, lr=1.0, warmup=warmup, time_budget=budget)
    factors, planned = _clocked(tmp_path, monkeypatch, schedule, seconds)
    assert min(planned) < total and len(factors) < total  # the budget did bind, and ended the run
    rise = 1 / (warmup * total) if warmup else 0.0
    for step in range(1, len(factors)):
        if planned[step] <= step:
            continue  # the budget is spent: the schedule is at its end (0)
        before, now = factors[step - 1], factors[step]
        assert now - before <= rise + 1e-12, (step, before, now)
        assert before - now <= before / (planned[step] - step + 1) + 1e-12, (step, before, now, planned[step])
        assert 0.0 <= now <= 1.0
    assert factors[-1] < 0.1 and max(factors) > 2 * factors[-1]


def test_the_schedules_state_resumes_exactly():
    """What a resumed run would restore (`LrState`, as JSON) continues the schedule with the very rates of the
    uninterrupted run."""
    from dataclasses import asdict

    from twotower.retrieval.training.loop import LrState

    schedule = Schedule(total_steps=300, eval_every=300, lr=1.0, warmup=0.2, time_budget=100.0)
    rng = random.Random(4)
    plans = [300.0] * 8 + [rng.uniform(150, 170) for _ in range(150)]  # re-planned in warmup, then at every step

    def run(start, stop, state):
        factors = []
        for step in range(start, stop):
            factor, state = schedule.factor(step, plans[step], state)
            factors.append(factor)
        return factors, state

    whole, _ = run(0, len(plans), None)
    for stop, warming in ((30, True), (80, False)):  # stopped while warming up, and while decaying
        first, state = run(0, stop, None)
        assert state.warming is warming
        rest, _ = run(stop, len(plans), LrState(**json.loads(json.dumps(asdict(state)))))  # resumed from JSON
        assert first + rest == whole


def test_the_schedule_follows_the_budget_only_where_it_binds():
    schedule = Schedule(total_steps=1000, eval_every=100, lr=0.1, warmup=0.0, time_budget=100.0)
    paced = step_pace([1.0] * 5)
    assert Schedule(1000, 100, 0.1, 0.0).planned_steps(10, 500.0, paced) == 1000  # no budget
    assert schedule.planned_steps(10, 120.0, paced) == 10  # spent: the schedule is at its end
    assert step_pace([1.0] * 3) is None  # too few steps timed to judge the pace
    assert schedule.planned_steps(3, 60.0, None) == 1000
    assert schedule.planned_steps(10, 60.0, paced) == 50  # 40 s left at 1 s a step: 10 + 40 planned
    assert schedule.lr_factor(10, 50) == pytest.approx(0.8)
    loose = Schedule(total_steps=100, eval_every=100, lr=0.1, warmup=0.0, time_budget=1000.0)
    assert step_pace([6.5, 0.4, 0.4, 0.4, 0.4]) == 0.4  # a slow first step is not the pace
    assert loose.planned_steps(5, 160.0, step_pace([6.5, 0.4, 0.4, 0.4, 0.4])) == 100


def test_under_torchrun_the_ranks_agree_on_the_clock_and_on_a_guards_stop(tmp_path):
    """Two ranks whose clocks run at 1 and 3 s a step: one learning rate, one stop, no rank left waiting.

    Each rank used to read its own clock: rank 1 ran out of budget at step 7 and left the loop while rank 0
    waited in the next step's all-reduce, and their rates (planned from their own paces) differed; a guard's
    stop on rank 0 left rank 1 waiting the same way, and so did a non-finite loss on one rank.
    (loop_ranks_worker.py runs all three.)
    """
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(__file__), "loop_ranks_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", worker,
           str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = []
    for i in (0, 1):
        with open(tmp_path / f"rank{i}.json", encoding="utf-8") as f:
            ranks.append(json.load(f))
    a, b = ranks[0]["budget"], ranks[1]["budget"]
    assert a["stopped_by"] == b["stopped_by"] == "time budget"
    assert a["steps"] == b["steps"] == 11  # the mean clock, 2 s a step, passes the 20 s budget after step 11
    assert a["lrs"] == b["lrs"] and a["w"] == b["w"]  # one schedule, so the replicas stay identical
    assert a["lrs"][-1] < 0.5 * max(a["lrs"])  # the schedule was laid over the steps the budget allowed
    g0, g1 = ranks[0]["guard"], ranks[1]["guard"]
    assert g0["steps"] == g1["steps"] == 10
    assert g0["stopped_by"] == "halted: dev score collapsed"
    assert g1["stopped_by"] == "stopped: stopped on rank 0 at step 10"
    n0, n1 = ranks[0]["nan"], ranks[1]["nan"]  # a non-finite loss on rank 1 ends the run on both
    assert n0["steps"] == n1["steps"] == 3
    assert n1["error"].startswith("training loss became nan at step 3")
    assert n0["error"].startswith("training loss became non-finite on another rank at step 3")


@pytest.mark.parametrize("field, value, message", [
    ("max_steps", 0, "max_steps=0: give 1 or more (--max-steps)"),  # 0 fell through to an epoch
    ("eval_every", 0, "eval_every=0: give 1 or more (--eval-every)"),  # the same
    ("epochs", -1.0, "epochs=-1.0: give a number of epochs > 0 (--epochs)"),  # trained one step
    ("epochs", float("nan"), "epochs=nan"),
    ("warmup", 1.5, "warmup=1.5: give a fraction of the run in [0, 1) (--warmup)"),
    ("max_grad_norm", 0.0, "max_grad_norm=0.0: give a norm > 0"),  # zeroed every update
    ("weight_decay", -0.1, "weight_decay=-0.1: give 0 or more (--weight-decay)"),
    ("dev_fraction", 0.0, "dev_fraction=0.0: give a fraction in (0, 1) (--dev-fraction)"),
    ("time_budget", 0.0, "time_budget=0.0: give a duration > 0 (--time-budget)"),
    ("lr", -1e-5, "lr=-1e-05: give a learning rate >= 0 (--lr)"),  # torch's "Invalid learning rate"
    ("batch_size", 0, "batch_size=0: give 1 or more (--batch-size)"),  # a ZeroDivisionError in the reranker
])
@pytest.mark.parametrize("trainer", ["reranker", "dual"])
def test_settings_that_would_train_something_else_are_refused_naming_the_flag(trainer, field, value, message):
    from twotower.retrieval.training.train_dual import DualTrainConfig
    from twotower.retrieval.training.train_reranker import RerankerTrainConfig

    make = (lambda **kw: RerankerTrainConfig(model="m", pairs="p", out="o", **kw)) if trainer == "reranker" \
        else (lambda **kw: DualTrainConfig(model="m", data="d", out="o", **kw))
    make()  # the defaults pass
    with pytest.raises(ValueError, match=re.escape(message)):
        make(**{field: value})


def test_cli_lr_zero_is_kept_not_replaced_by_the_default(tmp_path, capsys):
    """`--lr 0` (a run that only evaluates its start, as a check) reached the trainers as the default rate."""
    from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
    from twotower.cli import main

    for command, data in (("reranker", "--pairs"), ("dual", "--data")):
        out = tmp_path / command
        rc = main(["train", command, "--model", tiny_model_dir(0.2), data, tiny_beir_dir(), "--out", str(out),
                   "--lr", "0", "--dry-run", "--no-progress", "--batch-size", "4", "--no-bf16",
                   *(["--group-size", "4", "--max-length", "48"] if command == "reranker" else [])])
        assert rc == 0, capsys.readouterr().err
        config = next(json.loads(line) for line in open(out / "train_log.jsonl") if '"config"' in line)
        assert config["lr"] == 0.0


def test_start_run_under_torchrun_puts_each_rank_on_its_own_gpu(tmp_path, monkeypatch):
    """``--device cuda:0`` given to every rank of a 2-GPU torchrun: rank 1 trains on cuda:1, the GPU its NCCL
    group uses (no GPU is touched here: the run only picks the device)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    _, _, device, _ = start_run(TrainSettings(device="cuda:0", bf16=False), str(tmp_path / "run"), enabled=False)
    assert device == torch.device("cuda", 1)


def test_step_pace_includes_the_wait_for_the_device(tmp_path, monkeypatch):
    """On a GPU the step's kernels run asynchronously until the loss is read: its pace must be timed after
    that read (the wait for the device), here a fake clock that moves one second while the loss is read."""
    from twotower.retrieval.training import loop as loop_module

    clock = [0.0]

    class _QueuedLoss:  # a loss whose value is ready one second after the step returned
        def __init__(self, loss):
            self.loss = loss

        def detach(self):
            return self

        def __float__(self):
            clock[0] += 1.0
            return float(self.loss.detach())

    monkeypatch.setattr(loop_module.time, "perf_counter", lambda: clock[0])
    loop, _ = _loop(tmp_path, [0.1, 0.2], Schedule(3, 3, 0.5, 0.0))
    step = loop.step

    def queued(done: int):
        loss, fields = step(done)
        return _QueuedLoss(loss), fields

    loop.step = queued
    loop.train()
    assert list(loop._paces) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_resume_is_refused_or_accepted_by_rank_0_for_every_rank(tmp_path, monkeypatch, rank):
    """Every rank compared the saved run with its own view (real paths differ between nodes: links, mounts):
    a rank that refused alone stopped without a word while rank 0 went on and died in its next collective
    ("Connection closed by peer"). Rank 0 decides now, and every rank hears of the decision (`stopped_anywhere`)."""
    from twotower.encoder.training import same_run
    from twotower.retrieval.training import loop as loop_module
    from twotower.retrieval.training import resume

    cfg = TrainSettings(device="cpu", bf16=False, resume=True)
    saved = resume.run_identity(TrainSettings(device="cpu", bf16=False, epochs=2.0), 2, {"device": "cpu", "bf16": False})
    heard: list[BaseException | None] = []

    def stopped_anywhere(error, info, who):
        heard.append(error)
        if error is not None:
            raise error

    monkeypatch.setattr(resume, "find_state", lambda out: str(tmp_path / "state"))
    monkeypatch.setattr(same_run, "read_saved_identity",
                        lambda state: ({"steps": 4, "elapsed": 1.0, "log_records": 3}, saved))
    monkeypatch.setattr(loop_module, "stopped_anywhere", stopped_anywhere)
    monkeypatch.setattr(loop_module, "rank", lambda: rank)
    if rank == 0:
        with pytest.raises(ValueError, match="cannot resume"):
            start_run(cfg, str(tmp_path / "run"), enabled=True, world_size=2)
        assert isinstance(heard[0], ValueError)
    else:  # rank 1 waits for rank 0's decision, which it hears of in `stopped_anywhere`
        start_run(cfg, str(tmp_path / "run"), enabled=False, world_size=2)
        assert heard == [None]
