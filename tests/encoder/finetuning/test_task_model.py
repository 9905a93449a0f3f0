"""How `TaskModel.predict` batches: by token budget unless a batch size is given, with the same predictions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from twotower.encoder.core import encode
from twotower.encoder.finetuning import task_model
from twotower.encoder.finetuning.task_examples import QAExample, TextExample
from twotower.encoder.finetuning.task_model import TaskModel, batch_order, prediction_batches
from twotower.encoder.finetuning.tasks import TaskInfo

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py

CPU = torch.device("cpu")


def test_prediction_batches_fill_the_token_budget_longest_first(monkeypatch):
    """Without a batch size: every row once, longest first, each forward within the budget (or one row that
    alone exceeds it), and no forward that could have taken the next row."""
    monkeypatch.setattr(encode, "CPU_BATCH_TOKENS", 300)
    lengths = np.random.default_rng(0).integers(3, 400, size=97)
    batches = prediction_batches(lengths, None, CPU)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(97))
    assert (np.diff(lengths[flat]) <= 0).all()  # longest first
    for i, b in enumerate(batches):
        padded = len(b) * lengths[b].max()
        assert padded <= 300 or len(b) == 1
        if i + 1 < len(batches):
            assert (len(b) + 1) * lengths[b].max() > 300  # the next row would not have fitted
    assert any(len(b) > 1 for b in batches) and any(lengths[b].max() > 300 for b in batches)
    # a batch size keeps the fixed count (shortest first, as before)
    fixed = prediction_batches(lengths, 16, CPU)
    assert [b.tolist() for b in fixed] == [b.tolist() for b in batch_order(lengths, 16)]


def _count_forwards(monkeypatch, model: torch.nn.Module) -> list[tuple[int, int]]:
    """(rows, padded length) of each forward of `model` from here on."""
    shapes: list[tuple[int, int]] = []
    forward = model.forward

    def counted(input_ids, **kw):
        shapes.append(tuple(input_ids.shape))
        return forward(input_ids, **kw)

    monkeypatch.setattr(model, "forward", counted)
    return shapes


def test_classify_predicts_alike_by_budget_and_by_count(tiny_dir, monkeypatch):
    """`predict`'s default batches by the token budget (long inputs made 200 MB activations in batches of 64,
    faulted in afresh each forward: docs/results.md); the predictions are those of a fixed count."""
    monkeypatch.setattr(encode, "CPU_BATCH_TOKENS", 64)
    tm = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["a", "b", "c"], max_length=40))
    words = "the tea was hot and the film was long but good".split()
    examples = [TextExample(" ".join(words[: 1 + (7 * i) % len(words)] * (1 + i % 3))) for i in range(23)]
    shapes = _count_forwards(monkeypatch, tm.model)
    by_budget = tm.predict(examples)
    assert len(shapes) > 1 and all(b * t <= 64 or b == 1 for b, t in shapes)
    assert sum(b for b, _ in shapes) == len(examples)
    shapes.clear()
    by_count = tm.predict(examples, batch_size=64)
    assert shapes[0][0] == len(examples)
    for x, y in zip(by_budget, by_count):
        assert x.label == y.label and x.probs == pytest.approx(y.probs, abs=1e-6)


def test_qa_reads_alike_by_budget_and_by_count(tiny_dir, monkeypatch):
    """The reader's windows (several per long context) are batched by budget too; spans and scores unchanged."""
    monkeypatch.setattr(encode, "CPU_BATCH_TOKENS", 96)
    tm = TaskModel.from_encoder(tiny_dir, TaskInfo("qa", max_length=32, doc_stride=8, max_query_length=8))
    context = " ".join(f"word{i} is here" for i in range(30))
    examples = [QAExample(str(i), f"where is word{i}", context[: 40 + 25 * i]) for i in range(6)]
    shapes = _count_forwards(monkeypatch, tm.model)
    by_budget = tm.predict(examples)
    assert len(shapes) > 1 and all(b * t <= 96 or b == 1 for b, t in shapes)
    by_count = tm.predict(examples, batch_size=16)
    for x, y in zip(by_budget, by_count):
        assert (x.text, x.start, x.no_answer) == (y.text, y.start, y.no_answer)
        assert x.score == pytest.approx(y.score, abs=1e-5)


def test_prediction_keeps_and_trims_the_heap(tiny_dir, monkeypatch):
    """As encoding and reranking do: the malloc thresholds fixed before the forwards, the heap's free pages
    offered back after them (common/malloc.py), also when a forward fails, with the model's mode restored."""
    calls = []
    monkeypatch.setattr(task_model, "steady_thresholds_for", lambda device: calls.append(("steady", device.type)))
    monkeypatch.setattr(task_model, "trim_free_heap_for", lambda device: calls.append(("trim", device.type)))
    tm = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["a", "b"], max_length=16))
    tm.predict([TextExample("a short text"), TextExample("another")], batch_size=1)
    assert calls == [("steady", "cpu"), ("trim", "cpu")]
    calls.clear()
    tm.model.train()
    monkeypatch.setattr(tm.model, "forward", lambda **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        tm.predict([TextExample("a short text")])
    assert calls == [("steady", "cpu"), ("trim", "cpu")] and tm.model.training


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bad_batch_size_is_refused(tiny_dir, bad):
    """0 failed inside range(), and -1 made no batch at all, so every output was None and decoding crashed."""
    tm = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["a", "b"], max_length=16))
    with pytest.raises(ValueError, match="batch_size must be >= 1 or None"):
        tm.predict([TextExample("a short text")], batch_size=bad)
