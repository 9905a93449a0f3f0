"""twotower.encoder.core.dropout: the drop rate, unbiasedness, gradients and reproducibility of the cheap CPU mask."""

from __future__ import annotations

import pytest
import torch

from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.dropout import Dropout, drop_threshold, dropout, keep_mask
from twotower.encoder.core.model import BertModel


def test_mask_rate_and_scale_match_p():
    torch.manual_seed(0)
    for p in (0.1, 0.25, 0.5):
        m = keep_mask((1000, 1000), p, torch.float32)
        kept = m != 0
        rounded = drop_threshold(p) / 65536
        assert abs(rounded - p) <= 2 ** -17
        assert abs(1 - kept.float().mean().item() - rounded) < 0.002  # 1M draws: std 3e-4
        scale = 1 / (1 - rounded)
        assert torch.all(m[kept] == torch.tensor(scale, dtype=torch.float32))
        assert abs(m.mean().item() - 1.0) < 0.003  # unbiased: E[mask] = 1


def test_every_lane_of_a_word_is_used():
    # four 16-bit lanes per 64-bit draw: each lane position must drop at rate p (a biased top bit would not)
    torch.manual_seed(1)
    m = keep_mask((400_000, 4), 0.1, torch.float32)
    rates = (m == 0).float().mean(0)
    assert torch.all((rates - 0.1).abs() < 0.003), rates


def test_forward_backward_and_identity_cases():
    torch.manual_seed(2)
    x = torch.randn(64, 33, requires_grad=True)
    y = dropout(x, 0.3, True)
    y.sum().backward()
    ratio = torch.where(x.detach() != 0, y.detach() / x.detach(), torch.zeros_like(x))
    torch.testing.assert_close(x.grad, ratio)  # d y / d x is exactly the applied mask
    assert dropout(x, 0.3, False) is x and dropout(x, 0.0, True) is x
    with pytest.raises(ValueError, match="dropout probability"):
        dropout(x, 1.0, True)
    for dt in (torch.bfloat16, torch.float32):
        assert dropout(torch.ones(5, 7, dtype=dt), 0.5, True).dtype == dt


def test_reproducible_from_the_seed_and_module_has_no_state():
    torch.manual_seed(3)
    a = dropout(torch.ones(1000), 0.1, True)
    torch.manual_seed(3)
    b = dropout(torch.ones(1000), 0.1, True)
    assert torch.equal(a, b)
    d = Dropout(0.1)
    assert d.state_dict() == {} and "p=0.1" in repr(d)
    # found and switched off like any nn.Dropout
    assert isinstance(d, torch.nn.Dropout)
    d.p = 0.0
    x = torch.randn(3, 4)
    assert torch.equal(d(x), x)
    d.p = 0.1
    d.eval()
    x = torch.randn(3, 4)
    assert torch.equal(d(x), x)


def test_model_dropout_rate_in_training():
    # hidden dropout of the embeddings: a training-mode forward drops ~p of the embedding outputs
    cfg = EncoderConfig(vocab_size=50, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, hidden_dropout_prob=0.2)
    m = BertModel(cfg, add_pooling_layer=False).train()
    ids = torch.randint(1, 50, (16, 32))
    pos = torch.arange(32).expand(16, 32)
    torch.manual_seed(4)
    e = m.embeddings(ids, torch.zeros_like(ids), pos)
    assert abs((e == 0).float().mean().item() - 0.2) < 0.02
