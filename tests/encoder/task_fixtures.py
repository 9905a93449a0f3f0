"""A tiny random BERT and tokenizer for the head / fine-tuning / QA tests, built once per test session.

Deliberately odd dimensions (hidden 30, 3 heads, ffn 37, 2 layers) so shape
bugs surface, as in BERT's own modeling_test.py.  Plain functions rather than
fixtures, so that each test module wraps them in its own small fixture.
"""

from __future__ import annotations

import contextlib
import os

import torch

from twotower.encoder import EncoderConfig, Tokenizer
from twotower.encoder.core.checkpoint import save_encoder
from twotower.encoder.core.model import BertModel

CORPUS = [
    "the tea is cold", "the tea is hot", "a good film with a great cast", "a bad film and a boring plot",
    "paris is the capital of france", "berlin is the capital of germany", "who wrote the book",
    "what is the capital of france", "when was the tower built", "the tower was built in 1889",
    "john smith lives in new york", "mary works at google in london", "apple released a new phone",
    "the river flows north through the valley", "how many people live in the city",
    "@user loves #music and emojis", "i love this movie", "i hate this movie", "great acting", "terrible",
    "the quick brown fox jumps over the lazy dog", "unbelievable performance by the whole team",
]

_CACHE: dict[str, str] = {}


# Words left out of the vocabulary, so that they are split into pieces ("##" continuations).
SPLIT_WORDS = {"unbelievable", "performance", "flows", "paulwalk", "emojis", "capital", "france", "1889"}


def tiny_vocab() -> list[str]:
    """A fixed WordPiece vocabulary (trained vocabularies may order tied merges differently per run,
    which would make test outcomes depend on the process): specials, every character alone and as a
    "##" continuation, two pieces for the split words, and every other corpus word whole."""
    words = sorted({w for line in CORPUS for w in __import__("re").findall(r"\w+|[^\w\s]", line)})
    chars = sorted({c for w in words for c in w})
    pieces = sorted({p for w in SPLIT_WORDS for p in (w[:3], "##" + w[3:6], "##" + w[6:]) if p != "##"})
    whole = [w for w in words if w not in SPLIT_WORDS]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *("##" + c for c in chars), *pieces, *whole]
    return list(dict.fromkeys(vocab))


def build_tiny_encoder(directory: str) -> str:
    torch.manual_seed(0)
    os.makedirs(directory, exist_ok=True)
    vocab_path = os.path.join(directory, "vocab.txt")
    with open(vocab_path, "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in tiny_vocab()))
    tok = Tokenizer.from_vocab(vocab_path)
    config = EncoderConfig(vocab_size=tok.vocab_size, hidden_size=30, num_hidden_layers=2, num_attention_heads=3,
                           intermediate_size=37, max_position_embeddings=96, hidden_dropout_prob=0.1,
                           attention_probs_dropout_prob=0.1, initializer_range=0.2)
    save_encoder(BertModel(config, add_pooling_layer=True), tok, directory)
    return directory


def tiny_encoder(tmp_path_factory) -> str:
    """Directory of a saved tiny random encoder (with pooler) and its WordPiece tokenizer, built once a session.

    Tests take it as the ``tiny_dir`` fixture of tests/conftest.py.
    """
    if "dir" not in _CACHE or not os.path.isdir(_CACHE["dir"]):
        _CACHE["dir"] = build_tiny_encoder(str(tmp_path_factory.mktemp("tiny_encoder")))
    return _CACHE["dir"]


@contextlib.contextmanager
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads spin against other processes and make
    tiny-model steps 10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def interrupted_at(step: int):
    """A `set_lr` for `twotower.encoder.finetuning.finetune` (set it with monkeypatch) that stops the process
    before the run's optimizer step `step`, counted over all its seeds, as Ctrl-C would: what a resume
    continues from."""
    from twotower.encoder.training.optim import set_lr

    calls = [0]

    def _set_lr(*args, **kwargs):
        calls[0] += 1
        if calls[0] == step:
            raise KeyboardInterrupt
        return set_lr(*args, **kwargs)

    return _set_lr
