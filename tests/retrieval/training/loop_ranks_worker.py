"""Run by `torchrun --nproc_per_node 2` from test_loop.py: the training loop on two ranks whose clocks disagree.

Rank r's fake clock advances 1 + 2r seconds a step (rank 0: 1 s, rank 1: 3 s), the step averages the gradient
over the ranks as the dual encoder's does, and the evaluation ends with a barrier as its does. Three runs:
"budget" (a 20 s time budget that binds), "guard" (rank 0's guard stops the run at the step-10 evaluation) and
"nan" (rank 1's loss is NaN at step 3). Each rank writes what it did to OUT/rank<r>.json. A collective left
waiting fails after the group's 120 s timeout (the test allows 240).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from twotower.common.distributed import DistInfo, cleanup
from twotower.retrieval.training import loop as loop_module
from twotower.retrieval.training.loop import Schedule, StopTraining, TrainingLoop
from twotower.retrieval.training.training_run import TrainingRun


class Halt(StopTraining):
    kind = "halted"


def run(out: str, rank: int, schedule: Schedule, guard=None, nan_at: int | None = None) -> dict:
    clock = [0.0]
    TrainingRun.elapsed = property(lambda self: clock[0])
    loop_module.time = SimpleNamespace(perf_counter=lambda: clock[0])
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.0)
    lrs = []

    def step(done):
        lrs.append(opt.param_groups[0]["lr"])
        loss = (w - 1.0 - rank).pow(2).sum()  # the ranks' data differ; the averaged gradient is shared
        if rank == 1 and done == nan_at:
            loss = loss * float("nan")
        loss.backward()
        dist.all_reduce(w.grad)
        w.grad /= 2
        clock[0] += 1.0 + 2.0 * rank
        return loss, {}

    def evaluate(step):
        dist.barrier()
        return {"ndcg@10": 0.1 * step}

    def save(directory, step, score):
        pass

    training_run = TrainingRun(out, enabled=rank == 0)
    loop = TrainingLoop(training_run, schedule, opt, [w], 1.0, [torch.nn.Linear(1, 1)], step, evaluate, save,
                        guard=guard, main_process=rank == 0, progress=False)
    try:
        result = loop.train()
    except FloatingPointError as exc:
        return {"steps": loop.steps, "error": str(exc)}
    return {"steps": result.steps, "stopped_by": result.stopped_by, "lrs": lrs, "w": w.item()}


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))  # generous: a loaded CI machine
    rank = dist.get_rank()
    budget = run(os.path.join(out, "budget"), rank,
                 Schedule(total_steps=100, eval_every=5, lr=0.1, warmup=0.1, time_budget=20.0))

    def guard(record):
        if record["event"] == "eval" and record["step"] == 10:
            raise Halt("dev score collapsed")

    stopped = run(os.path.join(out, "guard"), rank, Schedule(total_steps=30, eval_every=5, lr=0.1, warmup=0.1),
                  guard=guard)
    nan = run(os.path.join(out, "nan"), rank, Schedule(total_steps=30, eval_every=5, lr=0.1, warmup=0.1), nan_at=2)
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"budget": budget, "guard": stopped, "nan": nan}, f)
    cleanup(DistInfo(2, rank))  # gc first: a gloo thread freeing a tensor during interpreter exit aborts


if __name__ == "__main__":
    main()
