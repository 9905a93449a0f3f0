"""Tiny models and corpora for the SearchPipeline / CLI tests (built once per session, cached on disk).

The model is a random BERT with deliberately odd sizes (hidden 36, 3 heads, ffn 37)
and a 40-position maximum, so shape bugs and truncation show up in tests that
run in well under a second per search.
"""

from __future__ import annotations

import functools
import json
import os
import random
import tempfile

import torch

WORDS = (
    "tea coffee cold hot drink water cup leaf green black milk sugar cell gene protein cancer virus "
    "mouse human blood brain heart lung tumor therapy drug dose trial patient risk study effect "
    "increase decrease level high low cause reduce expression receptor signal pathway growth"
).split()

MAX_POSITIONS = 40


def sentences(n: int, seed: int = 0, lo: int = 4, hi: int = 20) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


@functools.cache
def tiny_tokenizer():
    """One tokenizer for every tiny model (WordPiece training may order tied merges differently per run)."""
    from twotower.encoder import Tokenizer

    tok = Tokenizer.train(iterator=sentences(300), vocab_size=120, min_frequency=1, progress=False)
    tok.model_max_length = MAX_POSITIONS
    return tok


def _save_tiny(directory: str, hidden: int, seed: int) -> str:
    from twotower.encoder import EncoderConfig, save_encoder
    from twotower.encoder.core.model import BertModel

    tok = tiny_tokenizer()
    torch.manual_seed(seed)
    config = EncoderConfig(vocab_size=tok.vocab_size, hidden_size=hidden, num_hidden_layers=2,
                           num_attention_heads=3, intermediate_size=37, max_position_embeddings=MAX_POSITIONS)
    save_encoder(BertModel(config, add_pooling_layer=False), tok, directory)
    return directory


@functools.cache
def tiny_model_dir(hidden: int = 36, seed: int = 0) -> str:
    """A random 2-layer BERT (hidden `hidden`) with a ~120-token vocabulary, HF layout, no ST files.

    Loaded without sentence-transformers files, it means mean pooling + normalisation.
    """
    root = tempfile.mkdtemp(prefix="twotower-pipe-")
    return _save_tiny(os.path.join(root, f"tiny-{hidden}-{seed}"), hidden, seed)


def write_corpus(path: str, docs: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    return path


def toy_docs(n: int, seed: int = 0, prefix: str = "d") -> list[dict]:
    texts = sentences(n, seed=seed + 1, lo=3, hi=30)
    return [{"_id": f"{prefix}{i}", "title": f"title {i}" if i % 3 else "", "text": t} for i, t in enumerate(texts)]


def spread_reranker_dir(directory: str, seed: int = 3) -> str:
    """Save a random-weight CrossEncoder on the tiny model whose head is wide enough that scores vary."""
    from twotower.retrieval.cross_encoder import CrossEncoder

    ce = CrossEncoder.from_encoder(tiny_model_dir(), bf16=False, device="cpu")
    with torch.no_grad():
        torch.manual_seed(seed)
        ce.classifier.weight.normal_(0, 1.0)
    ce.save_pretrained(directory)
    return directory


def assert_ranked_by_scores(hits, ids, scores, tol: float = 1e-4) -> None:
    """`hits` carry the score `scores` gives their document (`ids[i]` scored `scores[i]`) and come in that
    score's order, best first, as far as `tol` tells scores apart.

    Why not the exact order of an argsort: the pipeline batches candidates otherwise than a direct
    ``predict``, their scores differ by ~1e-7, and a tiny test model scores many documents alike (gaps of
    1e-5, exact ties), so two such documents can swap (a CI run met d4 and d14 swapped, once in 21 runs).
    """
    import pytest

    by_id = {d: float(s) for d, s in zip(ids, scores)}
    got = [h.rerank_score for h in hits]
    assert got == pytest.approx([by_id[h.id] for h in hits], abs=tol)
    assert got == pytest.approx(sorted(by_id.values(), reverse=True)[:len(hits)], abs=tol)
