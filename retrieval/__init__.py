"""twotower.retrieval: dual encoder, cross-encoder, fusion, and the SearchPipeline that ties recall and rerank.

* ``DualEncoder`` — query and document towers (shared or separate), prefixes, fingerprint.
* ``SearchPipeline`` — build / load an index directory, ``search`` (dense, BM25 or hybrid recall,
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
    "CrossEncoder": "twotower.retrieval.cross_encoder",
    "RerankWindows": "twotower.retrieval.cross_encoder",
    "DualTrainConfig": "twotower.retrieval.training.train_dual",
    "train_dual": "twotower.retrieval.training.train_dual",
    "RerankerTrainConfig": "twotower.retrieval.training.train_reranker",
    "train_reranker": "twotower.retrieval.training.train_reranker",
    "mine_hard_negatives": "twotower.retrieval.training.mining",
    "independent_crops": "twotower.retrieval.training.self_supervised",
    "inverse_cloze": "twotower.retrieval.training.self_supervised",
    "export_dual_encoder": "twotower.retrieval.export",
    "export_reranker": "twotower.retrieval.export",
    "DualEncoder": "twotower.retrieval.dual_encoder",
    "EncoderMismatchError": "twotower.retrieval.manifest",
    "Hit": "twotower.retrieval.hit",
    "Answer": "twotower.retrieval.reader",
    "AnswerResult": "twotower.retrieval.reader",
    "RRF_K": "twotower.retrieval.fusion",
    "SearchPipeline": "twotower.retrieval.pipeline",
    "normalize_scores": "twotower.retrieval.fusion",
    "reciprocal_rank_fusion": "twotower.retrieval.fusion",
    "score_fusion": "twotower.retrieval.fusion",
}

__all__ = [
    "CrossEncoder",
    "RerankWindows",
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
    from twotower.retrieval.dual_encoder import DualEncoder
    from twotower.retrieval.fusion import RRF_K, normalize_scores, reciprocal_rank_fusion, score_fusion
    from twotower.retrieval.hit import Hit
    from twotower.retrieval.manifest import EncoderMismatchError
    from twotower.retrieval.pipeline import SearchPipeline
    from twotower.retrieval.reader import Answer, AnswerResult


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'retrieval' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
