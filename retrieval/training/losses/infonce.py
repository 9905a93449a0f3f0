"""InfoNCE with in-batch and hard negatives (van den Oord et al. 2018; Karpukhin et al. 2020, DPR).

Each query q_i is scored against every document of the batch: its own positive,
the other queries' positives (in-batch negatives) and all hard negatives.  The
loss is cross-entropy of the positive among them, at temperature tau:

    L = -1/B * sum_i log( exp(s(q_i, d_i+)/tau) / sum_j exp(s(q_i, d_j)/tau) )

With unit vectors s is cosine and tau = 0.05 is the usual fixed choice (SimCSE,
E5); a learned temperature is parameterised as log(1/tau), as in CLIP, so that
it stays positive and moves on a sensible scale.  The symmetric variant adds
the document-to-query direction over the positives (CLIP-style).

Documents a query must not be pushed away from (an in-batch document that is
also one of its labelled positives) are excluded with `mask`, not counted as
negatives.

Example:
    >>> import torch
    >>> q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> d = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    >>> round(float(info_nce(q, d, temperature=1.0)), 6)  # -log(e / (e + 1))
    0.313262
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def similarity_matrix(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Dot products in float32. q: (B, H), d: (N, H) -> (B, N)."""
    return q.float() @ d.float().T


def info_nce(
    q: torch.Tensor,
    d: torch.Tensor,
    temperature: float | torch.Tensor = 0.05,
    positive_index: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    symmetric: bool = False,
) -> torch.Tensor:
    """Contrastive loss of queries against a pool of documents.

    Args:
        q: (B, H) query embeddings (normalised for cosine similarity).
        d: (N, H) document embeddings, N >= B; by default rows 0..B-1 are the
            positives of queries 0..B-1 and the rest are (hard) negatives.
        temperature: tau, a float or a 0-d tensor (learned).
        positive_index: (B,) column of each query's positive in `d` (default arange(B)).
        mask: (B, N) bool, True = leave this document out of query i's softmax
            (it is another of its positives). The positive itself is never masked.
        symmetric: also score each positive against all queries (doc -> query).
    Returns:
        scalar loss, the mean over queries (and over both directions if symmetric).
    """
    B, N = q.shape[0], d.shape[0]
    if N < B:
        raise ValueError(f"need at least one document per query: {B} queries, {N} documents")
    if positive_index is None:
        positive_index = torch.arange(B, device=q.device)
    scores = similarity_matrix(q, d) / temperature  # (B, N)
    if mask is not None:
        if mask.shape != (B, N):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {(B, N)}")
        keep_pos = F.one_hot(positive_index, N).bool()  # (B, N)
        scores = scores.masked_fill(mask & ~keep_pos, float("-inf"))
    loss = F.cross_entropy(scores, positive_index)
    if not symmetric:
        return loss
    # doc -> query: each positive picks its query among all queries of the batch.
    pos = d[positive_index]  # (B, H)
    back = similarity_matrix(pos, q) / temperature  # (B, B)
    if mask is not None:
        # query j is a wrong answer for positive i unless positive i is also j's positive.
        also_pos = mask.gather(1, positive_index[None, :].expand(B, B)).T  # (B, B): [i, j] = d_i is a pos of q_j
        back = back.masked_fill(also_pos & ~torch.eye(B, dtype=torch.bool, device=q.device), float("-inf"))
    return 0.5 * (loss + F.cross_entropy(back, torch.arange(B, device=q.device)))


class Temperature(nn.Module):
    """tau as a module: fixed (a buffer) or learned (a parameter on log(1/tau), clamped to [0.01, 1])."""

    def __init__(self, init: float = 0.05, learn: bool = False) -> None:
        super().__init__()
        if not 0 < init <= 1:
            raise ValueError(f"temperature must be in (0, 1], got {init}")
        value = torch.tensor(math.log(1.0 / init))
        if learn:
            self.log_inv_tau = nn.Parameter(value)
        else:
            self.register_buffer("log_inv_tau", value)
        self.learn = learn

    def forward(self) -> torch.Tensor:
        return 1.0 / self.log_inv_tau.clamp(0.0, math.log(100.0)).exp()

    def extra_repr(self) -> str:
        return f"tau={float(self()):.4f}, learn={self.learn}"
