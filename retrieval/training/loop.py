"""The loop both retrieval trainers run: steps under a budget, dev evaluation on a schedule, the best kept.

`train_dual` and `train_reranker` differ in what one step computes and in what a dev evaluation
measures; they hand those to `TrainingLoop` as functions, and everything around them is here once:

* the learning rate is ``lr * lr_factor(progress)`` (`twotower.encoder.training.optim`), where progress
  is steps done / the steps planned: the total, or, once a time budget is projected to end the run
  first, the steps that fit in it at the median pace of the recent steps (`Schedule.planned_steps`).
  So warmup and decay end when the first of the two runs out, and a budget the steps finish within
  leaves the schedule, and so a seeded run, exactly as without one.  Once the plan changes, the rate
  goes on from where it is instead of jumping to where ``steps / planned`` would put it
  (`Schedule.factor`, whose `LrState` the loop carries from step to step);
* after each step: gradient clipping, the optimizer step, a ``step`` record in the run log; a
  non-finite loss writes a ``stop`` record and raises `FloatingPointError` (no later step could help);
* dev evaluation at step 0 (unless switched off), every `Schedule.eval_every` steps, when
  `Schedule.eval_interval_s` seconds passed since the last one, at the last step and when the time
  budget runs out; each writes an ``eval`` record and redraws the curve (`TrainingRun.plot`);
* a better dev score replaces ``OUT/best`` atomically (`TrainingRun.save_checkpoint`), so an
  interrupted run still leaves its best checkpoint whole;
* a guard sees every step and eval record and may end the run by raising `StopTraining` (the
  reranker's collapse guard): the run then stops with a ``stop`` record, its best checkpoint so
  far, and the reason in `LoopResult.stopped_by`;
* after each evaluation, and every `TrainingLoop.save_every` steps, the run's state is saved in
  ``OUT/trainer_state/`` (after ``best/``), and ``--resume`` continues from it exactly
  (`twotower.retrieval.training.resume` says what is restored and checked).

Under torchrun every rank runs the loop (the steps are collective); only the main process logs,
evaluates into the log and writes checkpoints.  What the clock decides (the planned steps and so the
learning rate, when to evaluate, when the budget is spent) and a guard's stop are agreed by all ranks
(`TrainingLoop._agree`): the mean of their clocks and paces, and a stop on rank 0 stops every rank.
Each rank reading its own clock let their learning rates drift apart, and let one rank leave the loop
or start an evaluation while another waited in a collective, which hangs.  Nothing here draws random
numbers, so a seeded run is reproduced exactly by the trainer's own seeding.
"""

from __future__ import annotations

import logging
import math
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from twotower.common.device import resolve_bf16, training_device
from twotower.common.distributed import DistInfo, all_reduce_sum, gather_states, stopped_anywhere
from twotower.common.errors import DataError, check_at_least, check_setting
from twotower.common.malloc import retain_freed_memory_for
from twotower.encoder.training.optim import check_optimizer_settings, lr_factor, set_lr
from twotower.encoder.training.train_state import (
    capture_rng,
    load_train_state,
    restore_train_state,
    save_train_state,
)
from twotower.retrieval.training.losses.gather import rank, world_size
from twotower.retrieval.training.training_run import TrainingRun

MIN_PACE_STEPS = 5  # steps timed before a time budget may reshape the schedule
PACE_WINDOW = 20  # recent steps whose median duration is the pace

logger = logging.getLogger(__name__)

StepFn = Callable[[int], tuple[torch.Tensor, dict]]
"""step(steps done) -> (loss, extra step-record fields); runs the forward and backward passes of one step."""
EvalFn = Callable[[int], dict]
"""evaluate(step) -> the eval record's fields (dev metrics and whatever else the trainer logs)."""
SaveFn = Callable[[str, int, float], None]
"""save(directory, step, dev score): write a checkpoint into `directory` (swapped into place afterwards)."""


def step_pace(step_seconds: Sequence[float]) -> float | None:
    """Seconds a step: the median of the recent steps' durations (it ignores a slow first step), or None
    while fewer than `MIN_PACE_STEPS` are timed."""
    return statistics.median(step_seconds) if len(step_seconds) >= MIN_PACE_STEPS else None


