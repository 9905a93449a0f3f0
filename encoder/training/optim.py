"""Optimiser pieces shared by pretraining, task fine-tuning and retrieval training.

AdamW with no weight decay on biases and LayerNorm weights (as BERT), and a
warmup-then-decay schedule expressed as a function of *progress* in [0, 1] so
that it can be keyed to a step count, a token budget or a wall-clock budget and
end exactly when the budget does.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from twotower.common.errors import check_setting


def check_optimizer_settings(lr: float | None, warmup: float, weight_decay: float) -> None:
    """The settings every trainer's schedule and AdamW share, refused in the field's and the flag's words
    (`twotower.common.errors.check_setting`): a negative or NaN rate (torch said "Invalid learning rate"; 0 is
    kept: a run that only evaluates its start), a warmup outside [0, 1) of the run, a negative decay.
    lr None: a default the trainer picks later."""
    check_setting(lr is None or (math.isfinite(lr) and lr >= 0), "lr", lr, "--lr", "give a learning rate >= 0")
    check_setting(0 <= warmup < 1, "warmup", warmup, "--warmup", "give a fraction of the run in [0, 1)")
    check_setting(math.isfinite(weight_decay) and weight_decay >= 0, "weight_decay", weight_decay, "--weight-decay",
                  "give 0 or more")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices, undecayed biases / norms / 1-d parameters."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or name.endswith(".bias") or "LayerNorm" in name or "norm" in name.lower():
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.01,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps)


def lr_factor(progress: float, warmup: float = 0.06, decay: str = "linear", min_factor: float = 0.0) -> float:
    """Learning-rate multiplier at `progress` in [0, 1] of the budget.

    Linear warmup over the first `warmup` fraction, then linear or cosine decay
    to `min_factor` at progress 1.0.
    """
    progress = min(max(progress, 0.0), 1.0)
    if warmup > 0 and progress < warmup:
        return progress / warmup
    rest = (progress - warmup) / max(1e-12, 1.0 - warmup)
    if decay == "linear":
        f = 1.0 - rest
    elif decay == "cosine":
        f = 0.5 * (1.0 + math.cos(math.pi * rest))
    elif decay == "constant":
        f = 1.0
    else:
        raise ValueError(f"decay must be linear, cosine or constant, got {decay!r}")
    return min_factor + (1.0 - min_factor) * f


def set_lr(optimizer: torch.optim.Optimizer, base_lr: float, factor: float) -> None:
    """Every group's lr = base_lr * factor, times the group's ``lr_scale`` where it has one (a fresh head)."""
    for group in optimizer.param_groups:
        group["lr"] = base_lr * factor * group.get("lr_scale", 1.0)
