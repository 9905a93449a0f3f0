"""Exports load in sentence-transformers and give our numbers: dual encoders (cosine) and rerankers (scores)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.retrieval.training_fixtures import tiny_beir_dir, tiny_model_dir
from twotower.retrieval.export import (
    check_cross_encoder,
    check_sentence_transformers,
    export_dual_encoder,
    export_reranker,
)

pytest.importorskip("sentence_transformers")

TEXTS = ["tea cold drink", "gene expression in cancer cell " * 4, "virus", "mouse human blood brain heart"]


def _perturbed_dual(prefixes: bool):
    from twotower.retrieval.dual_encoder import DualEncoder

    dual = DualEncoder.from_pretrained(tiny_model_dir(), pooling="mean", normalize=True, bf16=False,
                                       query_prefix="query: " if prefixes else "",
                                       document_prefix="passage: " if prefixes else "")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in dual.query_tower.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return dual


@pytest.mark.parametrize("prefixes", [False, True])
def test_dual_encoder_export_matches_sentence_transformers(tmp_path, prefixes):
    dual = _perturbed_dual(prefixes)
    out = export_dual_encoder(dual, str(tmp_path / "dual"), metadata={"note": "test"})
    for name in ("modules.json", "config_sentence_transformers.json", "1_Pooling/config.json",
                 "sentence_bert_config.json", "2_Normalize", "config.json", "model.safetensors", "training_args.json"):
        assert os.path.exists(os.path.join(out, name)), name
    docs = dual.encode_documents(TEXTS)
    queries = dual.encode_queries(TEXTS)
    assert check_sentence_transformers(out, TEXTS, docs, prompt_name="document" if prefixes else None) >= 0.9999
    assert check_sentence_transformers(out, TEXTS, queries, prompt_name="query" if prefixes else None) >= 0.9999
    if prefixes:  # the prompts matter: without them the vectors differ
        assert check_sentence_transformers(out, TEXTS, queries) < 0.9999
        prompts = json.load(open(os.path.join(out, "config_sentence_transformers.json")))["prompts"]
        assert prompts == {"query": "query: ", "document": "passage: "}


def test_trained_dual_encoder_checkpoint_matches_sentence_transformers(tmp_path):
    from twotower.retrieval.dual_encoder import DualEncoder
    from twotower.retrieval.training.train_dual import DualTrainConfig, train_dual

    cfg = DualTrainConfig(model=tiny_model_dir(), data=tiny_beir_dir(), out=str(tmp_path / "run"), batch_size=4,
                          max_steps=3, eval_every=3, lr=5e-3, normalize=True, doc_max_length=48, progress=False,
                          dev_fraction=0.25, bf16=False)
    res = train_dual(cfg)
    dual = DualEncoder.from_pretrained(res.best_dir, bf16=False)
    assert check_sentence_transformers(res.best_dir, TEXTS, dual.encode_documents(TEXTS)) >= 0.9999
    args = json.load(open(os.path.join(res.best_dir, "training_args.json")))
    assert args["data"] == tiny_beir_dir()


def test_reranker_export_matches_sentence_transformers(tmp_path):
    from twotower.retrieval.cross_encoder import CrossEncoder

    ce = CrossEncoder.from_encoder(tiny_model_dir(), device="cpu", bf16=False, max_length=40)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ce.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    out = export_reranker(ce, str(tmp_path / "rr"), metadata={"loss": "listwise"})
    pairs = [("tea", t) for t in TEXTS] + [("gene cell", t) for t in TEXTS]
    ours = ce.predict(pairs)
    assert np.ptp(ours) > 1e-2
    diff, same = check_cross_encoder(out, pairs, ours)
    assert diff < 1e-4 and same
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["architectures"] == ["BertForSequenceClassification"] and cfg["num_labels"] == 1


def test_export_replaces_atomically(tmp_path):
    dual = _perturbed_dual(False)
    target = tmp_path / "m"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    export_dual_encoder(dual, str(target))
    assert not (target / "stale.txt").exists() and (target / "modules.json").exists()
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]
