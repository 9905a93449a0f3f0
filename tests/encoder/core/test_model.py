"""BertModel against transformers.BertModel (the reference), plus shape, mask and packing properties.

Odd tiny dimensions (batch 13, length 7, vocabulary 99, hidden 32, 4 heads,
ffn 37) so that a transposed or mis-split axis cannot hide behind equal sizes.
"""

from __future__ import annotations

import pytest
import torch

from twotower.encoder.core.config import EncoderConfig
from twotower.encoder.core.model import (
    BertModel,
    Unpadding,
    build_attention_mask,
    packed_position_ids,
    worth_unpadding,
)

B, T, V, H, NH, FFN = 13, 7, 99, 32, 4, 37


def _config(**kw) -> EncoderConfig:
    base = dict(vocab_size=V, hidden_size=H, num_hidden_layers=3, num_attention_heads=NH, intermediate_size=FFN,
                max_position_embeddings=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return EncoderConfig(**{**base, **kw})


def _padded_pair_batch(generator: torch.Generator):
    """13 rows of different lengths; odd rows are pairs with segment 1 after the first [SEP]."""
    ids = torch.randint(5, V, (B, T), generator=generator)
    lengths = torch.tensor([7, 1, 3, 7, 5, 2, 6, 4, 7, 3, 5, 6, 2])
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()  # (B, T)
    types = torch.zeros_like(ids)
    for i in range(1, B, 2):
        first_sep = max(1, int(lengths[i]) // 2)
        types[i, first_sep + 1:lengths[i]] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, types


@pytest.fixture(scope="module")
def reference_pair():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    hf_cfg = transformers.BertConfig(**{k: v for k, v in _config().to_dict().items()
                                        if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "eager"  # independent math: explicit softmax, not SDPA
    ref = transformers.BertModel(hf_cfg).eval()
    # Make LayerNorm and biases non-trivial so a skipped bias or affine would show.
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ours = BertModel(EncoderConfig.from_dict(hf_cfg.to_dict())).eval()
    state = {k: v for k, v in ref.state_dict().items() if k != "embeddings.position_ids"}
    assert set(state) == set(ours.state_dict()), "parameter names differ from HF BertModel"
    ours.load_state_dict(state)
    return ref, ours


def test_parity_with_transformers_on_padded_pairs(reference_pair):
    ref, ours = reference_pair
    g = torch.Generator().manual_seed(0)
    ids, mask, types = _padded_pair_batch(g)
    with torch.no_grad():
        expected = ref(input_ids=ids, attention_mask=mask, token_type_ids=types)
        hidden, pooled = ours(ids, mask, types)
    real = mask.bool()
    assert hidden.shape == (B, T, H) and pooled.shape == (B, H)
    torch.testing.assert_close(hidden[real], expected.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled, expected.pooler_output, atol=1e-5, rtol=1e-5)
    # Segment ids matter: flipping them must change the output (the test would catch ignoring them).
    with torch.no_grad():
        flipped, _ = ours(ids, mask, 1 - types)
    assert not torch.allclose(flipped[real], hidden[real], atol=1e-3)


def test_padding_does_not_change_real_positions(reference_pair):
    _, ours = reference_pair
    g = torch.Generator().manual_seed(3)
    ids, mask, types = _padded_pair_batch(g)
    with torch.no_grad():
        batched, _ = ours(ids, mask, types)
        for i in (1, 2, 5, 9):
            n = int(mask[i].sum())
            alone, _ = ours(ids[i:i + 1, :n], mask[i:i + 1, :n], types[i:i + 1, :n])
            torch.testing.assert_close(batched[i, :n], alone[0], atol=1e-5, rtol=1e-5)
        # Changing padding ids leaves real positions untouched (padding keys are excluded).
        noisy = ids.masked_fill(mask == 0, 42)
        again, _ = ours(noisy, mask, types)
    torch.testing.assert_close(again[mask.bool()], batched[mask.bool()], atol=1e-6, rtol=1e-6)


def test_packed_row_equals_each_sample_alone(reference_pair):
    _, ours = reference_pair
    g = torch.Generator().manual_seed(4)
    a = torch.randint(5, V, (1, 5), generator=g)
    b = torch.randint(5, V, (1, 4), generator=g)
    packed = torch.cat([a, b, torch.zeros(1, 2, dtype=torch.long)], dim=1)  # (1, 11): A, B, 2 padding
    doc = torch.tensor([[0] * 5 + [1] * 4 + [2] * 2])
    mask = torch.tensor([[1] * 9 + [0] * 2])
    with torch.no_grad():
        row, _ = ours(packed, mask, document_ids=doc, return_pooled=False)
        alone_a, _ = ours(a, return_pooled=False)
        alone_b, _ = ours(b, return_pooled=False)
        without_isolation, _ = ours(packed, mask, return_pooled=False)
    assert torch.isfinite(row).all()
    torch.testing.assert_close(row[0, :5], alone_a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(row[0, 5:9], alone_b[0], atol=1e-5, rtol=1e-5)
    # Without the block-diagonal mask B attends to A: the property is not trivially true.
    assert not torch.allclose(without_isolation[0, 5:9], alone_b[0], atol=1e-3)


def test_packed_position_ids_restart_per_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    assert packed_position_ids(doc).tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]


def test_attention_mask_shapes():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert build_attention_mask(torch.ones(2, 3, dtype=torch.long), None) is None  # fastest kernel path
    m = build_attention_mask(mask, None)
    assert m.shape == (2, 1, 1, 3) and m[0, 0, 0].tolist() == [True, True, False]
    doc = torch.tensor([[0, 1, 1], [0, 0, 1]])
    bd = build_attention_mask(mask, doc)
    assert bd.shape == (2, 1, 3, 3)
    # Keys: same document and not padding. The padding query (row 2) may see its document, never the others.
    assert bd[0, 0].tolist() == [[True, False, False], [False, True, False], [False, True, True]]
    assert bd[1, 0].tolist() == [[True, True, False], [True, True, False], [False, False, True]]


@pytest.mark.parametrize("kw", [{}, {"norm_first": True}, {"ffn_type": "geglu"}, {"use_bias": False}])
def test_shapes_with_odd_dims_and_options(kw):
    torch.manual_seed(0)
    model = BertModel(_config(**kw)).eval()
    ids = torch.randint(0, V, (B, T))
    hidden, pooled = model(ids)
    assert hidden.shape == (B, T, H) and pooled.shape == (B, H)
    assert torch.isfinite(hidden).all()
    no_pool = BertModel(_config(**kw), add_pooling_layer=False)
    h2, p2 = no_pool(ids)
    assert h2.shape == (B, T, H) and p2 is None
    _, p3 = model(ids, return_pooled=False)
    assert p3 is None


def test_too_long_sequence_is_a_clear_error():
    model = BertModel(_config())
    with pytest.raises(ValueError, match="exceeds max_position_embeddings=24"):
        model(torch.zeros(1, 25, dtype=torch.long))


def test_heads_must_divide_hidden():
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        _config(hidden_size=33, num_attention_heads=4)


def test_flops_per_token_counts_the_dense_layers():
    model = BertModel(_config())
    # Forward of a Linear costs 2 FLOPs per weight per token; attention adds 2*T*H per layer for QK^T and AV.
    linear_weights = sum(m.weight.numel() for n, m in model.encoder.named_modules() if isinstance(m, torch.nn.Linear))
    L = model.config.num_hidden_layers
    assert model.flops_per_token(10) == pytest.approx(2 * linear_weights + 2 * L * 2 * 10 * H)


def test_fused_qkv_gives_the_same_output_and_keeps_hf_names(reference_pair):
    _, ours = reference_pair
    import copy

    fused = copy.deepcopy(ours)
    for layer in fused.encoder.layer:
        layer.attention.self.fuse_qkv()
    assert list(fused.state_dict()) == list(ours.state_dict())
    ids, mask, types = _padded_pair_batch(torch.Generator().manual_seed(7))
    with torch.no_grad():
        want, _ = ours(ids, mask, types)
        got, _ = fused(ids, mask, types)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "block"])
def test_explicit_attention_equals_sdpa_forward_and_backward(mask_kind):
    """The CPU training path (three plain ops) computes what SDPA computes, gradients included."""
    import torch.nn.functional as F

    from twotower.encoder.core.model import explicit_attention

    g = torch.Generator().manual_seed(0)
    B, nh, T, hd = 3, 2, 7, 8
    q, k, v = (torch.randn(B, nh, T, hd, generator=g) for _ in range(3))
    real = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 6 + [0]])
    docs = torch.tensor([[0] * 3 + [1] * 4, [0] * 7, [0, 0, 1, 1, 2, 2, 2]])
    mask = {"none": None, "padding": build_attention_mask(real, None),
            "block": build_attention_mask(real, docs)}[mask_kind]
    a = [t.clone().requires_grad_(True) for t in (q, k, v)]
    b = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ya = explicit_attention(*a, mask, 0.0)
    yb = F.scaled_dot_product_attention(*b, attn_mask=mask)
    torch.testing.assert_close(ya, yb, atol=1e-5, rtol=1e-5)
    w = torch.randn(ya.shape, generator=g)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-5, rtol=1e-5)