class StopTraining(RuntimeError):
    """Raised by a guard to end the run early; `kind` heads `LoopResult.stopped_by` (``"<kind>: <message>"``)."""

    kind = "stopped"


@dataclass(kw_only=True)
class TrainSettings:
    """The settings both trainers share (`DualTrainConfig` and `RerankerTrainConfig` extend it).

    Each trainer adds its model and data, ``out`` (the run directory) and the settings whose defaults
    differ between them (``lr``, ``mine``, ``mine_ranks``, ``eval_batch_size``).

    split: qrels split of a BEIR directory to train on; corpus: corpus.jsonl resolving ids in JSONL data.
    negatives: mined JSONL (`twotower.retrieval.training.mining.write_mined`) whose negatives are added
        to each training query (`twotower.retrieval.training.negatives.add_mined_negatives`).
    epochs / max_steps: training length (max_steps wins); time_budget (seconds) stops early, and the
        LR schedule follows whichever of steps and time runs out first.
    warmup: fraction of the run spent warming up the learning rate; weight_decay, max_grad_norm: AdamW's
        decay (not on biases and norms) and the gradient clipping norm.
    bf16: "auto" = bf16 autocast where the hardware has it natively; True/False force it.
    dev_fraction / dev_size: dev split carved from train by query (dev_size, a query count, wins).
    dev_by: "query", or "document": no dev query's positive is a training query's positive
        (`twotower.retrieval.training.training_data.split_dev`; for corpora whose new documents matter).
    dev_seed: carve the dev split with this seed instead of `seed` (None: `seed`). Why: runs that differ
        only in their training draws then choose on the same queries, so they can be compared, and
        averaged (`twotower.retrieval.training.soup`), without one run having trained on another's dev.
    eval_every: steps between dev evaluations (None = once per epoch); eval_interval_s: also evaluate
        when this many seconds passed since the last evaluation.
    save_last: also keep the final weights in ``out/last``; dry_run: one step and one evaluation.
    overwrite: an `out` that holds an earlier run is replaced only once this run is complete (built in
        ``out.unfinished`` meanwhile, `TrainingRun`), so a stopped run leaves the earlier one whole.
    resume: continue the run in `out` from its saved state, exactly, or refuse naming what differs
        (`twotower.retrieval.training.resume`); save_every: also save that state every this many steps
        (None: at each dev evaluation only). Why both: the state is saved after each evaluation anyway, and
        a run whose evaluations are far apart (one an epoch) would otherwise lose all the steps between.
    resumable: save that state at all (False: the run cannot be resumed). Why off: a save writes the weights
        and both AdamW moments (273 MB for all-MiniLM-L6-v2, 0.5-1.1 s on CPU-B: benchmarks/state_save.py), which
        a run of a few minutes that nobody resumes (the README demo's reranker) need not pay at every evaluation.
    """

    split: str = "train"
    corpus: str | None = None
    negatives: str | None = None
    epochs: float = 1.0
    max_steps: int | None = None
    time_budget: float | None = None
    warmup: float = 0.1
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0
    bf16: bool | str = "auto"
    seed: int = 0
    dev_fraction: float = 0.1
    dev_size: int | None = None
    dev_by: str = "query"
    dev_seed: int | None = None
    eval_every: int | None = None
    eval_interval_s: float | None = None
    save_last: bool = False
    progress: bool = True
    device: str | None = None
    dry_run: bool = False
    overwrite: bool = False
    resume: bool = False
    save_every: int | None = None
    resumable: bool = True

    def __post_init__(self) -> None:
        """Refuse settings that would train something other than what was asked, naming the field and its flag.

        Why here: zero fell through to a default (``max_steps=0`` and ``eval_every=0`` meant an epoch), a
        negative length trained one step, and ``max_grad_norm=0`` zeroed every update, all without a word.
        """
        check_setting(math.isfinite(self.epochs) and self.epochs > 0, "epochs", self.epochs, "--epochs",
                      "give a number of epochs > 0")
        check_at_least(self, 1, {"max_steps": "--max-steps", "dev_size": "--dev-size", "eval_every": "--eval-every",
                                 "save_every": "--save-every"})
        check_setting(self.time_budget is None or self.time_budget > 0, "time_budget", self.time_budget,
                      "--time-budget", "give a duration > 0")
        check_setting(self.eval_interval_s is None or self.eval_interval_s >= 0, "eval_interval_s",
                      self.eval_interval_s, "--eval-interval", "give a duration >= 0 (0: off)")
        check_optimizer_settings(getattr(self, "lr", None), self.warmup, self.weight_decay)  # lr: each trainer's
        check_setting(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "--max-grad-norm",  # NaN fails
                      "give a norm > 0 (0 would zero every update; inf: no clipping)")
        check_setting(0 < self.dev_fraction < 1, "dev_fraction", self.dev_fraction, "--dev-fraction",
                      "give a fraction in (0, 1)")
        check_setting(self.resumable or not (self.resume or self.save_every), "resumable", self.resumable, None,
                      "resume and save_every need the state a resumable run saves")

    @property
    def dev_split_seed(self) -> int:
        """The seed `split_dev` carves dev with: `dev_seed`, else `seed`."""
        return self.seed if self.dev_seed is None else self.dev_seed


