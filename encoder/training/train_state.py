"""Resumable training state without pickle: tensors in safetensors, scalars in JSON, one atomic directory.

`torch.save` is pickle, and docs/architecture.md ("Checkpoints and files") says nothing is ever unpickled, so the
optimizer's ``state_dict`` is split: its per-parameter tensors (AdamW's
``exp_avg``, ``exp_avg_sq``, ``step``) go to ``optimizer.safetensors`` under keys
``"<param index>/<name>"``, everything else (param groups, non-tensor values) to
``state.json``.  RNG states are uint8 tensors and go to ``rng.safetensors``.

The whole directory is built beside the target and swapped in with
`atomic_replace_dir`, so model weights, optimizer moments, RNG and data
position always belong to the same step, and a kill at any moment of a save
leaves the last complete state readable.  A state damaged afterwards (a file
cut short by a copy, a disk error, an edit) is a `DataError` naming the file,
from `load_train_state` or `restore_train_state`, never a traceback from
safetensors or torch halfway into a resumed run.

Layout of ``<dir>``:
    model.safetensors      the model's own state_dict (exactly what `load_state_dict` wants)
    optimizer.safetensors  optimizer tensors
    rng.safetensors        torch CPU (and the training GPU's) generator states
    state.json             {"optimizer": {...}, "user": {...caller's scalars...}}
    NAME.safetensors       more tensors of the caller's, saved with the rest (``extra``: fine-tuning keeps
                           the seed's best weights there)
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file

from twotower.common.atomic import TMP_MARKER, atomic_replace_dir, atomic_write_text, recover_replaced_dir
from twotower.common.errors import DataError
from twotower.encoder.core.checkpoint import load_safetensors


@dataclass
class TrainState:
    model: dict[str, torch.Tensor]
    optimizer: dict  # a torch optimizer state_dict, ready for `load_state_dict`
    rng: dict[str, torch.Tensor]
    user: dict  # the caller's JSON scalars (step, tokens, elapsed, data position, config ...)
    extra: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # NAME -> NAME.safetensors' tensors


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


def _cuda_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


def _device_of(state: dict[str, torch.Tensor]) -> torch.device:
    """The device a model trains on (whose generator draws its dropout): that of its weights."""
    return next(iter(state.values())).device if state else torch.device("cpu")


def capture_rng(device: torch.device | str) -> dict[str, torch.Tensor]:
    """The CPU generator's state and, training on a GPU, that GPU's (``torch_cuda``), not one per device
    index: under torchrun only rank 0 saves, and each rank restores into its own GPU, so a state per index
    gave rank r the state of a GPU that rank 0 never drew from."""
    device = torch.device(device)
    rng = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["torch_cuda"] = torch.cuda.get_rng_state(_cuda_index(device))
    return rng


def restore_rng(rng: dict[str, torch.Tensor], device: torch.device | str) -> None:
    """Restore what `capture_rng` saved into the CPU generator and, on a GPU, into `device`'s."""
    device = torch.device(device)
    if "torch_cpu" in rng:
        torch.set_rng_state(rng["torch_cpu"])
    if device.type == "cuda":
        i = _cuda_index(device)
        # states saved before ``torch_cuda`` hold ``torch_cuda_<index>`` for every GPU: this one's is read
        state = rng.get("torch_cuda", rng.get(f"torch_cuda_{i}"))
        if state is not None:
            torch.cuda.set_rng_state(state, i)