def _attention_inputs(dtype=torch.float32):
    """5 rows of 9 positions: full, right-padded, a left-padded row (keys not a prefix), short, and a packed row."""
    g = torch.Generator().manual_seed(0)
    Bq, nh, Tk, hd = 5, 3, 9, 8
    q, k, v = (torch.randn(Bq, nh, Tk, hd, generator=g).to(dtype) for _ in range(3))
    real = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [0] * 2 + [1] * 7, [1] * 2 + [0] * 7, [1] * 8 + [0]])
    docs = torch.tensor([[0] * 9, [0] * 9, [0] * 9, [0] * 9, [0] * 3 + [1] * 5 + [2]])
    return (q, k, v), real, docs


@pytest.mark.parametrize("mask_kind", ["none", "padding", "block"])
@pytest.mark.parametrize("chunk_scores", [1, 300, 10**9])  # a row per chunk (smaller than one row), some, all
def test_chunked_attention_equals_sdpa_at_every_real_query(mask_kind, chunk_scores):
    """CPU inference attention (few rows at a time, cut to each chunk's last attendable key) is SDPA's at every
    query that has a real token; the query rows it drops as padding are 0, never stale memory."""
    import torch.nn.functional as F

    from twotower.encoder.core.model import chunked_attention

    (q, k, v), real, docs = _attention_inputs()
    mask = {"none": None, "padding": build_attention_mask(real, None),
            "block": build_attention_mask(real, docs)}[mask_kind]
    got = chunked_attention(q, k, v, mask, self_attention=True, chunk_scores=chunk_scores)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert got.shape == want.shape
    rows = torch.ones_like(real, dtype=torch.bool) if mask_kind == "none" else real.bool()
    torch.testing.assert_close(got.transpose(1, 2)[rows], want.transpose(1, 2)[rows], atol=1e-6, rtol=1e-5)
    assert torch.isfinite(got).all()
    if mask_kind == "padding" and chunk_scores == 1:  # a row a chunk: rows 1 and 3 are cut at their real length,
        # their trailing query rows are padding, left at 0 (in a chunk with a longer row they are computed)
        assert (got[1, :, 6:] == 0).all() and (got[3, :, 2:] == 0).all()
    # Queries at chosen positions (the last layer's [CLS]-only pass, MLM targets), as many as T and out of order:
    # not self-attention, so no query row is cut, even past a row's last real key.
    at = [8, 0, 4, 1, 2, 3, 5, 6, 7]
    qs = q[:, :, at]
    m = None if mask is None else mask[:, :, at] if mask.shape[2] > 1 else mask
    torch.testing.assert_close(chunked_attention(qs, k, v, m, chunk_scores=chunk_scores),
                               F.scaled_dot_product_attention(qs, k, v, attn_mask=m), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_attention_gives_0_where_a_query_has_no_key(dtype):
    """A query whose keys are all masked (a caller's own mask can make one) gets 0, as SDPA gives on CPU, not the
    NaN of a softmax over nothing; the other queries are unaffected."""
    import torch.nn.functional as F

    from twotower.encoder.core.model import chunked_attention

    (q, k, v), real, docs = _attention_inputs(dtype)
    mask = build_attention_mask(real, docs).clone()
    mask[1, 0, 2] = False  # row 1's query 2 may attend to nothing
    got = chunked_attention(q, k, v, mask, self_attention=True)
    assert torch.isfinite(got).all()
    assert (got[1, :, 2] == 0).all()
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    keep = torch.ones(5, 9, dtype=torch.bool)
    keep[1, 2] = False
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().transpose(1, 2)[keep], want.transpose(1, 2)[keep], atol=tol, rtol=tol)


