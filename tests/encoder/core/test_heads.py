"""Heads: the worked example of docs/architecture.md ("Heads"), losses, and parity with the transformers classes both ways."""

from __future__ import annotations

import json
import os

import pytest
import torch

from twotower.encoder.core.heads import (
    ARCHITECTURES,
    HEAD_TYPES,
    build_head,
    classification_loss,
    qa_loss,
    tagging_loss,
)
from twotower.encoder.core.tokenizer import Tokenizer
from twotower.encoder.finetuning.task_model import TaskModel
from twotower.encoder.finetuning.tasks import TaskInfo

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py


def test_classification_worked_example():
    logits = torch.tensor([[1.0, 3.0]])
    assert torch.softmax(logits, -1)[0, 1].item() == pytest.approx(0.880797, abs=1e-6)
    assert classification_loss(logits, torch.tensor([1])).item() == pytest.approx(0.126928, abs=1e-6)


def test_tagging_loss_counts_only_labelled_subtokens():
    logits = torch.randn(2, 5, 3)
    labels = torch.tensor([[-100, 2, -100, 0, -100], [-100, 1, -100, -100, -100]])
    picked = torch.stack([logits[0, 1], logits[0, 3], logits[1, 1]])
    expected = torch.nn.functional.cross_entropy(picked, torch.tensor([2, 0, 1]))
    assert tagging_loss(logits, labels).item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match="no labelled token"):
        tagging_loss(logits, torch.full((2, 5), -100))


def test_qa_loss_ignores_padding_positions():
    logits = torch.randn(1, 6, 2)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    a = qa_loss(logits, torch.tensor([1]), torch.tensor([2]), mask)
    changed = logits.clone()
    changed[0, 4:] = 50.0  # huge scores on padding must not matter
    b = qa_loss(changed, torch.tensor([1]), torch.tensor([2]), mask)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)
    s, e = logits[0, :4, 0], logits[0, :4, 1]
    ref = (-torch.log_softmax(s, 0)[1] - torch.log_softmax(e, 0)[2]) / 2
    assert a.item() == pytest.approx(ref.item(), rel=1e-5)


def test_build_head_rejects_bad_arguments(tiny_dir):
    from twotower.encoder.finetuning.task_model import read_config

    config, _, _ = read_config(tiny_dir)
    with pytest.raises(ValueError, match="unknown head"):
        build_head("summarize", config, 2)
    with pytest.raises(ValueError, match="num_labels must be 2"):
        build_head("qa", config, 3)


def _batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (13, 7), generator=g)
    mask = torch.ones(13, 7, dtype=torch.long)
    mask[3, 4:] = 0
    mask[7, 2:] = 0
    types = torch.zeros(13, 7, dtype=torch.long)
    types[:, 4:] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, types


def _theirs(hf_model, head: str, ids, mask, types) -> torch.Tensor:
    out = hf_model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    if head == "qa":
        return torch.stack([out.start_logits, out.end_logits], -1)
    return out.logits


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("head", HEAD_TYPES)
def test_our_saved_dir_loads_in_transformers_with_equal_outputs(tiny_dir, tmp_path, head):
    labels = [] if head == "qa" else ["neg", "neutral", "pos"]
    tm = TaskModel.from_encoder(tiny_dir, TaskInfo(head, labels, max_length=40), seed=1)
    _randomize(tm.model, 7)  # non-zero biases everywhere, so a dropped tensor would show
    out = str(tmp_path / "model")
    tm.save(out)
    hf = getattr(transformers, ARCHITECTURES[head]).from_pretrained(out).eval()
    if head != "qa":
        assert hf.config.id2label == {0: "neg", 1: "neutral", 2: "pos"}
    assert hf.config.num_labels == (2 if head == "qa" else 3)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == [ARCHITECTURES[head]] and cfg["twotower_task"]["max_length"] == 40
    ids, mask, types = _batch(tm.tokenizer.vocab_size)
    with torch.no_grad():
        ours = tm.model.eval()(ids, mask, types)
        theirs = _theirs(hf, head, ids, mask, types)
    assert ours.shape == theirs.shape
    if head == "classify":
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    else:  # padding positions compute anything; compare real tokens only
        real = mask.bool()
        torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head", HEAD_TYPES)
