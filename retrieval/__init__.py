"""twotower.retrieval: dual encoder, cross-encoder, fusion, and the SearchPipeline that ties recall and rerank.

* ``DualEncoder`` — query and document towers (shared or separate), prefixes, fingerprint.
* ``SearchPipeline`` — build / load an index directory, ``search`` (dense or hybrid recall,
  cross-encoder rerank) returning ``Hit``s, ``add`` / ``delete`` / ``save``.
* ``CrossEncoder`` — (query, document) scoring in one input; ``train_reranker``, ``train_dual``,
  ``mine_hard_negatives`` and the sentence-transformers exports train and ship the towers.
* ``reciprocal_rank_fusion``, ``score_fusion`` — hybrid-search fusion, pure functions.

Exports are imported lazily (PEP 562) so that ``twotower --help`` and the CLI's
argument checks do not pay for importing torch and FAISS.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "CrossEncoder": "retrieval.cross_encoder",
    "DualTrainConfig": "retrieval.train_dual",
    "train_dual": "retrieval.train_dual",
    "RerankerTrainConfig": "retrieval.train_reranker",
    "train_reranker": "retrieval.train_reranker",
    "mine_hard_negatives": "retrieval.mining",
    "independent_crops": "retrieval.self_supervised",
    "inverse_cloze": "retrieval.self_supervised",
    "export_dual_encoder": "retrieval.export",
    "export_reranker": "retrieval.export",
    "DualEncoder": "retrieval.dual_encoder",
    "EncoderMismatchError": "retrieval.manifest",
    "Hit": "retrieval.hit",
    "Answer": "retrieval.reader",
    "AnswerResult": "retrieval.reader",
    "RRF_K": "retrieval.fusion",
    "SearchPipeline": "retrieval.pipeline",
    "normalize_scores": "retrieval.fusion",
    "reciprocal_rank_fusion": "retrieval.fusion",
    "score_fusion": "retrieval.fusion",
}

__all__ = [
    "CrossEncoder",
    "DualTrainConfig",
    "train_dual",
    "RerankerTrainConfig",
    "train_reranker",
    "mine_hard_negatives",
    "independent_crops",
    "inverse_cloze",
    "export_dual_encoder",
    "export_reranker",
    "RRF_K",
    "DualEncoder",
    "EncoderMismatchError",
    "Hit",
    "Answer",
    "AnswerResult",
    "SearchPipeline",
    "normalize_scores",
    "reciprocal_rank_fusion",
    "score_fusion",
]

if TYPE_CHECKING:  # pragma: no cover
    from retrieval.dual_encoder import DualEncoder
    from retrieval.fusion import RRF_K, normalize_scores, reciprocal_rank_fusion, score_fusion
    from retrieval.hit import Hit
    from retrieval.manifest import EncoderMismatchError
    from retrieval.pipeline import SearchPipeline
    from retrieval.reader import Answer, AnswerResult


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'retrieval' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