def save_train_state(directory: str, model_state: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                     user: dict, rng: dict[str, torch.Tensor] | None = None,
                     extra: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """Write model + optimizer + RNG + `user` scalars to `directory`, atomically as a whole.

    rng: the generator states to save (default `capture_rng` of the model's device); a caller under torchrun
    whose ranks draw different streams passes every rank's (`twotower.retrieval.training.loop`).
    extra: more tensors that belong to the same moment, ``{NAME: tensors}``, each saved as ``NAME.safetensors``
    (`load_train_state` reads them back when asked for by name).
    """
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    # a temporary name (`TMP_MARKER`): a kill mid-save leaves a full model + optimizer copy that the run's
    # next start sweeps (`twotower.common.atomic.sweep_temporaries`)
    build = tempfile.mkdtemp(prefix=f".{os.path.basename(directory)}{TMP_MARKER}", dir=parent)
    try:
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in model_state.items()},
                  os.path.join(build, "model.safetensors"))
        opt_tensors, opt_meta = optimizer_to_flat(optimizer)
        save_file(opt_tensors, os.path.join(build, "optimizer.safetensors"))
        save_file(capture_rng(_device_of(model_state)) if rng is None else rng, os.path.join(build, "rng.safetensors"))
        for name, tensors in (extra or {}).items():
            save_file({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()},
                      os.path.join(build, f"{name}.safetensors"))
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


def load_train_state(directory: str, map_location: str | torch.device = "cpu",
                     extra: tuple[str, ...] = ()) -> TrainState:
    """Read what `save_train_state` wrote (and the `extra` tensor files named, onto `map_location` as the
    model); a missing file is named in the error, a damaged one is a `DataError` naming it (the caller adds
    what the user can do about it). A state a kill left moved aside mid-save is put back first
    (`recover_replaced_dir`)."""
    recover_replaced_dir(directory)
    for name in ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json",
                 *(f"{n}.safetensors" for n in extra)):
        if not os.path.isfile(os.path.join(directory, name)):
            raise FileNotFoundError(f"training state incomplete: {os.path.join(directory, name)} is missing")
    meta_path = os.path.join(directory, "state.json")
    meta = _read_meta(meta_path)
    device = str(map_location)
    opt_path = os.path.join(directory, "optimizer.safetensors")
    # On the CPU whatever the device: Optimizer.load_state_dict moves the moments to their parameters' device
    # itself but keeps AdamW's ``step`` tensors where they are, and a ``step`` on a GPU makes every step sync
    # once per parameter (torch keeps it on the CPU for that reason).
    opt_tensors = load_safetensors(opt_path, device="cpu", remedy=None)
    try:
        optimizer = optimizer_from_flat(opt_tensors, meta["optimizer"])
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # keys not "<index>/<name>", groups not a list
        raise DataError(opt_path, None, f"damaged: its tensors do not fit {meta_path} ({_reason(exc)})") from None
    return TrainState(
        model=load_safetensors(os.path.join(directory, "model.safetensors"), device=device, remedy=None),
        optimizer=optimizer,
        rng=load_safetensors(os.path.join(directory, "rng.safetensors"), remedy=None),
        user=meta["user"],
        extra={n: load_safetensors(os.path.join(directory, f"{n}.safetensors"), device=device, remedy=None)
               for n in extra},
    )