def test_transformers_checkpoint_loads_here_with_equal_outputs(tiny_dir, tmp_path, head):
    tok = Tokenizer.from_pretrained(tiny_dir)
    cfg = transformers.BertConfig(vocab_size=tok.vocab_size, hidden_size=30, num_hidden_layers=2,
                                  num_attention_heads=3, intermediate_size=37, max_position_embeddings=64,
                                  num_labels=2 if head == "qa" else 5)
    torch.manual_seed(0)
    hf = getattr(transformers, ARCHITECTURES[head])(cfg).eval()
    _randomize(hf, 11)
    out = str(tmp_path / "hf")
    hf.save_pretrained(out)
    tok.save_pretrained(out)
    tm = TaskModel.from_pretrained(out)
    assert tm.info.head == head
    if head != "qa":
        assert tm.info.labels == [f"LABEL_{i}" for i in range(5)]
    ids, mask, types = _batch(tok.vocab_size, seed=1)
    with torch.no_grad():
        ours = tm.model(ids, mask, types)
        theirs = _theirs(hf, head, ids, mask, types)
    real = mask.bool() if head != "classify" else slice(None)
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)


def test_frozen_split_equals_forward(tiny_dir):
    """head(encode(x)) is forward(x): what makes cached features valid."""
    for head in HEAD_TYPES:
        labels = [] if head == "qa" else ["a", "b"]
        m = TaskModel.from_encoder(tiny_dir, TaskInfo(head, labels)).model.eval()
        ids, mask, types = _batch(50)
        with torch.no_grad():
            torch.testing.assert_close(m(ids, mask, types), m.head(m.encode(ids, mask, types)))


def test_reset_head_is_seeded(tiny_dir):
    m = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["a", "b"])).model
    m.reset_head(5)
    w5 = m.classifier.weight.clone()
    m.reset_head(6)
    assert not torch.equal(w5, m.classifier.weight)
    m.reset_head(5)
    assert torch.equal(w5, m.classifier.weight)
    assert m.classifier.weight.std().item() == pytest.approx(m.config.initializer_range, rel=0.5)


@pytest.mark.parametrize("head", HEAD_TYPES)
def test_reset_head_draws_with_its_cpu_generator_off_the_cpu(tiny_dir, monkeypatch, head):
    """reset_head on a model that is not on the CPU (fine-tuning resets the head after moving it to the GPU):
    CUDA's ops refuse a CPU generator, so none may be handed to an op on a tensor elsewhere. The meta device
    stands in for CUDA, with that check added; on the CPU the seed gives the same weights as a direct draw."""
    labels = [] if head == "qa" else ["a", "b"]
    m = TaskModel.from_encoder(tiny_dir, TaskInfo(head, labels)).model
    linear = m.qa_outputs if head == "qa" else m.classifier
    m.reset_head(5)
    g = torch.Generator().manual_seed(5)
    expected = torch.empty_like(linear.weight).normal_(0.0, m.config.initializer_range, generator=g)
    assert torch.equal(linear.weight, expected)  # the CPU values are those of a draw in place

    normal = torch.Tensor.normal_

    def checked(t, *args, generator=None, **kwargs):
        if generator is not None and generator.device.type != t.device.type:
            raise RuntimeError(f"a {generator.device} generator for a {t.device} tensor")
        return normal(t, *args, generator=generator, **kwargs)

    monkeypatch.setattr(torch.Tensor, "normal_", checked)
    m.to("meta").reset_head(5)


