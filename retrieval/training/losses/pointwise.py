"""Pointwise binary cross-entropy for rerankers on labeled (query, passage, label) pairs (monoBERT).

Each pair is judged alone: sigmoid(logit) is the probability of relevance, so
labels are 0/1, or graded judgments scaled to [0, 1] (grade / max grade).

Example:
    >>> import torch
    >>> round(float(pointwise_bce(torch.tensor([0.0]), torch.tensor([1.0]))), 6)  # -log(0.5)
    0.693147
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pointwise_bce(logits: torch.Tensor, labels: torch.Tensor, pos_weight: float | None = None) -> torch.Tensor:
    """logits: (N,), labels: (N,) in [0, 1]; `pos_weight` up-weights positives when they are rare."""
    if logits.shape != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} differ in shape")
    if bool(((labels < 0) | (labels > 1)).any()):
        raise ValueError("pointwise labels must lie in [0, 1]; scale graded judgments by the maximum grade")
    weight = None if pos_weight is None else torch.tensor(pos_weight, device=logits.device)
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), pos_weight=weight)
