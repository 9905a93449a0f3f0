"""Tiny models and data shared by the training / reranker tests (built once per session, cached on disk).

Odd dimensions (hidden 32, ffn 37, 3 layers) so that shape bugs surface, as BERT's own tests do.
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


@functools.cache
def tiny_model_dir(initializer_range: float = 0.02) -> str:
    """A random 3-layer BERT (hidden 32) with a fixed ~130-token WordPiece vocabulary, saved in HF layout.

    BERT's init (std 0.02) gives a [CLS] that barely depends on the input, so a fresh
    relevance head scores every pair alike; reranker tests use a wider init (0.2).
    The vocabulary is written, not trained: `tokenizers`' WordPiece trainer breaks frequency ties
    in hash-map order, so a trained one differs from process to process (huggingface/tokenizers#1794)
    and so did every score of a model built on it.
    """
    from twotower.encoder import EncoderConfig, Tokenizer, save_encoder
    from twotower.encoder.core.model import BertModel
    from twotower.encoder.core.tokenizer import SPECIAL_TOKENS

    root = tempfile.mkdtemp(prefix="twotower-tiny-")
    chars = "abcdefghijklmnopqrstuvwxyz0123456789"
    vocab = [*SPECIAL_TOKENS, *".,;:!?'\"()-", *chars, *(f"##{c}" for c in chars), *sorted(set(WORDS))]
    vocab_path = os.path.join(root, "vocab.txt")
    with open(vocab_path, "w", encoding="utf-8") as f:
        f.write("\n".join(vocab) + "\n")
    tok = Tokenizer.from_vocab(vocab_path)
    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=3,
                           num_attention_heads=2, intermediate_size=37, max_position_embeddings=64,
                           initializer_range=initializer_range)
    model = BertModel(config)
    directory = os.path.join(root, f"tiny-bert-{initializer_range}")
    save_encoder(model, tok, directory)
    return directory


@functools.cache
def tiny_beir_dir(n_docs: int = 60, n_queries: int = 24, seed: int = 0) -> str:
    """A BEIR-layout toy dataset where each query shares words with its positive document."""
    rng = random.Random(seed)
    root = tempfile.mkdtemp(prefix="twotower-beir-")
    docs = {f"d{i}": " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))) for i in range(n_docs)}
    with open(os.path.join(root, "corpus.jsonl"), "w") as f:
        for did, text in docs.items():
            f.write(json.dumps({"_id": did, "title": "", "text": text}) + "\n")
    os.makedirs(os.path.join(root, "qrels"))
    with open(os.path.join(root, "queries.jsonl"), "w") as fq, \
            open(os.path.join(root, "qrels", "train.tsv"), "w") as fr:
        fr.write("query-id\tcorpus-id\tscore\n")
        for i in range(n_queries):
            pos = f"d{i}"
            words = docs[pos].split()
            fq.write(json.dumps({"_id": f"q{i}", "text": " ".join(rng.sample(words, min(4, len(words))))}) + "\n")
            fr.write(f"q{i}\t{pos}\t1\n")
    return root


def interrupted_at(step: int):
    """A `TrainingLoop._step` that stops the process before optimizer step `step`, as Ctrl-C would (set it with
    monkeypatch): what a resume continues from."""
    from twotower.retrieval.training import loop

    real = loop.TrainingLoop._step

    def _step(self, bar):
        if self.steps == step - 1:
            raise KeyboardInterrupt
        return real(self, bar)

    return _step
