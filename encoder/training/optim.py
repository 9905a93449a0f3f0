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