def test_chunked_attention_in_bf16_is_as_close_to_fp32_as_sdpa_in_bf16():
    """bf16 scores and probabilities (transformers' eager precision) stay within a few bf16 steps of the fp32 result,
    on the order of SDPA's own bf16 error."""
    import torch.nn.functional as F

    from twotower.encoder.core.model import chunked_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 12, 64, 32, generator=g) for _ in range(3))
    real = (torch.arange(64)[None, :] < torch.tensor([64, 50, 33, 64])[:, None]).long()
    mask = build_attention_mask(real, None)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    low = [t.bfloat16() for t in (q, k, v)]
    ours = chunked_attention(*low, mask).float()
    sdpa = F.scaled_dot_product_attention(*low, attn_mask=mask).float()
    rows = real.bool()
    err = (ours - want).transpose(1, 2)[rows].abs().max().item()
    err_sdpa = (sdpa - want).transpose(1, 2)[rows].abs().max().item()
    assert err < 4e-2 and err < 6 * err_sdpa, (err, err_sdpa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_inference_runs_chunked_attention_and_matches_sdpa(reference_pair, dtype, monkeypatch):
    """The encoder's no-grad CPU forward goes through `chunked_attention` for the dtypes listed, and gives the SDPA
    forward's states at real positions, [CLS]-only last layer included."""
    from twotower.encoder.core import model as model_module

    _, ours = reference_pair
    ours = BertModel(ours.config).eval()
    ours.load_state_dict(reference_pair[1].state_dict())
    ours = ours.to(dtype)
    ids, mask, types = _padded_pair_batch(torch.Generator().manual_seed(5))
    pos = torch.stack([torch.zeros(len(ids), dtype=torch.long), mask.sum(1) - 1], 1)  # (B, 2)
    calls = []
    original = model_module.chunked_attention
    monkeypatch.setattr(model_module, "chunked_attention", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    monkeypatch.setattr(model_module, "CHUNKED_ATTENTION_DTYPES", {dtype})
    with torch.no_grad():
        got, got_pooled = ours(ids, mask, types)
        got_at, _ = ours(ids, mask, types, query_positions=pos)
    assert len(calls) == 2 * ours.config.num_hidden_layers
    monkeypatch.setattr(model_module, "CHUNKED_ATTENTION_DTYPES", set())
    with torch.no_grad():
        want, want_pooled = ours(ids, mask, types)
        want_at, _ = ours(ids, mask, types, query_positions=pos)
    assert len(calls) == 2 * ours.config.num_hidden_layers
    real = mask.bool()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[real], want[real], atol=tol, rtol=tol)
    torch.testing.assert_close(got_pooled, want_pooled, atol=tol, rtol=tol)
    torch.testing.assert_close(got_at, want_at, atol=tol, rtol=tol)


def test_training_path_equals_inference_path_without_dropout(reference_pair):
    """With grad enabled on CPU the layers use explicit attention; the output equals the no-grad (SDPA) one."""
    _, ours = reference_pair
    ids = torch.randint(5, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, 8:] = 0
    ours.eval()
    with torch.no_grad():
        ref, _ = ours(ids, attention_mask=am)
    out, _ = ours(ids, attention_mask=am)
    assert out.requires_grad
    real = am.bool()
    torch.testing.assert_close(out[real].detach(), ref[real], atol=1e-5, rtol=1e-5)


def test_training_mode_draws_the_same_dropout_with_and_without_grad():
    """GradCache replays a no-grad training-mode pass with grad: both must take the same path and masks."""
    m = BertModel(_config(hidden_dropout_prob=0.3, attention_probs_dropout_prob=0.3)).train()
    ids = torch.randint(5, V, (4, 9), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    with torch.no_grad():
        a, _ = m(ids)
    torch.manual_seed(7)
    b, _ = m(ids)
    torch.testing.assert_close(a, b.detach())


@pytest.mark.parametrize("kw", [{}, {"norm_first": True}, {"ffn_type": "geglu", "use_bias": False}])
@pytest.mark.parametrize("grad", [False, True])
def test_query_positions_equal_the_full_last_layer_at_those_positions(kw, grad):
    """The last layer at M chosen positions per row is the full computation gathered there: with padding,
    block-diagonal packing, repeated and out-of-order positions, on the SDPA (no grad) and explicit paths."""
    torch.manual_seed(3)
    model = BertModel(_config(**kw)).eval()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(5, V, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[2, 5:] = 0
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[:, 3:] = 1
    docs[2, 5:] = torch.tensor([2, 3])  # padding slots: their own documents, as PackedRows lays them
    pos = torch.randint(0, T, (B, 4), generator=g)
    pos[:, 0] = 0
    pos[0] = torch.tensor([0, 6, 6, 2])
    with torch.set_grad_enabled(grad):
        full, pooled_full = model(ids, am, document_ids=docs)
        part, pooled_part = model(ids, am, document_ids=docs, query_positions=pos)
    assert part.shape == (B, 4, H)
    want = full.gather(1, pos[..., None].expand(-1, -1, H))
    torch.testing.assert_close(part, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pooled_part, pooled_full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"query_positions\[:, 0\] == 0"):
        model(ids, am, query_positions=pos.roll(1, dims=1).clamp(min=1))


@pytest.mark.parametrize("kw", [{}, {"norm_first": True}, {"ffn_type": "geglu", "use_bias": False}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpadded_inference_equals_the_padded_forward(kw, dtype, monkeypatch):
    """An eval-mode, no-grad forward of a padded batch runs its layers on the packed real tokens; the states at real
    positions are those of the padded computation (the grad-enabled forward, which never packs)."""
    torch.manual_seed(11)
    model = BertModel(_config(**kw)).eval().to(dtype)
    ids, mask, types = _padded_pair_batch(torch.Generator().manual_seed(2))
    assert worth_unpadding(mask)
    packed_calls = []
    original = Unpadding.pack
    monkeypatch.setattr(Unpadding, "pack", lambda self, x: packed_calls.append(x.shape) or original(self, x))
    with torch.no_grad():
        fast, fast_pooled = model(ids, mask, types)
    assert packed_calls, "the no-grad forward did not take the unpadded path"
    n_calls = len(packed_calls)
    with torch.enable_grad():
        slow, slow_pooled = model(ids, mask, types)
    assert len(packed_calls) == n_calls, "a grad-enabled forward must keep the padded layout"
    with torch.no_grad():  # train mode (GradCache's no-grad first pass): padded, so dropout replays with grad
        model.train()(ids, mask, types)
    model.eval()
    assert len(packed_calls) == n_calls, "a training forward must keep the padded layout, even without grad"
    real = mask.bool()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast[real], slow[real].detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(fast_pooled, slow_pooled.detach(), atol=tol, rtol=tol)
    assert (fast[~real] == 0).all()  # padding positions are zeros, never stale memory
    # At query positions ([CLS] and each row's last real token): the inner layers packed too, the last at those only.
    pos = torch.stack([torch.zeros(len(ids), dtype=torch.long), mask.sum(1) - 1], 1)  # (B, 2)
    with torch.no_grad():
        at, at_pooled = model(ids, mask, types, query_positions=pos)
    assert len(packed_calls) > n_calls, "query positions in inference should keep the unpadded path"
    want = slow.detach().gather(1, pos[..., None].expand(-1, -1, slow.shape[-1]))
    torch.testing.assert_close(at, want, atol=tol, rtol=tol)
    torch.testing.assert_close(at_pooled, slow_pooled.detach(), atol=tol, rtol=tol)


def test_unpadding_packs_and_unpacks_the_real_positions():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    u = Unpadding.of(mask)
    assert u.keep.tolist() == [0, 1, 3, 6, 7, 8]
    x = torch.arange(9.0).view(3, 3, 1)
    assert u.pack(x).squeeze(1).tolist() == [0.0, 1.0, 3.0, 6.0, 7.0, 8.0]
    back = u.unpack(u.pack(x))
    torch.testing.assert_close(back, x * mask[..., None])


def test_worth_unpadding_needs_padding(monkeypatch):
    assert worth_unpadding(torch.tensor([[1, 1, 1, 0]]))
    assert not worth_unpadding(torch.ones(2, 4, dtype=torch.long))  # nothing to skip
    assert not worth_unpadding(None)
    from twotower.encoder.core import model as model_module

    monkeypatch.setattr(model_module, "UNPAD_MIN_PADDING", 0.25)
    assert not worth_unpadding(torch.tensor([[1, 1, 1, 0]]))  # exactly the threshold: not more
    assert worth_unpadding(torch.tensor([[1, 1, 0, 0]]))
