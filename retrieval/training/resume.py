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
later steps are then computed differently.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict
from typing import Any

from twotower.common.atomic import recover_replaced_dir, staging_dir
from twotower.common.errors import DataError
from twotower.encoder.training.train_state import read_train_user
from twotower.indexing.integrity import file_sha256
from twotower.retrieval.training.training_run import STATE_DIR

logger = logging.getLogger(__name__)

# Settings that change how a run is watched or where it computes, not what it computes: a resume may differ.
UNCHECKED = ("progress", "overwrite", "resume", "save_every", "resumable", "device", "bf16")
# Settings that name input files: compared by content (`input_fingerprints`), not by path.
INPUT_FIELDS = ("pairs", "data", "corpus", "negatives", "first_stage")
# The flag of a setting whose name is not the flag's (`--` + the name with dashes otherwise).
FLAGS = {"eval_interval_s": "--eval-interval", "shared": "--separate-towers", "chunk_size": "--grad-cache-chunk",
         "bf16": "--no-bf16"}


def flag_of(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def find_state(out: str) -> str:
    """The state directory ``--resume`` continues from: that of a run replacing an earlier one
    (``OUT.unfinished``) or of the run in `out`. Refused, saying why, when there is none."""
    for directory in (staging_dir(out), out):
        state = os.path.join(directory, STATE_DIR)
        if os.path.isdir(directory):
            recover_replaced_dir(state)  # a save killed between its two renames left it moved aside
        if os.path.isdir(state):
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
    settings = {k: v for k, v in _plain(asdict(cfg)).items() if k not in UNCHECKED and k not in INPUT_FIELDS}
    return {"settings": settings, "inputs": input_fingerprints(cfg), "world_size": world_size, "compute": compute}


def input_fingerprints(cfg: Any) -> dict[str, str]:
    """SHA-256 of each input file, keyed ``"<flag> <file>"``: a file as given, or a BEIR directory's files (its
    corpus, queries and the qrels split trained on). A flag that names no file (``--first-stage bm25``) has none."""
    out = {}
    for name in INPUT_FIELDS:
        path = getattr(cfg, name, None)
        if not isinstance(path, str):
            continue
        if os.path.isfile(path):
            out[f"{flag_of(name)} {os.path.basename(path)}"] = file_sha256(path)
        elif os.path.isdir(path):
            split = os.path.join("qrels", f"{getattr(cfg, 'split', 'train')}.tsv")
            for rel in sorted(os.listdir(path)) + [split]:
                full = os.path.join(path, rel)
                if os.path.isfile(full):
                    out[f"{flag_of(name)} {rel}"] = file_sha256(full)
    return out


def read_saved_identity(state: str) -> tuple[dict, dict]:
    """(the state's scalars, the identity of the run that saved it); a state without one is damaged."""
    user = read_train_user(state)
    identity = user.get("run")
    if not isinstance(identity, dict) or not all(isinstance(identity.get(k), dict)
                                                 for k in ("settings", "inputs")):
        raise DataError(os.path.join(state, "state.json"), None,
                        "damaged: it does not say which run saved it ('run'); start the run again without --resume")
    return user, identity


def check_same_run(saved: dict, now: dict, out: str) -> None:
    """Refuse a resume that would continue another run than the one saved, naming each difference in flags."""
    differ = []
    before, after = saved["settings"], now["settings"]
    for name in sorted(set(before) | set(after)):
        if before.get(name) != after.get(name):
            differ.append(f"{flag_of(name)} {_shown(after.get(name))} (the run: {_shown(before.get(name))})")
    for key in sorted(set(saved["inputs"]) | set(now["inputs"])):
        if key not in now["inputs"]:
            differ.append(f"{key} is not an input now (the run read it)")
        elif key not in saved["inputs"]:
            differ.append(f"{key} was not an input of the run")
        elif saved["inputs"][key] != now["inputs"][key]:
            differ.append(f"{key} has changed since the run read it (SHA-256)")
    if saved.get("world_size", 1) != now["world_size"]:
        differ.append(f"{now['world_size']} process(es) (the run: {saved.get('world_size', 1)}; torchrun "
                      "--nproc-per-node)")
    if differ:
        raise ValueError(f"cannot resume {out}: this command differs from the run it continues: {'; '.join(differ)}. "
                         "Give the run's own settings and files (its first 'config' record in "
                         f"{os.path.join(out, 'train_log.jsonl')} lists them)")
    if saved.get("compute") and saved["compute"] != now["compute"]:
        logger.warning("resuming %s on %s; the run trained on %s (--device / --no-bf16): the steps from here are "
                       "computed differently, so the result will not equal an uninterrupted run", out,
                       _compute_shown(now["compute"]), _compute_shown(saved["compute"]))


def _compute_shown(compute: dict) -> str:
    return f"{compute.get('device', '?')} {'bf16' if compute.get('bf16') else 'fp32'}"


def _shown(value: Any) -> str:
    if value is None:
        return "(not given)"
    return json.dumps(value) if not isinstance(value, str) else value


def _plain(value: Any) -> Any:
    """As JSON reads it back (tuples become lists), so a saved setting and a current one compare equal."""
    return json.loads(json.dumps(value))
