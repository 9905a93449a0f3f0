"""twotower: two-tower retrieval and reranking over your own documents.

``import twotower`` is cheap: the public names below are imported on first use (PEP 562),
so the command line answers ``--help`` and argument errors without loading torch or FAISS.

    >>> import twotower
    >>> sorted(twotower.__all__)[:3]
    ['BaseMismatchError', 'CrossEncoder', 'DataError']

The packages, one namespace, arrows pointing one way:

* ``twotower.common`` — atomic writes, ``DataError`` for bad input, device/precision, heap, ranks
  (imports nothing of ours)
* ``twotower.encoder`` — tokenizer, BERT, heads, checkpoints; pretraining and task fine-tuning
* ``twotower.indexing`` — FAISS vectors with string ids, SQLite documents, BM25, crash-safe commits
* ``twotower.retrieval`` — dual encoder, cross-encoder, fusion, ``SearchPipeline``;
  ``twotower.retrieval.training`` trains them
* ``twotower.eval`` — trec_eval-exact metrics, dataset readers and writers, reports
* ``twotower.cli`` — the ``twotower`` command line (the application; nothing imports it)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

_EXPORTS = {
    "SearchPipeline": "twotower.retrieval.pipeline",
    "Hit": "twotower.retrieval.hit",
    "DualEncoder": "twotower.retrieval.dual_encoder",
    "CrossEncoder": "twotower.retrieval.cross_encoder",
    "EncoderMismatchError": "twotower.retrieval.manifest",
    # the errors the docs tell a caller to catch (docs/python-api.md, "Errors")
    "DataError": "twotower.common.errors",
    "FilterError": "twotower.indexing.filters",
    "DiskFullError": "twotower.retrieval.build",
    "BaseMismatchError": "twotower.retrieval.default_reranker",
    "DualTrainConfig": "twotower.retrieval.training.train_dual",
    "train_dual": "twotower.retrieval.training.train_dual",
    "RerankerTrainConfig": "twotower.retrieval.training.train_reranker",
    "train_reranker": "twotower.retrieval.training.train_reranker",
    "IndexStore": "twotower.indexing.store",
    "evaluate": "twotower.eval.metrics.retrieval",
    "load_beir": "twotower.eval.io.beir",
    # task fine-tuning and prediction (docs/python-api.md, "Fine-tuning and prediction")
    "FinetuneConfig": "twotower.encoder.finetuning.finetune",
    "finetune": "twotower.encoder.finetuning.finetune",
    "TaskModel": "twotower.encoder.finetuning.task_model",
    "TextExample": "twotower.encoder.finetuning.task_examples",
    "TagExample": "twotower.encoder.finetuning.task_examples",
    "QAExample": "twotower.encoder.finetuning.task_examples",
    "read_text_examples": "twotower.eval.tasks",
    "read_tag_examples": "twotower.eval.tasks",
    "read_qa_examples": "twotower.eval.tasks",
}

__all__ = [
    "BaseMismatchError",
    "CrossEncoder",
    "DataError",
    "DiskFullError",
    "DualEncoder",
    "DualTrainConfig",
    "EncoderMismatchError",
    "FilterError",
    "FinetuneConfig",
    "Hit",
    "IndexStore",
    "QAExample",
    "RerankerTrainConfig",
    "SearchPipeline",
    "TagExample",
    "TaskModel",
    "TextExample",
    "__version__",
    "evaluate",
    "finetune",
    "load_beir",
    "read_qa_examples",
    "read_tag_examples",
    "read_text_examples",
    "train_dual",
    "train_reranker",
]

if TYPE_CHECKING:  # pragma: no cover
    from twotower.common.errors import DataError
    from twotower.encoder.finetuning.finetune import FinetuneConfig, finetune
    from twotower.encoder.finetuning.task_examples import QAExample, TagExample, TextExample
    from twotower.encoder.finetuning.task_model import TaskModel
    from twotower.eval.io.beir import load_beir
    from twotower.eval.metrics.retrieval import evaluate
    from twotower.eval.tasks import read_qa_examples, read_tag_examples, read_text_examples
    from twotower.indexing.filters import FilterError
    from twotower.indexing.store import IndexStore
    from twotower.retrieval.build import DiskFullError
    from twotower.retrieval.cross_encoder import CrossEncoder
    from twotower.retrieval.default_reranker import BaseMismatchError
    from twotower.retrieval.dual_encoder import DualEncoder
    from twotower.retrieval.hit import Hit
    from twotower.retrieval.manifest import EncoderMismatchError
    from twotower.retrieval.pipeline import SearchPipeline
    from twotower.retrieval.training.train_dual import DualTrainConfig, train_dual
    from twotower.retrieval.training.train_reranker import RerankerTrainConfig, train_reranker


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'twotower' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
