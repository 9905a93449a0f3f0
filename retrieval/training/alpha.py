"""Choosing the rerank / first-stage interpolation weight on dev queries (never test).

`twotower.retrieval.interpolation` applies ``final = alpha * z(rerank) + (1 - alpha) * z(first stage)``;
this module picks the alpha that maximises dev nDCG@10 over a grid.  It is training
code because it needs the dev metrics (`twotower.retrieval.training.dev_eval`); inference only
reads the stored choice.

Example:
    >>> qrels = {"q": {"a": 1}}
    >>> rerank, first = {"q": {"a": 2.0, "b": 1.0}}, {"q": {"a": 0.0, "b": 1.0}}
    >>> choose_alpha(rerank, first, qrels, grid=(0.0, 1.0))[0]  # the reranker is right: pure reranking
    1.0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from twotower.retrieval.interpolation import interpolate_run
from twotower.retrieval.training.dev_eval import dev_metrics

ALPHA_GRID = tuple(round(a, 1) for a in np.arange(0.0, 1.01, 0.1))


def choose_alpha(rerank: Mapping[str, Mapping[str, float]], first: Mapping[str, Mapping[str, float]],
                 qrels: Mapping[str, Mapping[str, int]], grid: Sequence[float] = ALPHA_GRID
                 ) -> tuple[float, dict[float, float]]:
    """The alpha of `grid` with the best dev nDCG@10 (ties: the larger alpha), and the whole curve."""
    curve = {float(a): dev_metrics(interpolate_run(rerank, first, float(a)), qrels)["ndcg@10"] for a in grid}
    best = max(curve, key=lambda a: (curve[a], a))
    return best, curve
