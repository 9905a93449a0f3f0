"""Listwise distillation: the reranker's softmax over a group pulled towards a teacher's (Hofstätter et al. 2020).

Why a reranker trained on a few hundred labeled queries needs it: the listwise label loss only asks
the positive to beat *these* negatives, and with few queries the cheapest way is to learn which
documents are evidence rather than what makes a document relevant; such a reranker helps on queries
whose positives it saw and not elsewhere.  A teacher that already ranks well on any query (the
dual encoder whose top-k the reranker reorders) scores every document of the group; matching its
distribution over the negatives as well keeps the order among them, which the labels say nothing
about, and keeps the reranker from drifting away from a ranking that generalises.

    L = 1/G * sum_g KL(softmax(t_g) || softmax(s_g))

Example:
    >>> import torch
    >>> float(listwise_kl(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]])))  # same distribution
    0.0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def listwise_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """student, teacher: (G, n) logits of the same documents in the same order; the mean KL over groups."""
    if student.shape != teacher.shape or student.ndim != 2:
        raise ValueError(f"student {tuple(student.shape)} and teacher {tuple(teacher.shape)} must both be (G, n)")
    log_s = F.log_softmax(student.float(), dim=-1)  # (G, n)
    log_t = F.log_softmax(teacher.float(), dim=-1)  # (G, n)
    return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")
