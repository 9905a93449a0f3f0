"""Shared helpers of the pretraining tests: a synthetic corpus and a tiny WordPiece tokenizer trained on it."""

from __future__ import annotations

import os
import random

import pytest

from twotower.encoder.core.tokenizer import Tokenizer


def synthetic_text(n_docs: int = 12, paras: int = 6, seed: int = 0) -> str:
    """Zipf-distributed pseudo-words (so WordPiece splits the rarer ones), paragraphs, blank-line documents."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(400)]
    weights = [1.0 / (i + 1) for i in range(len(words))]
    docs = []
    for _ in range(n_docs):
        lines = []
        for _ in range(paras):
            sent = rng.choices(words, weights, k=rng.randint(15, 60))
            lines.append(" ".join(sent) + ".")
        docs.append("\n".join(lines))
    return "\n\n".join(docs) + "\n"


def write_corpus(directory: str, name: str = "corpus.txt", **kw) -> str:
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(synthetic_text(**kw))
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer.train(iterator=synthetic_text(n_docs=30).splitlines(), vocab_size=300, progress=False)
    tok.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_tokenizer_dir)
