"""Continuing a retrieval training run exactly where its saved state left it (``--resume``).

Both trainers save ``OUT/trainer_state/`` (`twotower.encoder.training.train_state`: tensors in safetensors,
the rest in JSON, swapped in whole) after each dev evaluation and every ``save_every`` steps; the run removes
it when it finishes. A resumed run then goes on as the uninterrupted one would have, bit for bit on a CPU
(tests/retrieval/training/test_resume.py), because it restores:

* the weights, AdamW's moments and the torch generators that draw dropout (every rank's under torchrun);
* the batches: each trainer draws one batch a step from streams it seeds the same way at every start, so the
  resumed run draws the batches of the steps done again without training on them (`TrainingLoop.skip`) and
  the next batch is the one the uninterrupted run drew;
* the schedule: steps done, the learning rate's position (`LrState`), the recent step times a time budget
  plans with, the seconds spent (the budget counts them) and when dev was last evaluated;
* the best checkpoint (``best/``, always saved before the state), its step and score, the first dev score;
* the guard's view: it is shown again the step and eval records of the steps done;
* what the trainer itself carries between steps (`TrainingLoop.state_fields`).

Checked before any model or data work, so that a resume never trains another run under the first one's log
and schedule: the same settings (each flag that differs is named, with the run's value), the same input files
(their SHA-256: a file moved elsewhere is still the same input, a file edited is not) and the same number of
processes. Another device or precision is allowed with a warning: a run may move to another machine, but its
later steps are then computed differently (the comparison: `twotower.encoder.training.same_run`, which
fine-tuning shares).
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from twotower.common.errors import DataError
from twotower.encoder.training import same_run
from twotower.encoder.training.same_run import flag_of, locate_state, plain, real_paths
from twotower.encoder.training.train_state import read_train_user
from twotower.indexing.integrity import file_sha256
from twotower.retrieval.training.training_run import STATE_DIR

# Settings that change how a run is watched or where it computes, not what it computes: a resume may differ.
# `out` is where the run is: a run directory moved or copied elsewhere, or named otherwise (`runs/s1/`, an
# absolute path, from another working directory), is resumed where it is.
UNCHECKED = ("progress", "overwrite", "resume", "save_every", "resumable", "device", "bf16", "out")
# Settings that name a model directory: compared by the directory they name (`same_run.same_path`).
PATH_FIELDS = ("model", "teacher")
# Settings that name input files: compared by content (`input_fingerprints`), not by path.
INPUT_FIELDS = ("pairs", "data", "corpus", "negatives", "first_stage")
# What a BEIR directory's reader reads, besides the qrels split trained on (gzip or not).
BEIR_FILES = ("corpus.jsonl", "corpus.jsonl.gz", "queries.jsonl", "queries.jsonl.gz")
# The flag of a setting whose name is not the flag's (`--` + the name with dashes otherwise).
FLAGS = {"eval_interval_s": "--eval-interval", "shared": "--separate-towers", "chunk_size": "--grad-cache-chunk",
         "bf16": "--no-bf16"}


def find_state(out: str) -> str:
    """The state directory ``--resume`` continues from: that of a run replacing an earlier one
    (``OUT.unfinished``) or of the run in `out`. Refused, saying why, when there is none."""
    state = locate_state(out, STATE_DIR)
    if state is not None:
        return state
    if os.path.isfile(os.path.join(out, "summary.json")):
        raise ValueError(f"--resume: the run in {out} finished (summary.json); nothing is left to continue. To "
                         f"train further, start a new run from its checkpoint: --model {os.path.join(out, 'best')}")
    again = "with --overwrite instead of --resume" if os.path.isdir(os.path.join(out, "best")) else "without --resume"
    raise ValueError(f"--resume: no training state in {out} ({STATE_DIR}/ missing): a run saves one at its first "
                     f"dev evaluation after a step (and every --save-every steps); start the run again {again}")


def saved_steps(out: str) -> int | None:
    """The steps done when the run in `out` last saved its state (None: none saved, or unreadable): what an
    interrupted command tells the user ``--resume`` would continue from."""
    try:
        return int(read_train_user(find_state(out))["steps"])
    except (ValueError, FileNotFoundError, DataError, KeyError, TypeError):
        return None


def run_identity(cfg: Any, world_size: int, compute: dict) -> dict:
    """What a resume must match (`check_same_run`): the settings, the input files' SHA-256, the process count;
    and where the run computed (`compute`: device kind and bf16), which may differ with a warning."""
    settings = {k: v for k, v in plain(asdict(cfg)).items() if k not in UNCHECKED and k not in INPUT_FIELDS}
    return {"settings": settings, "inputs": input_fingerprints(cfg), "world_size": world_size, "compute": compute,
            "real_paths": real_paths(settings, PATH_FIELDS)}


def input_fingerprints(cfg: Any) -> dict[str, str]:
    """SHA-256 of each input file, keyed ``"<flag> <file>"``: a file as given, or a BEIR directory's files (its
    corpus, queries and the qrels split trained on). A flag that names no file (``--first-stage bm25``) has none."""
    out = {}
    for name in INPUT_FIELDS:
        path = getattr(cfg, name, None)
        if not isinstance(path, str):
            continue
        if os.path.isfile(path):
            out[f"{flag_of(name, FLAGS)} {os.path.basename(path)}"] = file_sha256(path)
        elif os.path.isdir(path):  # the files training reads there, not a README beside them
            split = os.path.join("qrels", f"{getattr(cfg, 'split', 'train')}.tsv")
            for rel in (*BEIR_FILES, split):
                full = os.path.join(path, rel)
                if os.path.isfile(full):
                    out[f"{flag_of(name, FLAGS)} {rel}"] = file_sha256(full)
    return out


def check_same_run(saved: dict, now: dict, out: str) -> None:
    """Refuse a resume that would continue another run than the one saved, naming each difference in flags
    (`twotower.encoder.training.same_run`)."""
    same_run.check_same_run(saved, now, out, FLAGS, "its first 'config' record in "
                            f"{os.path.join(out, 'train_log.jsonl')} lists them", "--device / --no-bf16",
                            paths=PATH_FIELDS, ignored=UNCHECKED)
