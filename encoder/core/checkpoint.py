"""HF-layout checkpoints: config.json + model.safetensors + tokenizer files. Nothing is unpickled.

Our parameter names equal HF `BertModel`'s, so saving is `state_dict()` and
loading is a name check.  Checkpoints of HF task models (`BertForMaskedLM`,
`BertForSequenceClassification` ...) keep the encoder under ``bert.``; we strip
that prefix for the encoder and hand the rest to the head that owns it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from twotower.common.atomic import atomic_path, atomic_write_text
from twotower.common.distributed import launched_as
from twotower.common.errors import DataError
from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.model import BertModel
from twotower.encoder.core.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Buffers some HF versions serialise; they are derived, never learned.
_DERIVED_KEYS = ("embeddings.position_ids",)
# What to do about a damaged weights file of a model directory (`load_safetensors`).
MODEL_REMEDY = "copy or save the model again (a copy or save cut short leaves such a file), or retrain it"


def _damaged(path: str, exc: Exception, remedy: str | None) -> DataError:
    """The error for a file safetensors refused; a pickle (``torch.save``) under a safetensors name is said to be
    one, since "header too large" would send the user looking for damage."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        head = b""
    if head.startswith(b"PK\x03\x04") or (len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return DataError(path, None, "a pickle (torch.save) file, not safetensors: refused, as twotower never "
                                     "unpickles; convert it to safetensors where it was made")
    reason = " ".join(str(exc).split()).removeprefix("Error while deserializing header: ")  # one line
    return DataError(path, None, f"damaged: not a whole safetensors file ({reason})" + (f"; {remedy}" if remedy else ""))


def load_safetensors(path: str, device: str = "cpu", remedy: str | None = MODEL_REMEDY) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file `path`; a damaged file is a `DataError` naming it and `remedy`.

    Why: a file cut short (an interrupted copy or save, a full disk) or overwritten with something else
    failed as a traceback of safetensors' own error ("incomplete metadata, file not fully covered"), naming
    no file. Nothing is unpickled: a pickle renamed ``.safetensors`` is refused the same way.
    remedy: what the user can do about it, appended to the message (None: the caller adds its own).
    """
    from safetensors import SafetensorError

    try:
        return load_file(path, device=device)
    except SafetensorError as exc:
        raise _damaged(path, exc, remedy) from None


def safetensors_names(path: str, remedy: str | None = MODEL_REMEDY) -> list[str]:
    """The tensor names of the safetensors file `path` (its header only); damaged: as `load_safetensors`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as exc:
        raise _damaged(path, exc, remedy) from None


def read_weights(directory: str) -> dict[str, torch.Tensor]:
    path = os.path.join(directory, WEIGHTS_NAME)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(directory, "pytorch_model.bin")):
            raise FileNotFoundError(
                f"{path} not found; {directory} has only pytorch_model.bin, which needs unpickling and is "
                "refused. Convert it to safetensors first."
            )
        raise FileNotFoundError(f"weights file not found: {path}")
    return load_safetensors(path)


def write_weights(directory: str, state: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    os.makedirs(directory, exist_ok=True)
    # safetensors refuses shared / non-contiguous storage: give each tensor its own copy.
    state = {k: v.detach().contiguous().clone() for k, v in state.items()}
    with atomic_path(os.path.join(directory, WEIGHTS_NAME)) as tmp:
        save_file(state, tmp, metadata={"format": "pt", **(metadata or {})})


def split_prefix(state: dict[str, torch.Tensor], prefix: str = "bert.") -> tuple[dict, dict]:
    """Split a task checkpoint into (encoder state without prefix, everything else)."""
    enc, rest = {}, {}
    has_prefix = any(k.startswith(prefix) for k in state)
    for k, v in state.items():
        if has_prefix and k.startswith(prefix):
            enc[k[len(prefix):]] = v
        elif not has_prefix and k.split(".")[0] in ("embeddings", "encoder", "pooler", "final_norm"):
            enc[k] = v
        else:
            rest[k] = v
    for k in _DERIVED_KEYS:
        enc.pop(k, None)
    return enc, rest


def load_into(module: nn.Module, state: dict[str, torch.Tensor], source: str, allow_missing: tuple = ()) -> None:
    """Copy `state` into `module`, with errors that name the tensor and both shapes."""
    own = module.state_dict()
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            raise ValueError(f"{source}: tensor {k!r} has shape {tuple(v.shape)}, model expects {tuple(own[k].shape)}")
    missing = [k for k in own if k not in state and not k.startswith(allow_missing)]
    if missing:
        raise ValueError(f"{source}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = [k for k in state if k not in own]
    if unexpected and launched_as().is_main:  # every torchrun rank loads the same model: said once
        logger.warning("%s: ignoring unexpected tensors %s", source, unexpected[:8])
    module.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)


def check_vocab_fits(directory: str, tokenizer: Tokenizer, config: EncoderConfig) -> None:
    """Refuse a tokenizer with more tokens than the model's embedding table (config.json's vocab_size).

    Why: its ids beyond the table fail inside the embedding lookup (an IndexError deep in torch) or, for the
    ids that fit, mean other tokens than the model learned; a model's tokenizer files replaced by a retrained
    tokenizer (`tokenizer train --out` into the model directory did this) loaded without a word. A smaller
    tokenizer fits (tables are often padded) and is left to the caller's warning.
    """
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{directory}: the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding "
                         f"table has {config.vocab_size} ({CONFIG_NAME} vocab_size): it is not the tokenizer the "
                         "model was trained with; put that one back beside the weights")


