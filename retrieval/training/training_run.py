"""What a retrieval training run leaves behind: a JSONL log, a PNG of dev nDCG@10, atomic checkpoints.

Layout of ``--out DIR``:

* ``train_log.jsonl``: one JSON object a line, ``{"event": "config" | "data" | "step" | "eval" | "stop" | "done", ...}``;
* ``dev_ndcg.png``: dev nDCG@10 against steps (and the training loss), redrawn at every evaluation;
* ``best/``: the checkpoint with the best dev score so far (the one to use);
* ``last/``: the final weights, when asked for;
* ``summary.json``: best step and score, skips, timings;
* ``trainer_state/``: while the run is under way, what ``--resume`` continues it from (weights, optimizer,
  random generators, position: `twotower.retrieval.training.resume`); removed when the run finishes.

Checkpoints are written into a temporary sibling directory and swapped into
place (`twotower.common.atomic.atomic_replace_dir`), so an interrupted save never
leaves a half-written ``best/``, and a kill at any moment leaves the last complete one.
What saves killed mid-write left (``.best.tmp-PID/``, ``.dev_ndcg.png.tmp-*``) is
swept when the next run opens the directory.

A run told to replace an earlier one (``replace``, ``--overwrite``) whose ``--out``
holds that run's checkpoints or summary is built in ``OUT.unfinished`` and swapped
in by `TrainingRun.finish` (as `twotower finetune` does): a run stopped on the way
leaves the earlier run whole, never its ``summary.json`` or ``last/`` beside the
new run's ``best/``.  The earlier run's log then becomes the new run's
``train_log.jsonl.previous``; its other files go with it.  Files of the user's that
appear in ``--out`` meanwhile stop the swap (`refuse_swap_over_theirs`): the complete
run, its state kept, stays in ``OUT.unfinished`` until a ``resume`` swaps it in.

A resumed run (``resume``) writes where the run it continues did (``OUT.unfinished`` when that one was
replacing an earlier run), keeps its log up to the step its training state was saved at (what follows
would be done again) and goes on with a ``resume`` record; its clock goes on from the state's seconds.

Nothing is written to ``--out`` until the trainer calls `TrainingRun.open` (or
something is saved): records logged before are kept in memory and written then.
Why: the trainers read and check their inputs after the run has begun logging,
and a start that failed on a malformed training file had already moved the
earlier run's log to ``train_log.jsonl.previous``; a failed start now leaves an
earlier run in ``--out`` exactly as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from twotower.common.atomic import (
    TMP_MARKER,
    atomic_path,
    atomic_replace_dir,
    atomic_write_text,
    commit_staged_run,
    left_by_a_stopped_run,
    recover_replaced_dir,
    refuse_swap_over_theirs,
    staging_dir,
    sweep_temporaries,
)
from twotower.common.paths import beside_earlier_refusal, foreign_entries

RUN_OUTPUTS = ("best", "last", "summary.json")  # what marks a directory as holding an earlier run's results
STATE_DIR = "trainer_state"  # a run under way's resumable state (`twotower.retrieval.training.resume`)
# Every name a run writes into its directory (this module, the trainers' document vectors and mined negatives):
# --overwrite replaces a directory holding only these, never one holding a user's file beside them.
RUN_NAMES = frozenset({*RUN_OUTPUTS, STATE_DIR, "train_log.jsonl", "train_log.jsonl.previous", "dev_ndcg.png",
                       "negatives.jsonl", "negatives.jsonl.meta.json", "document_vectors.npy", "document_ids.json"})


class TrainingRun:
    """A run's directory; enabled False (the other ranks under torchrun): records are kept, nothing written.

    `target` is the directory the run ends up in; `out` the one it writes into meanwhile: `target` itself, or
    with `replace` and an earlier run there, ``target.unfinished`` (see the module docstring).
    """

    def __init__(self, out: str, enabled: bool = True, replace: bool = False, resume: bool = False) -> None:
        self.target = out
        if resume:  # where the run saved its state: a replacing run's is in the staging directory
            staged = staging_dir(out)
            self.out = staged if os.path.isdir(os.path.join(staged, STATE_DIR)) else out
            if self.out == staged and enabled:  # its swap is still to come: not over files added meanwhile
                refuse_swap_over_theirs(staged, out, RUN_NAMES)
        else:
            if replace and (theirs := beside_run(out)):  # the swap at the end would delete them with the run
                raise ValueError(beside_run_message(out, theirs))
            self.out = staging_dir(out) if replace and holds_run(out) else out
        if self.staged and os.path.lexists(self.out) and not left_by_a_stopped_run(self.out, "train_log.jsonl"):
            raise ValueError(f"{self.out} is in the way: a run replacing {out} is built there; move it away")
        self.enabled = enabled
        self.log_path = os.path.join(self.out, "train_log.jsonl")
        self.plot_path = os.path.join(self.out, "dev_ndcg.png")
        self.records: list[dict] = []
        self.start = time.time()
        self.opened = False
        self.resume_step: int | None = None  # set by `resume_at`
        self.identity: dict = {}  # what makes a resume the same run (`twotower.retrieval.training.resume`)

    @property
    def state_dir(self) -> str:
        """Where the run's resumable state is saved (and a resume reads it)."""
        return os.path.join(self.out, STATE_DIR)

    def resume_at(self, step: int, elapsed: float, records: int) -> None:
        """Continue the run whose state was saved after `step` steps and `elapsed` seconds, when its log held
        `records` records: `open` keeps those (what followed will be done again), and the clock (the records'
        ``time``, a time budget) goes on from `elapsed`."""
        self.resume_step, self._resume_records, self._resumed_at = step, records, elapsed
        self.start = time.time() - elapsed

    def open(self) -> None:
        """Start writing into `out`: the earlier run's log becomes ``train_log.jsonl.previous`` and the records
        logged so far are written. Call it once the inputs are read and checked (saving calls it too)."""
        if self.opened or not self.enabled:
            return
        if self.resume_step is not None:
            self._open_resumed()
            return
        if self.staged:  # what a stopped replacing run left: started again from nothing
            shutil.rmtree(self.out, ignore_errors=True)
        os.makedirs(self.out, exist_ok=True)
        sweep_temporaries(self.out)  # saves a kill interrupted: a checkpoint's temporary copy, a half-drawn PNG
        # an earlier run's state is not this run's: left there, a --resume after this run stopped before its
        # first save would have continued the earlier run under this one's log
        shutil.rmtree(self.state_dir, ignore_errors=True)
        if os.path.exists(self.log_path):  # a new run starts a new log
            os.replace(self.log_path, self.log_path + ".previous")
        self.opened = True
        if self.records:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.writelines(json.dumps(r, default=_jsonable) + "\n" for r in self.records)

    def _open_resumed(self) -> None:
        """`open` for a resumed run: the log as it was when the state was saved (what came after, a line a kill
        tore included, is dropped), a ``resume`` record, then the records logged so far; `records` then reads as
        the one run it is. Why by count, not by step: records without a step (the choice of a hybrid weight
        after the last step) would otherwise be kept and then written again."""
        from twotower.encoder.training.run_log import RunLog

        sweep_temporaries(self.out)
        kept = RunLog(self.log_path).read()[: self._resume_records]
        # at the state's seconds: the records this process logged before `open` come after it
        marker = {"event": "resume", "time": round(self._resumed_at, 2), "from_step": self.resume_step}
        self.records = [*kept, marker, *self.records]
        atomic_write_text(self.log_path, "".join(json.dumps(r, default=_jsonable) + "\n" for r in self.records))
        self.opened = True

    @property
    def staged(self) -> bool:
        """Whether the run is built apart and swapped into `target` when it finishes."""
        return self.out != self.target

    def final_path(self, path: str | None) -> str | None:
        """Where `path`, inside the directory the run writes, will be once the run is finished."""
        if path is None or not self.staged or not path.startswith(self.out + os.sep):
            return path
        return os.path.join(self.target, path[len(self.out) + 1:])

    @property
    def elapsed(self) -> float:
        return time.time() - self.start

    def log(self, event: str, **fields: Any) -> dict:
        record = {"event": event, "time": round(self.elapsed, 2), **fields}
        self.records.append(record)
        if self.opened:  # before `open`, the record waits in `records`
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, default=_jsonable) + "\n")
        return record

    def save_checkpoint(self, name: str, write: Callable[[str], None]) -> str:
        """Call ``write(tmp_dir)`` then swap tmp_dir into ``out/name`` atomically. Returns the final path."""
        self.open()
        target = os.path.join(self.out, name)
        tmp = os.path.join(self.out, f".{name}{TMP_MARKER}{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            write(tmp)
            atomic_replace_dir(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def finish(self, summary: dict) -> dict:
        """Close the run: `summary` plus the seconds it took, as the ``done`` record and ``summary.json``; a
        staged run then replaces the earlier one (paths in `summary` name where the files end up)."""
        summary = {k: self.final_path(v) if isinstance(v, str) else v for k, v in summary.items()}
        summary = {**summary, "seconds": round(self.elapsed, 1)}
        self.log("done", **summary)
        self.write_summary(summary)
        self._commit()  # refused over files of the user's: the state stays, and --resume swaps the run in
        if self.enabled:  # a finished run is not continued: its state (weights and moments) only took room
            shutil.rmtree(os.path.join(self.target, STATE_DIR), ignore_errors=True)
        return summary

    def _commit(self) -> None:
        """Swap a staged, complete run into `target`; the earlier run's log is kept as ``.previous``."""
        if not (self.staged and self.enabled):
            return
        commit_staged_run(self.out, self.target, os.path.basename(self.log_path), RUN_NAMES)

    def write_summary(self, summary: dict) -> None:
        if self.enabled:
            self.open()
            atomic_write_text(os.path.join(self.out, "summary.json"),
                              json.dumps(summary, indent=2, default=_jsonable) + "\n")

    def plot(self, metric: str = "ndcg@10", title: str = "") -> None:
        """PNG of the dev metric over steps, with the (smoothed) training loss on a second axis."""
        if not self.enabled:
            return
        self.open()
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        evals = [r for r in self.records if r["event"] == "eval"]
        steps = [r for r in self.records if r["event"] == "step"]
        fig, ax = plt.subplots(figsize=(7, 4))
        if evals:
            ax.plot([r["step"] for r in evals], [r[metric] for r in evals], marker="o", color="C0")
        ax.set_xlabel("step")
        ax.set_ylabel(f"dev {metric}", color="C0")
        ax.grid(alpha=0.3)
        if steps:
            ax2 = ax.twinx()
            losses = [r["loss"] for r in steps]
            w = max(1, len(losses) // 50)
            smooth = [sum(losses[max(0, i - w + 1):i + 1]) / len(losses[max(0, i - w + 1):i + 1])
                      for i in range(len(losses))]
            ax2.plot([r["step"] for r in steps], smooth, color="C1", lw=0.8, alpha=0.7)
            ax2.set_ylabel("training loss", color="C1")
        if title:
            ax.set_title(title)
        fig.tight_layout()
        with atomic_path(self.plot_path) as tmp:
            fig.savefig(tmp, format="png", dpi=90)
        plt.close(fig)


def _has_results(out: str) -> bool:
    """Whether `out` holds what a run saved (a checkpoint or its summary), not just a log; a checkpoint a kill
    left moved aside mid-save is put back first."""
    for name in RUN_OUTPUTS[:2]:
        recover_replaced_dir(os.path.join(out, name))
    return any(os.path.lexists(os.path.join(out, name)) for name in RUN_OUTPUTS)


def holds_run(out: str) -> bool:
    """Whether `out` holds an earlier run (a checkpoint or its summary, not just a log) and nothing but what
    a run writes: only such a directory is replaced whole by a run with ``replace`` (``--overwrite``).

    Why: ``best/`` beside the user's ``mycode.py`` was taken for an earlier run, and the swap that replaced
    it deleted the user's file.
    """
    return _has_results(out) and not foreign_entries(out, RUN_NAMES)


def beside_run(out: str) -> list[str]:
    """The entries of `out` that no run writes, when it holds an earlier run's results beside them (which
    ``--overwrite`` would replace, and them with it); [] otherwise."""
    if not os.path.isdir(out) or not _has_results(out):
        return []
    return foreign_entries(out, RUN_NAMES)


def beside_run_message(out: str, theirs: list[str]) -> str:
    """The refusal of an --out holding an earlier run and the user's files (`beside_run`), in the CLI's words."""
    return beside_earlier_refusal(f"--out {out}", "an earlier run", theirs)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)