def start_run(cfg: TrainSettings, out: str, enabled: bool = True,
              **config_fields: Any) -> tuple[TrainingRun, random.Random, torch.device, bool]:
    """Seed torch, pick the device and bf16, begin the run in `out` with a ``config`` record.

    Nothing is written to `out` yet: the trainer calls ``run.open()`` once its inputs are read and checked
    (`twotower.retrieval.training.training_run`), so a start that fails on bad input leaves an earlier run as it was.
    With ``cfg.resume`` the saved state is found and checked against this command first (settings, input
    files, processes: `twotower.retrieval.training.resume`), before any model or data work.

    `config_fields` are logged with the config. Returns (run, a `random.Random(seed)` for the trainer's
    own draws, device, bf16).
    """
    from twotower.encoder.training.same_run import read_saved_identity
    from twotower.retrieval.training import resume

    torch.manual_seed(cfg.seed)
    device = training_device(cfg.device)  # under torchrun: this rank's GPU
    bf16 = resolve_bf16(cfg.bf16, device)
    retain_freed_memory_for(device)  # reuse freed activation memory across steps (common/malloc.py)
    world = config_fields.get("world_size", 1)
    # rank 0's alone (it saves the state): the other ranks, and a run that saves no state (`resumable` False),
    # need no identity (it hashes the input files)
    identity = (resume.run_identity(cfg, world, {"device": device.type, "bf16": bf16})
                if cfg.resumable and enabled else {})
    point = None
    if cfg.resume:
        error = None
        try:
            state = resume.find_state(out)
            user, saved = read_saved_identity(state)
            if enabled:  # rank 0 decides: another rank's real paths may differ (links, mounts on another node)
                resume.check_same_run(saved, identity, out)
            point = _resume_point(user, state)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            error = exc
        # a refusal, or a state only some rank cannot read, stops every rank together: the rank that met it says
        # why (one that failed alone left rank 0 to die in its next collective with "Connection closed by peer")
        stopped_anywhere(error, DistInfo(world, rank()), "another rank")
    run = TrainingRun(out, enabled=enabled, replace=cfg.overwrite, resume=cfg.resume)
    run.identity = identity
    if point is not None:
        run.resume_at(*point)
    run.log("config", **asdict(cfg), **config_fields, bf16_resolved=bf16)
    return run, random.Random(cfg.seed), device, bf16