def load_encoder(
    directory: str, device: torch.device | str = "cpu", add_pooling_layer: bool = True
) -> tuple[BertModel, Tokenizer]:
    """Load any HF BERT-family directory (ours, all-MiniLM-L6-v2, a BertFor* checkpoint) as (model, tokenizer)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"model directory not found: {directory}")
    config = EncoderConfig.load(os.path.join(directory, CONFIG_NAME))
    tokenizer = Tokenizer.from_pretrained(directory)
    check_vocab_fits(directory, tokenizer, config)
    if tokenizer.vocab_size != config.vocab_size and launched_as().is_main:  # said once under torchrun
        logger.warning("%s: tokenizer has %d tokens, config vocab_size=%d", directory, tokenizer.vocab_size,
                       config.vocab_size)
    enc_state, _ = split_prefix(read_weights(directory))
    has_pooler = add_pooling_layer and any(k.startswith("pooler.") for k in enc_state)
    if add_pooling_layer and not has_pooler:
        logger.info("%s: no pooler weights; loading without a pooler", directory)
    if not has_pooler:  # a pooler the caller did not ask for is expected, not "unexpected"
        enc_state = {k: v for k, v in enc_state.items() if not k.startswith("pooler.")}
    model = BertModel(config, add_pooling_layer=has_pooler)
    load_into(model, enc_state, source=os.path.join(directory, WEIGHTS_NAME))
    return model.to(device).eval(), tokenizer


def save_pretrained(
    directory: str,
    config: EncoderConfig,
    state: dict[str, torch.Tensor],
    tokenizer: Tokenizer | None = None,
    architectures: list[str] | None = None,
    config_extra: dict[str, Any] | None = None,
) -> None:
    """Write an HF model directory. `state` holds HF names (``bert.``-prefixed for task models)."""
    os.makedirs(directory, exist_ok=True)
    write_weights(directory, state)
    cfg = EncoderConfig(**{**{f: getattr(config, f) for f in config.__dataclass_fields__ if f != "extra"}},
                        extra={**config.extra, **(config_extra or {})})
    d = cfg.to_dict()
    if architectures:
        d["architectures"] = architectures
    atomic_write_text(os.path.join(directory, CONFIG_NAME), json.dumps(d, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def save_encoder(model: BertModel, tokenizer: Tokenizer | None, directory: str,
                 extra: dict[str, torch.Tensor] | None = None) -> None:
    """Save a bare encoder so that `transformers.BertModel.from_pretrained(directory)` loads it.

    extra: tensors saved beside the model's own that it does not hold (a sentence encoder's unused pooler,
    `read_pooler`); the model's own win.
    """
    state = {**(extra or {}), **model.state_dict()}
    save_pretrained(directory, model.config, state, tokenizer, architectures=["BertModel"])


def read_pooler(directory: str) -> dict[str, torch.Tensor]:
    """The [CLS] pooler tensors of `directory`'s weights, under bare-encoder names (``pooler.dense.weight``);
    {} when it has none. Only those tensors are read (safetensors opens the file lazily).

    Why: a sentence encoder has no use for the pooler, so it is loaded without one, but an export that leaves
    it out loads elsewhere with a freshly drawn pooler (transformers warns that it is newly initialized).
    """
    from safetensors import safe_open

    path = os.path.join(directory, WEIGHTS_NAME)
    names = safetensors_names(path)
    prefix = "bert.pooler." if any(n.startswith("bert.") for n in names) else "pooler."
    wanted = [n for n in names if n.startswith(prefix)]
    if not wanted:
        return {}
    with safe_open(path, framework="pt") as f:
        return {n.removeprefix("bert."): f.get_tensor(n) for n in wanted}