def read_train_user(directory: str, recover: bool = True) -> dict:
    """The caller's scalars of the state in `directory` (its ``state.json``), without reading a tensor: what a
    resume checks before any model or data work. A state a kill left moved aside is put back first (unless
    `recover` is False: a look that must change no files, on any rank, while rank 0 may be saving); a missing
    or damaged ``state.json`` is named as in `load_train_state`."""
    if recover:
        recover_replaced_dir(directory)
    path = os.path.join(directory, "state.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"training state incomplete: {path} is missing")
    return _read_meta(path)["user"]


def _read_meta(path: str) -> dict:
    """state.json: an object with an ``optimizer`` object (its ``param_groups`` a list) and a ``user`` object."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(path, None, f"damaged: not JSON ({_reason(exc)})") from None
    if not isinstance(meta, dict):
        raise DataError(path, None, f"damaged: a JSON {type(meta).__name__}, not an object")
    for key in ("optimizer", "user"):
        if not isinstance(meta.get(key), dict):
            raise DataError(path, None, f"damaged: it has no {key!r} object")
    groups, scalars = meta["optimizer"].get("param_groups"), meta["optimizer"].get("scalars", {})
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups) or not isinstance(scalars, dict):
        raise DataError(path, None, "damaged: its optimizer is not a list of 'param_groups' objects and "
                                    "an object of 'scalars'")
    return meta


def restore_train_state(state: TrainState, directory: str, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer) -> None:
    """Load `state` (read from `directory`) into `model` and `optimizer` and restore the RNG.

    Why checked here: a state that does not fit the model and optimizer it was saved from is damaged (the
    caller has made sure the run's settings are the same), and torch said so in its own words (missing keys,
    a size mismatch), or not at all until the first optimizer step (a moment of the wrong shape, a missing
    ``step``). Each is a `DataError` naming the file at fault.
    """
    model_path = os.path.join(directory, "model.safetensors")
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state.model)), sorted(set(state.model) - set(own))
    if missing or unexpected:
        raise DataError(model_path, None, "damaged: " + "; ".join(
            what.format(n=len(keys), names=", ".join(keys[:3]) + (", ..." if len(keys) > 3 else ""))
            for what, keys in (("it lacks {n} of the model's tensors ({names})", missing),
                               ("it holds {n} tensor(s) the model has not ({names})", unexpected)) if keys))
    for name, value in state.model.items():
        if value.shape != own[name].shape:
            raise DataError(model_path, None, f"damaged: {name} has shape {tuple(value.shape)}, the model's "
                                              f"{tuple(own[name].shape)}")
    model.load_state_dict(state.model)
    _check_optimizer_state(state.optimizer, optimizer, directory)
    try:
        optimizer.load_state_dict(state.optimizer)
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise DataError(os.path.join(directory, "state.json"), None,
                        f"damaged: its optimizer does not fit the model's parameters ({_reason(exc)})") from None
    try:
        restore_rng(state.rng, _device_of(own))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise DataError(os.path.join(directory, "rng.safetensors"), None,
                        f"damaged: not a random-generator state ({_reason(exc)})") from None


def _check_optimizer_state(saved: dict, optimizer: torch.optim.Optimizer, directory: str) -> None:
    """Every saved per-parameter state names a parameter of `optimizer` and holds what a step of this
    optimizer keeps (AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``), each moment shaped like its parameter."""
    path = os.path.join(directory, "optimizer.safetensors")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    want = _state_names(optimizer)
    for idx, pstate in saved["state"].items():
        if not 0 <= idx < len(params):
            raise DataError(path, None, f"damaged: it holds state for parameter {idx}, but the model has "
                                        f"{len(params)}")
        if want is not None and set(pstate) != want:
            lacks, extra = sorted(want - set(pstate)), sorted(set(pstate) - want)
            raise DataError(path, None, f"damaged: the state of parameter {idx} "
                                        + (f"lacks {', '.join(lacks)}" if lacks else f"holds {', '.join(extra)}, "
                                           f"which {type(optimizer).__name__} does not keep"))
        for name, value in pstate.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[idx].shape:
                raise DataError(path, None, f"damaged: {idx}/{name} has shape {tuple(value.shape)}, its parameter "
                                            f"{tuple(params[idx].shape)}")


def _state_names(optimizer: torch.optim.Optimizer) -> set[str] | None:
    """The per-parameter state one step of `optimizer` keeps, from a one-element probe (None: no probe fits)."""
    import inspect

    accepted = inspect.signature(type(optimizer)).parameters  # AdamW's defaults hold a key it does not take
    probe = torch.zeros(1, requires_grad=True)
    try:
        other = type(optimizer)([probe], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        probe.grad = torch.zeros(1)
        other.step()
    except (TypeError, ValueError, RuntimeError):
        return None
    return set(other.state[probe])


def _reason(exc: BaseException) -> str:
    """An exception's message on one line (torch's run over several)."""
    return " ".join(str(exc).split()) or type(exc).__name__