def test_mean_pooled_classifier_reads_the_average_of_real_tokens(tiny_dir):
    """logits = W · mean(h over real tokens) + b; padding (any amount) changes nothing; no pooler is built."""
    m = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["a", "b", "c"]), pooling="mean", seed=2).model.eval()
    assert m.pooling == "mean" and m.bert.pooler is None
    ids, mask, types = _batch(50)
    with torch.no_grad():
        hidden, _ = m.bert(ids, attention_mask=mask, token_type_ids=types, return_pooled=False)  # (B, T, H)
        rows = [hidden[i, mask[i].bool()].mean(0) for i in range(len(ids))]  # real tokens of each row
        expected = torch.stack(rows) @ m.classifier.weight.T + m.classifier.bias
        logits = m(ids, mask, types)
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
        # row 3 alone, unpadded, gives the same logits as inside the padded batch
        n = int(mask[3].sum())
        alone = m(ids[3:4, :n], mask[3:4, :n], types[3:4, :n])
        torch.testing.assert_close(alone[0], logits[3], atol=1e-5, rtol=1e-5)
        # no mask: every position counts
        torch.testing.assert_close(m(ids, None, types), m.head(m.bert(ids, None, types, return_pooled=False)[0]
                                                                .mean(1)), atol=1e-5, rtol=1e-5)


def test_mean_pooling_round_trips_through_the_checkpoint(tiny_dir, tmp_path):
    tm = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["neg", "pos"]), pooling="mean", seed=1)
    _randomize(tm.model, 3)
    out = str(tmp_path / "mean")
    tm.save(out)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["classifier_pooling"] == "mean"
    back = TaskModel.from_pretrained(out)
    assert back.model.pooling == "mean"
    ids, mask, types = _batch(tm.tokenizer.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(back.model(ids, mask, types), tm.model.eval()(ids, mask, types))
    # a new head on that checkpoint is a [CLS] head unless asked: the old head's pooling does not leak
    assert TaskModel.from_encoder(out, TaskInfo("classify", ["x", "y"])).model.pooling == "cls"
    assert TaskModel.from_encoder(out, TaskInfo("classify", ["x", "y"]), pooling="mean").model.pooling == "mean"
    # the default head writes no pooling key (its config stays what transformers writes)
    cls_dir = str(tmp_path / "cls")
    TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["neg", "pos"])).save(cls_dir)
    with open(os.path.join(cls_dir, "config.json")) as f:
        assert "classifier_pooling" not in json.load(f)


def test_pooling_option_is_checked(tiny_dir):
    from twotower.encoder.finetuning.task_model import read_config

    config, _, _ = read_config(tiny_dir)
    with pytest.raises(ValueError, match="classifier pooling must be one of"):
        build_head("classify", config, 2, pooling="max")
    with pytest.raises(ValueError, match="classification head only"):
        build_head("tag", config, 3, pooling="mean")


@pytest.mark.parametrize("padded", [True, False])
def test_cls_classifier_inference_runs_the_last_layer_at_cls_only_with_the_same_logits(tiny_dir, padded, monkeypatch):
    """Inference (eval, no grad) asks the encoder for the [CLS] state alone; the logits equal the whole last
    layer's (an eval forward with grad runs it whole), padded batches (the unpadded path) included."""
    m = TaskModel.from_encoder(tiny_dir, TaskInfo("classify", ["a", "b", "c"]), seed=2).model.eval()
    _randomize(m, 5)
    ids, mask, types = _batch(50)
    if not padded:
        mask = torch.ones_like(mask)
    asked = []
    forward = type(m.bert).forward

    def spy(self, *a, **kw):
        asked.append(kw.get("query_positions"))
        return forward(self, *a, **kw)

    monkeypatch.setattr(type(m.bert), "forward", spy)
    whole = m(ids, mask, types).detach()  # grad enabled: the whole last layer
    with torch.no_grad():
        cls = m(ids, mask, types)
    assert asked[0] is None and torch.equal(asked[1], torch.zeros(13, 1, dtype=torch.long))
    torch.testing.assert_close(cls, whole, atol=1e-5, rtol=1e-5)
