"""Listwise softmax cross-entropy for rerankers (Nogueira & Cho 2019 style groups; "LCE", Gao et al. 2021).

A group is one query with one positive and n negatives, scored jointly by the
cross-encoder; the loss is cross-entropy of the positive among the group:

    L = -1/G * sum_g log softmax(s_g)[0]

Unlike pointwise BCE it only asks the positive to outscore *these* negatives,
which is what reranking needs, and it is insensitive to a constant shift of the
scores.

Example:
    >>> import torch
    >>> round(float(listwise_ce(torch.tensor([[2.0, 0.0, 0.0]]))), 6)  # -log(e^2 / (e^2 + 2))
    0.239545
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def listwise_ce(scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """scores: (G, 1 + n) with the positive in column 0; valid: (G, 1 + n) bool, False = padding slot."""
    if scores.ndim != 2 or scores.shape[1] < 2:
        raise ValueError(f"scores must be (groups, 1 + negatives) with >= 1 negative, got {tuple(scores.shape)}")
    scores = scores.float()
    if valid is not None:
        if not bool(valid[:, 0].all()):
            raise ValueError("the positive (column 0) of every group must be valid")
        scores = scores.masked_fill(~valid, float("-inf"))
    target = torch.zeros(scores.shape[0], dtype=torch.long, device=scores.device)
    return F.cross_entropy(scores, target)