def _resume_point(user: dict, state: str) -> tuple[int, float, int]:
    """(steps, seconds, log records) of a saved state; a state without them is damaged."""
    try:
        point = int(user["steps"]), float(user["elapsed"]), int(user["log_records"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(os.path.join(state, "state.json"), None, f"damaged: its training position has no "
                        f"{exc}; start the run again without --resume") from None
    return point


@dataclass(frozen=True)
class LrState:
    """Where the learning-rate factor is once a time budget has changed the plan (`Schedule.factor`).

    step: steps done when `factor` was set (it was the factor of optimizer step ``step + 1``); warming: it was
    still rising towards the peak.  Plain numbers (``dataclasses.asdict`` writes them as JSON exactly) because
    they are what a resumed run needs besides the step count to continue the schedule where it was
    (`TrainingLoop` saves them with its state).
    """

    step: int
    factor: float
    warming: bool


@dataclass(frozen=True)
class Schedule:
    """How long to train, at what learning rate, and when to evaluate.

    total_steps: optimizer steps; eval_every: steps between evaluations; lr / warmup: the peak rate and
    the warmup fraction of `lr_factor`; time_budget: seconds after which training stops (the schedule
    then follows time); eval_interval_s: evaluate also after this many seconds since the last time.
    """

    total_steps: int
    eval_every: int
    lr: float
    warmup: float
    time_budget: float | None = None
    eval_interval_s: float | None = None
    eval_at_start: bool = True

    @classmethod
    def of(cls, cfg: TrainSettings, steps_per_epoch: int, lr: float, eval_at_start: bool = True) -> Schedule:
        """From a trainer's settings: max_steps wins over epochs, a dry run is one step, and eval_every
        defaults to an epoch."""
        total = 1 if cfg.dry_run else (cfg.max_steps or max(1, math.ceil(cfg.epochs * steps_per_epoch)))
        return cls(total, cfg.eval_every or steps_per_epoch, lr, cfg.warmup, cfg.time_budget, cfg.eval_interval_s,
                   eval_at_start)

    def lr_factor(self, step: int, planned: float | None = None) -> float:
        """The learning-rate multiplier before optimizer step `step + 1`, of `planned` steps (default the total),
        on a schedule laid over `planned` from the start (`factor` is the one a run follows)."""
        planned = self.total_steps if planned is None else planned
        return lr_factor(step / planned if planned > 0 else 1.0, warmup=self.warmup)

    def factor(self, step: int, planned: float, state: LrState | None) -> tuple[float, LrState | None]:
        """The learning-rate multiplier before optimizer step `step + 1` when `planned` steps are planned now,
        and the state the next step's call continues from (None until the plan first differs from the total).

        While the plan is the total this is `lr_factor` itself, so a run whose time budget never binds takes,
        bit for bit, the rates of a run without one.  Why more once it binds: ``step / planned`` jumps when
        `planned` shrinks (a cut in warmup sent the rate from 40 % of the peak to the peak in one step, a cut
        in the decay dropped it), and the plan is redrawn at every step's pace.  So from the step the plan
        first changes, each factor goes on from the last one (`LrState`):

        * warming up: up by the total's warmup slope, ``1 / (warmup * total_steps)`` a step, until it meets
          the peak or the new plan's own decay line (the factor `lr_factor` gives there, which ends at 0 at
          `planned`), then down that line;
        * decaying: on the straight line from the last factor to 0 at `planned`;
        * the budget spent (``planned <= step``): 0, the end of any schedule, as before.

        A plan that changes again continues from wherever the factor is.  Every step moves the factor by at most
        the warmup slope upwards, and downwards by at most the slope of that straight line to 0 at `planned`.
        The state is three plain numbers, the same on every rank under torchrun (they follow from the agreed
        plans alone); a resumed run that restores it takes the rates the uninterrupted one would have.
        """
        if planned <= step:
            return 0.0, LrState(step, 0.0, False)
        if state is None:
            if planned == self.total_steps:
                return self.lr_factor(step, planned), None
            if step == 0:  # nothing set yet: every plan starts at the same factor
                return self.lr_factor(0), LrState(0, self.lr_factor(0), self.warmup > 0)
            # the first re-plan: go on from the factor the total's schedule set before the last step
            before = step - 1
            state = LrState(before, self.lr_factor(before), self.warmup > 0 and before / self.total_steps < self.warmup)
        left = planned - state.step  # steps from the last factor to the plan's end (> 1: planned > step)
        down = state.factor * (left - (step - state.step)) / left  # on the line to 0 at `planned`
        if not state.warming:
            return down, LrState(step, down, False)
        up = state.factor + (step - state.step) / (self.warmup * self.total_steps)
        ceiling = min(1.0, (planned - step) / ((1.0 - self.warmup) * planned))  # the peak, the new plan's decay line
        if up < ceiling:
            return up, LrState(step, up, True)
        factor = max(ceiling, down)  # at the peak or on the decay line; from above that line, down to 0 at the end
        return factor, LrState(step, factor, False)

    def planned_steps(self, step: int, elapsed: float, pace: float | None) -> float:
        """Steps the schedule is laid over after `step` steps and `elapsed` seconds of the run.

        The total, unless the time budget will run out first: then the steps done plus the steps the
        seconds left fit at `pace` (seconds a step, `step_pace`; None: too few steps timed to judge). Why
        not the clock itself: a time term that is merely larger than step progress (early, when the
        seconds spent before training or a slow first step put the clock ahead) made the rate, and so a
        seeded run, depend on the machine's speed even when the budget never bound.
        """
        if not self.time_budget:
            return self.total_steps
        left = self.time_budget - elapsed
        if left <= 0:
            return step  # the budget is spent: the schedule is at its end
        if pace is None:
            return self.total_steps
        return min(self.total_steps, step + left / pace) if pace > 0 else self.total_steps

    def out_of_time(self, elapsed: float) -> bool:
        return self.time_budget is not None and elapsed > self.time_budget

    def eval_due(self, step: int, elapsed: float, since_eval: float) -> bool:
        """After `step` steps: a scheduled step, the last one, the time budget spent, or the interval passed."""
        due = self.eval_interval_s is not None and since_eval > self.eval_interval_s
        return step % self.eval_every == 0 or step == self.total_steps or self.out_of_time(elapsed) or due


@dataclass
class LoopResult:
    best_dir: str | None
    best_step: int
    best_score: float
    initial_score: float | None
    steps: int
    stopped_by: str  # "steps", "time budget" or "<StopTraining.kind>: <message>"
    history: list[dict]  # the eval records

    def summary(self, metric: str = "ndcg@10") -> dict:
        """The part of ``summary.json`` every trainer writes (trainers add their own fields)."""
        return {"best_dir": self.best_dir, "best_step": self.best_step, f"best_dev_{metric}": self.best_score,
                f"initial_dev_{metric}": self.initial_score, "steps": self.steps, "stopped_by": self.stopped_by}


@dataclass
class TrainingLoop:
    """One training run's loop (see the module docstring); `train()` runs it once.

    modules: put in eval mode while evaluating, in train mode otherwise (frozen parts are left out).
    params: clipped to `max_grad_norm` before each optimizer step.
    step / evaluate / save: the trainer's parts (`StepFn`, `EvalFn`, `SaveFn`); `metric` names the
        field of the eval record that picks the best checkpoint.
    update_fields: step-record fields read after the optimizer step (a learned temperature's new value).
    guard: called with every step and eval record the main process logs; raises `StopTraining` to stop. A
        resumed run shows it again the records of the steps done, so it must read nothing else.
    save_last: save(directory, steps) for ``OUT/last`` at the end (None: no ``last``).
    state_module: what the run's state saves and restores with the optimizer (the modules trained: their
        parameters and buffers); skip: skip(steps done) draws that step's batch without training on it, as a
        resumed run does for the steps done so that its next batch is the uninterrupted run's. Without both,
        the run saves no state and cannot be resumed.
    state_fields / load_state_fields: the trainer's own values carried between steps, as JSON, saved with the
        state and handed back on resume.
    save_every: save the state every this many steps too (None: after each evaluation only).
    """

    run: TrainingRun
    schedule: Schedule
    optimizer: torch.optim.Optimizer
    params: Sequence[torch.nn.Parameter]
    max_grad_norm: float
    modules: Sequence[torch.nn.Module]
    step: StepFn
    evaluate: EvalFn
    save: SaveFn
    metric: str = "ndcg@10"
    update_fields: Callable[[], dict] | None = None
    guard: Callable[[dict], None] | None = None
    save_last: Callable[[str, int], None] | None = None
    main_process: bool = True
    progress: bool = True
    desc: str = "train"
    plot_title: str = ""
    state_module: torch.nn.Module | None = None
    skip: Callable[[int], None] | None = None
    state_fields: Callable[[], dict] | None = None
    load_state_fields: Callable[[dict], None] | None = None
    save_every: int | None = None

    def __post_init__(self) -> None:
        self.steps = 0  # optimizer steps done
        self.initial: float | None = None  # the dev score before training
        self._paces: deque[float] = deque(maxlen=PACE_WINDOW)  # seconds of the recent steps
        self.lr_state: LrState | None = None  # the schedule's position once the plan has changed (`Schedule.factor`)
        self.best_score, self.best_step, self.best_dir = -1.0, -1, None
        self._dist = DistInfo(world_size(), rank())
        # Under torchrun, why this rank must end the run (a guard's stop on rank 0, a non-finite loss on any
        # rank), held until every rank learns of it at the next `_agree`.
        self._stop: StopTraining | FloatingPointError | None = None

    def train(self) -> LoopResult:
        run, schedule = self.run, self.schedule
        run.open()  # the trainer has read and checked its inputs: the run begins writing into its directory
        stopped_by, resumed = "steps", None
        if run.resume_step is not None:
            resumed = self._resume()
        bar = None
        if self.progress and self.main_process:
            from tqdm.auto import tqdm

            bar = tqdm(total=schedule.total_steps, initial=self.steps, desc=self.desc, unit="step")
        try:
            if resumed is None:
                if schedule.eval_at_start:
                    self.initial = self._evaluate(0)
                last_eval, _ = self._agree()
            else:
                last_eval, stopped = resumed
                if stopped:  # the state was saved as the time budget ended the run: only its end is left
                    stopped_by = stopped
            self._set_mode(train=True)
            while self.steps < schedule.total_steps and stopped_by == "steps":
                self._step(bar)
                elapsed, _ = self._agree()
                out_of_time = schedule.out_of_time(elapsed)
                evaluated = schedule.eval_due(self.steps, elapsed, elapsed - last_eval)
                if evaluated:
                    self._evaluate(self.steps)
                    last_eval, _ = self._agree()
                if evaluated or (self.save_every and self.steps % self.save_every == 0):
                    self._save_state(last_eval, "time budget" if out_of_time else None)
                if out_of_time:
                    stopped_by = "time budget"
                    break
        except StopTraining as exc:
            stopped_by = f"{exc.kind}: {exc}"
            run.log("stop", step=self.steps, reason=str(exc))
            logger.error("%s", exc)
        finally:
            if bar is not None:
                bar.close()
        if self.save_last is not None and self.main_process:
            run.save_checkpoint("last", lambda directory: self.save_last(directory, self.steps))
        history = [r for r in run.records if r["event"] == "eval"]
        return LoopResult(self.best_dir, self.best_step, self.best_score, self.initial, self.steps, stopped_by,
                          history)

    @property
    def resumable(self) -> bool:
        return self.state_module is not None and self.skip is not None

    def _adopt_later_best(self) -> None:
        """A kill between a better checkpoint's save and the state's leaves ``best/`` a step ahead of the state.
        Its step and score (``training_args.json``) then stand as the best so far, so that ``best/`` and the
        summary name the same checkpoint whatever the steps done again score: the same on a CPU, where they
        are computed alike, but not always on a GPU or another device."""
        import json

        from twotower.retrieval.export import TRAINING_ARGS

        path = os.path.join(self.run.out, "best", TRAINING_ARGS)
        try:
            with open(path, encoding="utf-8") as f:
                args = json.load(f)
            step, score = int(args["step"]), float(args["dev_ndcg@10"])
        except (OSError, ValueError, KeyError, TypeError):  # none yet, or one written before it held its score
            return
        if step <= self.steps or not math.isfinite(score):  # the state's own best, or none of this run's
            return
        if self.main_process:  # every rank adopts it; one says so
            logger.warning("%s holds the checkpoint of step %d, saved after the training state (step %d); it "
                           "stays the best so far unless a later evaluation beats its dev score %.4f",
                           os.path.dirname(path), step, self.steps, score)
        self.best_dir, self.best_step, self.best_score = os.path.dirname(path), step, score

    def _save_state(self, last_eval: float, stopped_by: str | None) -> None:
        """Save the run's state (`twotower.retrieval.training.resume`); on every rank under torchrun (their
        generators are gathered), written by the main process. ``best/`` is already saved: a kill between the
        two leaves the state before it, whose resume saves the same ``best/`` again."""
        if not self.resumable:
            return
        device = self.params[0].device if self.params else torch.device("cpu")
        ranks = gather_states(capture_rng(device), self._dist)
        if not self.main_process:
            return
        rng = {**ranks[0], **{f"rank{r}/{k}": v for r, states in enumerate(ranks[1:], 1) for k, v in states.items()}}
        user = {"steps": self.steps, "elapsed": self.run.elapsed, "log_records": len(self.run.records),
                "last_eval": last_eval, "stopped_by": stopped_by,
                "lr_state": asdict(self.lr_state) if self.lr_state is not None else None, "paces": list(self._paces),
                "best_score": self.best_score, "best_step": self.best_step, "best": self.best_dir is not None,
                "initial": self.initial, "trainer": self.state_fields() if self.state_fields else {},
                "run": self.run.identity}
        save_train_state(self.run.state_dir, self.state_module.state_dict(), self.optimizer, user, rng=rng)

    def _resume(self) -> tuple[float, str | None]:
        """Continue from the saved state: draw the done steps' batches again, then restore weights, moments,
        generators (this rank's) and the loop's position. Returns (when dev was last evaluated, in the run's
        seconds; why the run stopped, if the state was saved as it ended)."""
        if not self.resumable:
            raise ValueError(f"{self.desc}: this run saves no state, so it cannot be resumed")
        directory = self.run.state_dir
        device = self.params[0].device if self.params else torch.device("cpu")
        error = None
        try:
            last_eval, stopped, steps = self._restore(directory, device)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            error = exc
        # one exchange for the whole load and restore: a rank that failed in any of it alone (its own generator
        # missing, a file its node reads otherwise) says so (rank 0, which speaks for all, would not), and the
        # others stop with it instead of failing in their next collective ("Connection closed by peer")
        stopped_anywhere(error, self._dist, "another rank")
        if self.guard is not None and self.main_process:  # its view of the steps done (their records)
            for record in self.run.records:
                if record["event"] in ("step", "eval"):
                    self.guard(record)
        logger.info("resumed %s at step %d", self.run.out, steps)
        return last_eval, stopped

    def _restore(self, directory: str, device: torch.device) -> tuple[float, str | None, int]:
        """`_resume`'s work on this rank alone (no collective): load the state in `directory`, draw the done
        steps' batches again, restore weights, moments, this rank's generators and the loop's position.
        Returns (when dev was last evaluated, why the run stopped, the steps done)."""
        import dataclasses

        state = load_train_state(directory, map_location=device)
        user = state.user
        where = os.path.join(directory, "state.json")
        me = self._dist.rank
        own = ({k: v for k, v in state.rng.items() if "/" not in k} if me == 0 else
               {k.split("/", 1)[1]: v for k, v in state.rng.items() if k.startswith(f"rank{me}/")})
        if not own:  # this rank's own, which the others may have (`_resume` has every rank stop with it)
            raise DataError(os.path.join(directory, "rng.safetensors"), None,
                            f"damaged: it holds no random generator of rank {me}; start the run again without --resume")
        try:
            steps, lr_state = int(user["steps"]), user["lr_state"]
            for done in range(steps):  # the batches of the steps done: the next one is the uninterrupted run's
                self.skip(done)
            restore_train_state(dataclasses.replace(state, rng=own), directory, self.state_module, self.optimizer)
            self.steps = steps
            self.lr_state = LrState(**lr_state) if lr_state is not None else None
            self._paces.extend(float(p) for p in user["paces"])
            self.best_score, self.best_step = float(user["best_score"]), int(user["best_step"])
            self.best_dir = os.path.join(self.run.out, "best") if user["best"] else None
            if self.best_dir is not None and not os.path.isdir(self.best_dir):
                raise DataError(self.best_dir, None, "missing: the saved training state says the run's best "
                                "checkpoint is there; put it back, or start the run again without --resume")
            self._adopt_later_best()
            self.initial = user["initial"]
            if self.load_state_fields is not None:
                self.load_state_fields(user["trainer"])
            last_eval, stopped = float(user["last_eval"]), user["stopped_by"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(where, None, f"damaged: its training position has no usable {exc}; start the run "
                                         "again without --resume") from None
        return last_eval, stopped, steps

    def _set_mode(self, train: bool) -> None:
        for m in self.modules:
            m.train(train)

    def _agree(self) -> tuple[float, float | None]:
        """(seconds elapsed, seconds a step or None) that every rank acts on; ends the run on every rank together.

        Alone: this process's clock and `step_pace`. Under torchrun: their means over the ranks (one
        all-reduce of five numbers; every rank has timed the same steps, so all or none have a pace), so
        that the planned steps, the learning rate and the clock's decisions are the same on every rank;
        and a guard's stop on rank 0 or a non-finite loss on any rank is raised on all of them.
        """
        elapsed, pace = self.run.elapsed, step_pace(self._paces)
        if self._dist.enabled:
            device = self.params[0].device if self.params else "cpu"
            mine = self._stop
            total, pace_total, timed, stops, faults = all_reduce_sum(
                [elapsed, pace or 0.0, float(pace is not None), float(isinstance(mine, StopTraining)),
                 float(isinstance(mine, FloatingPointError))], self._dist, device)
            n = self._dist.world_size
            elapsed, pace = total / n, (pace_total / n if timed == n else None)
            if faults and not isinstance(mine, FloatingPointError):
                self.run.log("stop", step=self.steps, reason="loss is not finite on another rank")
                raise FloatingPointError(f"training loss became non-finite on another rank at step {self.steps}; "
                                         "lower the learning rate")
            if stops and mine is None:
                raise StopTraining(f"stopped on rank 0 at step {self.steps}")
        if self._stop is not None:
            raise self._stop
        return elapsed, pace

    def _check(self, record: dict) -> None:
        """The guard, on the main process. Under torchrun its stop waits for the next `_agree`, which raises it
        on every rank together (a rank that left alone would leave the others waiting in a collective)."""
        if self.guard is None or not self.main_process:
            return
        try:
            self.guard(record)
        except StopTraining as exc:
            if not self._dist.enabled:
                raise
            self._stop = exc

    def _step(self, bar) -> None:
        """One optimizer step, its record, the guard."""
        elapsed, pace = self._agree()
        planned = self.schedule.planned_steps(self.steps, elapsed, pace)
        factor, self.lr_state = self.schedule.factor(self.steps, planned, self.lr_state)
        set_lr(self.optimizer, self.schedule.lr, factor)
        t0 = time.perf_counter()
        loss, fields = self.step(self.steps)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Reading the loss waits for the device (on a GPU the step's kernels are only queued until then), so
        # it comes before the clock: else the pace, which plans a time budget's steps, misses the GPU's time.
        loss_value = float(loss.detach())
        self._paces.append(time.perf_counter() - t0)
        self.steps += 1
        step = self.steps
        if not math.isfinite(loss_value):
            self.run.log("stop", step=step, reason=f"loss is {loss_value}")
            fault = FloatingPointError(f"training loss became {loss_value} at step {step}; lower the learning rate")
            if not self._dist.enabled:
                raise fault
            self._stop = fault  # raised on every rank at the next `_agree`
            return
        if self.update_fields is not None:
            fields = {**fields, **self.update_fields()}
        record = self.run.log("step", step=step, loss=loss_value, lr=self.schedule.lr * factor,
                              grad_norm=float(grad_norm), **fields)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_value:.3f}")
        self._check(record)

    def _evaluate(self, step: int) -> float:
        """Evaluate, log, keep the checkpoint if it is the best so far; returns the dev score (nan off main)."""
        self._set_mode(train=False)
        fields = self.evaluate(step)
        self._set_mode(train=True)
        score = fields.get(self.metric, float("nan"))
        if self.main_process:
            record = self.run.log("eval", step=step, **fields)
            self.run.plot(metric=self.metric, title=self.plot_title)
            self._check(record)
            if self._stop is None and score > self.best_score:  # a stopped run keeps the best before it
                self.best_dir = self.run.save_checkpoint("best", lambda directory: self.save(directory, step, score))
                self.best_score, self.best_step = score, step
        return score
