"""Interpolating reranker and first-stage scores with a weight stored beside the reranker.

A cross-encoder trained for minutes on a CPU can be a *weaker* ranker than the
first stage it reorders; even a strong one often gains from keeping some of the
first-stage evidence (Nogueira & Cho's monoBERT + BM25 interpolation, Pyserini's
``--alpha``).  Scores live on different scales (logits vs cosines vs BM25), so
each query's candidate scores are z-normalised before mixing:

    final = alpha * z(rerank) + (1 - alpha) * z(first stage)

alpha = 1 is pure reranking, 0 keeps the first-stage order.  The reranker
trainer picks it on dev queries, never test (`twotower.retrieval.training.alpha`),
and stores the choice next to the checkpoint (`ALPHA_FILE`); `SearchPipeline`
applies it.  A weight suits the first stage it was chosen over: a reranker whose dev run also reranked
other first stages stores their weights too (``by_first_stage``, e.g. {"dense": 0.6, "hybrid": 0.4}),
and a hybrid search uses the hybrid's.  Applying lives here, in inference; choosing it needs the dev
metrics, so it lives with training.

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
from collections.abc import Mapping

import numpy as np

from twotower.common.atomic import atomic_write_text
from twotower.retrieval.fusion import normalize_scores

ALPHA_FILE = "rerank_interpolation.json"


FIRST_STAGES = ("dense", "hybrid", "bm25")  # the recalls a search runs, as stored weights name them


def first_stage_name(hybrid: bool = False, bm25: bool = False) -> str:
    """"dense", "bm25" or "hybrid": the recall a search runs, named as the reranker trainer names the first
    stage it chose a weight over (`twotower train reranker --first-stage`); both flags at once are refused.

    Why one name: the stored interpolation weights are looked up by it, and the command line, the service
    and the Python API each take the two switches their own way.
    """
    if hybrid and bm25:
        raise ValueError(both_recalls("bm25=True", "hybrid=True"))
    return "hybrid" if hybrid else "bm25" if bm25 else "dense"


def first_stage_switches(stage: str) -> dict[str, bool]:
    """The ``hybrid`` / ``bm25`` keywords of `SearchPipeline.search` that run `stage` (`first_stage_name`'s inverse).

    Example:
        >>> first_stage_switches("bm25")
        {'hybrid': False, 'bm25': True}
    """
    if stage not in FIRST_STAGES:
        raise ValueError(f"first stage {stage!r}; choose one of {FIRST_STAGES}")
    return {"hybrid": stage == "hybrid", "bm25": stage == "bm25"}


def both_recalls(bm25: str, hybrid: str) -> str:
    """The refusal of BM25-alone and hybrid recall asked for at once, with each named as the caller's user wrote
    it (``--bm25`` on the command line, ``bm25=true`` to the service, ``bm25=True`` in Python)."""
    return f"{bm25} recalls by BM25 alone and {hybrid} fuses BM25 with dense recall: give one, not both"


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"interpolation weight alpha must be in [0, 1], got {alpha}")


def interpolate(rerank: np.ndarray, first: np.ndarray, alpha: float) -> np.ndarray:
    """One query's candidates: alpha * z(rerank) + (1 - alpha) * z(first). Shapes (n,) -> (n,).

    z is `twotower.retrieval.fusion.normalize_scores` with "zscore": all-equal scores become zeros.
    """
    _check_alpha(alpha)
    if alpha == 1.0:
        return np.asarray(rerank, dtype=np.float64)  # pure reranking keeps the cross-encoder's own scores
    return alpha * normalize_scores(rerank, "zscore") + (1.0 - alpha) * normalize_scores(first, "zscore")


def interpolate_run(rerank: Mapping[str, Mapping[str, float]], first: Mapping[str, Mapping[str, float]],
                    alpha: float) -> dict[str, dict[str, float]]:
    """Runs {qid: {doc: score}}: the reranked candidates rescored by `interpolate` (first-stage scores looked up)."""
    out = {}
    for q, docs in rerank.items():
        ids = list(docs)
        mixed = interpolate(np.array([docs[d] for d in ids]), np.array([first[q][d] for d in ids]), alpha)
        out[q] = dict(zip(ids, mixed.tolist()))
    return out


def write_alpha(directory: str, alpha: float, by_first_stage: Mapping[str, float] | None = None, **details) -> None:
    """Store `alpha` (and per-first-stage weights, and JSON-ready details of how they were chosen) next to a
    reranker checkpoint."""
    _check_alpha(alpha)
    record: dict = {"alpha": alpha}
    if by_first_stage:
        for a in by_first_stage.values():
            _check_alpha(a)
        record["by_first_stage"] = dict(by_first_stage)
    atomic_write_text(os.path.join(directory, ALPHA_FILE), json.dumps({**record, **details}, indent=2) + "\n")


def read_first_stage_alphas(directory: str) -> dict[str, float]:
    """{first stage: alpha} stored with a reranker checkpoint ({} when none are)."""
    path = os.path.join(directory, ALPHA_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        try:
            table = json.load(f).get("by_first_stage", {})
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ValueError(f"{path}: expected a JSON object ({exc})") from None
    if not isinstance(table, dict) or not all(isinstance(v, int | float) and 0.0 <= v <= 1.0 for v in table.values()):
        raise ValueError(f"{path}: by_first_stage must map first-stage names to numbers in [0, 1], got {table!r}")
    return {str(k): float(v) for k, v in table.items()}


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
