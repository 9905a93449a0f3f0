"""Resumable training state without pickle: tensors in safetensors, scalars in JSON, one atomic directory.

`torch.save` is pickle, and docs/architecture.md ("Checkpoints and files") says nothing is ever unpickled, so the
optimizer's ``state_dict`` is split: its per-parameter tensors (AdamW's
``exp_avg``, ``exp_avg_sq``, ``step``) go to ``optimizer.safetensors`` under keys
``"<param index>/<name>"``, everything else (param groups, non-tensor values) to
``state.json``.  RNG states are uint8 tensors and go to ``rng.safetensors``.

The whole directory is built beside the target and swapped in with
`atomic_replace_dir`, so model weights, optimizer moments, RNG and data
position always belong to the same step.

Layout of ``<dir>``:
    model.safetensors      the model's own state_dict (exactly what `load_state_dict` wants)
    optimizer.safetensors  optimizer tensors
    rng.safetensors        torch CPU (and CUDA) generator states
    state.json             {"optimizer": {...}, "user": {...caller's scalars...}}
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from twotower.common.atomic import atomic_replace_dir, atomic_write_text


@dataclass
class TrainState:
    model: dict[str, torch.Tensor]
    optimizer: dict  # a torch optimizer state_dict, ready for `load_state_dict`
    rng: dict[str, torch.Tensor]
    user: dict  # the caller's JSON scalars (step, tokens, elapsed, data position, config ...)


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, pstate in sd["state"].items():
        for name, v in pstate.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{idx}/{name}"] = v.detach().cpu().contiguous().clone()
            else:
                scalars[f"{idx}/{name}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_flat(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for key, v in list(tensors.items()) + list(meta.get("scalars", {}).items()):
        idx, name = key.split("/", 1)
        state.setdefault(int(idx), {})[name] = v
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g and isinstance(g["betas"], list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


def capture_rng() -> dict[str, torch.Tensor]:
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            rng[f"torch_cuda_{i}"] = torch.cuda.get_rng_state(i)
    return rng


def restore_rng(rng: dict[str, torch.Tensor]) -> None:
    if "torch_cpu" in rng:
        torch.set_rng_state(rng["torch_cpu"])
    for k, v in rng.items():
        if k.startswith("torch_cuda_") and torch.cuda.is_available():
            i = int(k.rsplit("_", 1)[1])
            if i < torch.cuda.device_count():
                torch.cuda.set_rng_state(v, i)


def save_train_state(directory: str, model_state: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                     user: dict) -> None:
    """Write model + optimizer + RNG + `user` scalars to `directory`, atomically as a whole."""
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    build = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}.", dir=parent)
    try:
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in model_state.items()},
                  os.path.join(build, "model.safetensors"))
        opt_tensors, opt_meta = optimizer_to_flat(optimizer)
        save_file(opt_tensors, os.path.join(build, "optimizer.safetensors"))
        save_file(capture_rng(), os.path.join(build, "rng.safetensors"))
        atomic_write_text(os.path.join(build, "state.json"),
                          json.dumps({"optimizer": opt_meta, "user": user}, indent=1) + "\n")
        for name in os.listdir(build):
            with open(os.path.join(build, name), "rb") as f:
                os.fsync(f.fileno())
        atomic_replace_dir(build, directory)
    except BaseException:
        import shutil

        shutil.rmtree(build, ignore_errors=True)
        raise


def load_train_state(directory: str, map_location: str | torch.device = "cpu") -> TrainState:
    """Read what `save_train_state` wrote; a missing file is named in the error."""
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"):
        if not os.path.isfile(os.path.join(directory, name)):
            raise FileNotFoundError(f"training state incomplete: {os.path.join(directory, name)} is missing")
    with open(os.path.join(directory, "state.json"), encoding="utf-8") as f:
        meta = json.load(f)
    device = str(map_location)
    return TrainState(
        model=load_file(os.path.join(directory, "model.safetensors"), device=device),
        optimizer=optimizer_from_flat(load_file(os.path.join(directory, "optimizer.safetensors"), device=device),
                                      meta["optimizer"]),
        rng=load_file(os.path.join(directory, "rng.safetensors")),
        user=meta["user"],
    )
