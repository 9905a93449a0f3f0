"""Interpolating reranker and first-stage scores, with the weight chosen on a dev split.

A cross-encoder trained for minutes on a CPU can be a *weaker* ranker than the
first stage it reorders; even a strong one often gains from keeping some of the
first-stage evidence (Nogueira & Cho's monoBERT + BM25 interpolation, Pyserini's
``--alpha``).  Scores live on different scales (logits vs cosines vs BM25), so
each query's candidate scores are z-normalised before mixing:

    final = alpha * z(rerank) + (1 - alpha) * z(first stage)

alpha = 1 is pure reranking, 0 keeps the first-stage order.  `choose_alpha`
picks it on dev queries (never test); the reranker trainer stores the choice
next to the checkpoint (`ALPHA_FILE`) and `SearchPipeline` applies it.

Example:
    >>> import numpy as np
    >>> interpolate(np.array([3.0, 1.0, 2.0]), np.array([0.1, 0.3, 0.2]), 1.0).argsort()[::-1].tolist()
    [0, 2, 1]
    >>> interpolate(np.array([3.0, 1.0, 2.0]), np.array([0.1, 0.3, 0.2]), 0.0).argsort()[::-1].tolist()
    [1, 2, 0]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

import numpy as np

ALPHA_FILE = "rerank_interpolation.json"
ALPHA_GRID = tuple(round(a, 1) for a in np.arange(0.0, 1.01, 0.1))


def zscores(x: np.ndarray) -> np.ndarray:
    """(n,) -> (n,) zero mean, unit variance; all-equal scores become zeros (no information)."""
    x = np.asarray(x, dtype=np.float64)
    sd = x.std()
    return (x - x.mean()) / sd if sd > 0 else np.zeros_like(x)


def interpolate(rerank: np.ndarray, first: np.ndarray, alpha: float) -> np.ndarray:
    """One query's candidates: alpha * z(rerank) + (1 - alpha) * z(first). Shapes (n,) -> (n,)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"interpolation weight alpha must be in [0, 1], got {alpha}")
    if alpha == 1.0:
        return np.asarray(rerank, dtype=np.float64)  # pure reranking keeps the cross-encoder's own scores
    return alpha * zscores(rerank) + (1.0 - alpha) * zscores(first)


def interpolate_run(rerank: Mapping[str, Mapping[str, float]], first: Mapping[str, Mapping[str, float]],
                    alpha: float) -> dict[str, dict[str, float]]:
    """Runs {qid: {doc: score}}: the reranked candidates rescored by `interpolate` (first-stage scores looked up)."""
    out = {}
    for q, docs in rerank.items():
        ids = list(docs)
        if not ids:
            out[q] = {}
            continue
        mixed = interpolate(np.array([docs[d] for d in ids]), np.array([first[q][d] for d in ids]), alpha)
        out[q] = dict(zip(ids, mixed.tolist()))
    return out


def choose_alpha(rerank: Mapping[str, Mapping[str, float]], first: Mapping[str, Mapping[str, float]],
                 qrels: Mapping[str, Mapping[str, int]], grid: Sequence[float] = ALPHA_GRID
                 ) -> tuple[float, dict[float, float]]:
    """The alpha of `grid` with the best dev nDCG@10 (ties: the larger alpha), and the whole curve."""
    from twotower.retrieval.training.dev_eval import ndcg_at_10

    curve = {float(a): ndcg_at_10(interpolate_run(rerank, first, float(a)), qrels)["ndcg@10"] for a in grid}
    best = max(curve, key=lambda a: (curve[a], a))
    return best, curve


def write_alpha(directory: str, alpha: float, **details) -> None:
    """Store `alpha` (and optional JSON-ready details of how it was chosen) next to a reranker checkpoint."""
    from twotower.common.atomic import atomic_write_text

    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"interpolation weight alpha must be in [0, 1], got {alpha}")
    atomic_write_text(os.path.join(directory, ALPHA_FILE), json.dumps({"alpha": alpha, **details}, indent=2) + "\n")


def read_alpha(directory: str) -> float | None:
    """The dev-chosen alpha stored with a reranker checkpoint, or None when there is none."""
    path = os.path.join(directory, ALPHA_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            value = json.load(f)["alpha"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: expected a JSON object with a numeric 'alpha' ({exc})") from None
    if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{path}: alpha must be a number in [0, 1], got {value!r}")
    return float(value)
