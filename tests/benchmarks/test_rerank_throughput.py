"""The FLOP count behind the reranking-throughput benchmark's GFLOP/s, on a worked example, and its profile's matmul share."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import torch  # noqa: E402
from rerank_throughput import pair_flops, profile_ours  # noqa: E402

from twotower.encoder.core.config import EncoderConfig  # noqa: E402
from twotower.encoder.core.model import BertModel  # noqa: E402


def _bert() -> BertModel:
    return BertModel(EncoderConfig(vocab_size=30, hidden_size=2, num_hidden_layers=2, num_attention_heads=1,
                                   intermediate_size=4, max_position_embeddings=8))


def test_pair_flops_counts_every_layer_at_every_token_by_hand():
    # H=2, I=4, T=3. Per layer: 2 FLOPs x T x (QKVO 4*H*H + FFN 2*H*I = 32 weights) plus QK^T and AV
    # 2 x 2*T*T*H = 72: 2*3*32 + 72 = 264; two layers 528.
    assert pair_flops(_bert(), np.array([3]), cls_only_last=False) == pytest.approx(528)


def test_pair_flops_with_the_last_layer_at_cls_keeps_k_and_v_at_every_token():
    # Last layer: K and V at 3 tokens 2*3*(2*H*H) = 48; Q, O and FFN at [CLS] 2*(2*H*H + 2*H*I) = 48;
    # attention of one query over 3 keys 2*2*3*H = 24. 264 + 120 = 384.
    assert pair_flops(_bert(), np.array([3]), cls_only_last=True) == pytest.approx(384)
    # A one-token pair is [CLS] alone: nothing to skip.
    one = np.array([1])
    assert pair_flops(_bert(), one, cls_only_last=True) == pytest.approx(pair_flops(_bert(), one, cls_only_last=False))


def test_pair_flops_sums_over_pairs():
    bert, lengths = _bert(), np.array([3, 5, 2])
    each = sum(pair_flops(bert, np.array([t]), cls_only_last=True) for t in lengths)
    assert pair_flops(bert, lengths, cls_only_last=True) == pytest.approx(each)


def test_profile_share_is_the_matrix_products_time():
    """The ceiling `only_matmuls_pairs_per_s` divides by this share: a pass of matmuls alone is ~1, of softmax ~0."""
    a = torch.randn(192, 192)
    assert profile_ours(lambda: [torch.mm(a, a) for _ in range(30)]) > 0.9
    assert profile_ours(lambda: [torch.bmm(a[None], a[None]) for _ in range(30)]) > 0.9
    assert profile_ours(lambda: [torch.softmax(a, -1) for _ in range(30)]) < 0.05
