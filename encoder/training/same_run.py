"""Whether a ``--resume`` continues the run that saved the training state it finds, or another one.

A resumable run saves its identity with its state (`train_state`, under the state's ``"run"`` key):

    {"settings": {name: value}, "inputs": {key: SHA-256}, "world_size": N, "compute": {"device": .., "bf16": ..},
     "real_paths": {name: real path}}

``settings`` are what the run was told (each is named by its flag when it differs; a model directory as typed,
its real path in ``real_paths``, `real_paths`), ``inputs`` the
fingerprints of what it read (a file, or a list of examples: compared by content, so a copy moved elsewhere
is still the same input), ``compute`` where it computed. `check_same_run` refuses a command whose settings,
inputs or process count differ, naming each difference with the run's value, since continuing would train
another run under the first one's schedule; another device or precision is allowed with a warning (a run
may move to another machine, but its later steps are then computed differently).

Used by the retrieval trainers (`twotower.retrieval.training.resume`) and fine-tuning
(`twotower.encoder.finetuning.finetune`); each builds its own identity and says where its settings are listed.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from twotower.common.atomic import recover_replaced_dir, staging_dir
from twotower.common.distributed import launched_as
from twotower.common.errors import DataError
from twotower.encoder.training.train_state import read_train_user

logger = logging.getLogger(__name__)


def plain(value: Any) -> Any:
    """As JSON reads it back (tuples become lists), so a saved setting and a current one compare equal."""
    return json.loads(json.dumps(value))


def shown(value: Any) -> str:
    """A setting's value as a message shows it."""
    if value is None:
        return "(not given)"
    return json.dumps(value) if not isinstance(value, str) else value


def locate_state(out: str, name: str) -> str | None:
    """The state directory (`name`) a ``--resume`` of the run in `out` continues from: that of a run replacing
    an earlier one (``OUT.unfinished``, `staging_dir`) or of the run in `out` itself; None when neither has one.
    A state a kill left moved aside mid-save is put back first (`recover_replaced_dir`)."""
    for directory in (staging_dir(out), out):
        state = os.path.join(directory, name)
        if os.path.isdir(directory):
            recover_replaced_dir(state)
        if os.path.isdir(state):
            return state
    return None


def real_path(value: Any) -> Any:
    """A setting that names an existing file or directory as its real path (absolute, links resolved); any other
    value (None, ``"default"``) as it is.

    Why: a setting that names a model is compared by what it names, not by how it was typed: ``./m``,
    ``/abs/m`` and ``m`` from another working directory are the same model, and a resume of one spelled
    otherwise was refused as another run. Applied to the saved value too, so a state saved with the path as
    typed compares the same way.
    """
    return os.path.realpath(value) if isinstance(value, str) and os.path.exists(value) else value


def real_paths(settings: dict, paths: tuple[str, ...]) -> dict[str, Any]:
    """The `real_path` of each setting in `paths`, recorded beside the settings as typed (`same_path`)."""
    return {name: real_path(settings[name]) for name in paths if name in settings}


def same_path(name: str, saved: dict, now: dict) -> tuple[Any, Any] | None:
    """None when setting `name` (a file or directory) of the run `saved` and of the command `now` name the same
    thing, else (the command's, the run's) as a refusal shows them.

    Why both the typed and the real path: compared by real path alone (``./m`` is ``/abs/m``), a project
    directory moved with its run (``/A`` to ``/A2``) was refused, ``--model /A2/m (the run: /A/m)``, although the
    same command in it named the same model; so a setting typed the same (up to `os.path.normpath`) is the same
    when the run's real path no longer exists. A state saved before the real paths were recorded holds one value: both sides are
    compared by its `real_path`, as then.
    """
    typed, typed_now = saved["settings"].get(name), now["settings"].get(name)
    recorded = saved.get("real_paths")
    if not isinstance(recorded, dict) or name not in recorded:  # an older state
        before, after = real_path(typed), real_path(typed_now)
        return None if before == after else (after, before)
    before, after = recorded[name], real_path(typed_now)
    if before == after:
        return None
    moved = isinstance(before, str) and not os.path.exists(before)
    as_typed = [os.path.normpath(v) if isinstance(v, str) else v for v in (typed, typed_now)]  # `./m` is `m`
    return None if moved and as_typed[0] == as_typed[1] else (after, before)


def flag_of(name: str, flags: dict[str, str]) -> str:
    """A setting's flag as the user types it: `flags`' entry for a setting named otherwise, else ``--`` and
    the name with dashes (``max_steps`` -> ``--max-steps``)."""
    return flags.get(name, "--" + name.replace("_", "-"))


def read_saved_identity(state: str) -> tuple[dict, dict]:
    """(the state's scalars, the identity of the run that saved it); a state without one is damaged."""
    user = read_train_user(state)
    identity = user.get("run")
    if not isinstance(identity, dict) or not all(isinstance(identity.get(k), dict)
                                                 for k in ("settings", "inputs")):
        raise DataError(os.path.join(state, "state.json"), None,
                        "damaged: it does not say which run saved it ('run'); start the run again without --resume")
    return user, identity


def check_same_run(saved: dict, now: dict, out: str, flags: dict[str, str], listed: str,
                   compute_flags: str, paths: tuple[str, ...] = (), ignored: tuple[str, ...] = ()) -> None:
    """Refuse a resume of the run in `out` that would continue another run than the one saved, naming each
    difference in flags (`flags`: the flags of settings named otherwise, `flag_of`; `listed`: where the run's
    own settings can be read); the settings in `paths` name files or directories and are compared by what they
    name (`same_path`), those in `ignored` not at all (a state saved before they were left out of the identity);
    warn when it computes elsewhere (`compute_flags`: the flags that choose that)."""
    differ = []
    before, after = ({k: v for k, v in side["settings"].items() if k not in ignored} for side in (saved, now))
    for name in sorted(set(before) | set(after)):
        differs = (same_path(name, saved, now) if name in paths else
                   None if before.get(name) == after.get(name) else (after.get(name), before.get(name)))
        if differs is not None:
            differ.append(f"{flag_of(name, flags)} {shown(differs[0])} (the run: {shown(differs[1])})")
    for key in sorted(set(saved["inputs"]) | set(now["inputs"])):
        if key not in now["inputs"]:
            differ.append(f"{key} is not an input now (the run read it)")
        elif key not in saved["inputs"]:
            differ.append(f"{key} was not an input of the run")
        elif saved["inputs"][key] != now["inputs"][key]:
            differ.append(f"{key} has changed since the run read it (SHA-256)")
    if saved.get("world_size", 1) != now.get("world_size", 1):
        differ.append(f"{now.get('world_size', 1)} process(es) (the run: {saved.get('world_size', 1)}; torchrun "
                      "--nproc-per-node)")
    if differ:
        raise ValueError(f"cannot resume {out}: this command differs from the run it continues: {'; '.join(differ)}. "
                         f"Give the run's own settings and files ({listed})")
    if saved.get("compute") and saved["compute"] != now["compute"] and launched_as().is_main:  # said once
        logger.warning("resuming %s on %s; the run trained on %s (%s): the steps from here are computed "
                       "differently, so the result will not equal an uninterrupted run", out,
                       _compute_shown(now["compute"]), _compute_shown(saved["compute"]), compute_flags)


def _compute_shown(compute: dict) -> str:
    return f"{compute.get('device', '?')} {'bf16' if compute.get('bf16') else 'fp32'}"
