"""Exporting trained models in the formats other tools read, and checking that they read them the same way.

* A dual encoder becomes a sentence-transformers directory (HF BERT files +
  ``modules.json``, ``config_sentence_transformers.json`` with the query /
  document prompts, ``1_Pooling/config.json``, ``sentence_bert_config.json``,
  ``2_Normalize`` when normalised); separate towers become two such directories
  named by ``dual_encoder.json`` (`twotower.retrieval.dual_encoder.DualEncoder` owns the layout).
* A reranker becomes an HF ``BertForSequenceClassification`` directory with
  ``num_labels=1`` (`twotower.retrieval.cross_encoder.CrossEncoder.save_pretrained`).

Both are written into a temporary sibling and swapped into place, so a reader
never sees half a model, and carry ``training_args.json`` (how they were made).
The ``check_*`` functions load the export with sentence-transformers and compare
its outputs with ours: they are what the export tests assert and what a user can
run after training (``min cosine`` for vectors, ``max |diff|`` and ranking
agreement for reranker scores).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from twotower.common.atomic import atomic_replace_dir, atomic_write_text

TRAINING_ARGS = "training_args.json"


def write_training_args(directory: str, metadata: Mapping) -> None:
    """``training_args.json``: the settings and data a checkpoint was trained with."""
    atomic_write_text(os.path.join(directory, TRAINING_ARGS), json.dumps(dict(metadata), indent=2, default=str) + "\n")


def write_model_dir(directory: str, write: Callable[[str], None], metadata: Mapping | None = None) -> str:
    """Have `write` fill a fresh sibling folder, then swap it in as `directory`: a failure leaves `directory`
    as it was. Returns the path."""
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(directory))}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        write(tmp)
        if metadata is not None:
            write_training_args(tmp, metadata)
        atomic_replace_dir(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def export_dual_encoder(dual, directory: str, metadata: Mapping | None = None) -> str:
    """Write `dual` (a `DualEncoder`) as a sentence-transformers directory, atomically. Returns the path."""
    return write_model_dir(directory, dual.save_pretrained, metadata)


def export_reranker(cross_encoder, directory: str, metadata: Mapping | None = None) -> str:
    """Write a `CrossEncoder` as an HF seq-classification directory (num_labels=1), atomically."""
    return write_model_dir(directory, cross_encoder.save_pretrained, metadata)


def check_sentence_transformers(directory: str, texts: Sequence[str], ours: np.ndarray,
                                prompt_name: str | None = None) -> float:
    """Min cosine between ``SentenceTransformer(directory).encode(texts)`` and `ours` (N, H)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(directory, device="cpu")
    theirs = model.encode(list(texts), prompt_name=prompt_name, convert_to_numpy=True, batch_size=16)
    a = ours / np.linalg.norm(ours, axis=1, keepdims=True)
    b = theirs / np.linalg.norm(theirs, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def check_cross_encoder(directory: str, pairs: Sequence[tuple[str, str]], ours: np.ndarray) -> tuple[float, bool]:
    """(max |score difference|, same ranking) of ``sentence_transformers.CrossEncoder(directory).predict``."""
    from sentence_transformers import CrossEncoder

    theirs = CrossEncoder(directory, device="cpu").predict(list(pairs), batch_size=16)
    same = bool((np.argsort(-theirs, kind="stable") == np.argsort(-ours, kind="stable")).all())
    return float(np.abs(theirs - ours).max()), same
