"""Losses: worked examples, reference formulas, GradCache gradient equality, cross-rank gather equality."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.retrieval.training_fixtures import tiny_model_dir
from twotower.retrieval.training.losses import (
    Temperature,
    cached_step,
    info_nce,
    listwise_ce,
    listwise_kl,
    pointwise_bce,
)


def _ref_info_nce(q, d, tau, pos_idx, excluded=None):
    """Plain-numpy InfoNCE: mean_i -log softmax_j(q_i . d_j / tau)[pos_i], skipping excluded (i, j)."""
    q, d = q.detach().numpy().astype(np.float64), d.detach().numpy().astype(np.float64)
    losses = []
    for i in range(len(q)):
        s = d @ q[i] / tau
        keep = [j for j in range(len(d)) if excluded is None or not excluded[i][j] or j == pos_idx[i]]
        m = max(s[keep])
        lse = m + math.log(sum(math.exp(s[j] - m) for j in keep))
        losses.append(lse - s[pos_idx[i]])
    return float(np.mean(losses))


def test_info_nce_worked_example():
    q = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # -log(e / (e + 1)) for each query
    assert float(info_nce(q, q.clone(), temperature=1.0)) == pytest.approx(0.3132617, abs=1e-6)


def test_info_nce_with_hard_negatives_matches_reference():
    g = torch.Generator().manual_seed(0)
    B, k, H = 5, 2, 7
    q = F.normalize(torch.randn(B, H, generator=g), dim=-1)
    d = F.normalize(torch.randn(B + B * k, H, generator=g), dim=-1)
    got = float(info_nce(q, d, temperature=0.05))
    assert got == pytest.approx(_ref_info_nce(q, d, 0.05, list(range(B))), rel=1e-5)


def test_mask_removes_a_column_from_one_query_only():
    g = torch.Generator().manual_seed(1)
    q, d = F.normalize(torch.randn(3, 4, generator=g), dim=-1), F.normalize(torch.randn(6, 4, generator=g), dim=-1)
    excluded = torch.zeros(3, 6, dtype=torch.bool)
    excluded[0, 4] = True  # doc 4 is another positive of query 0
    excluded[1, 1] = True  # the positive itself: must be ignored
    got = float(info_nce(q, d, temperature=0.5, mask=excluded))
    assert got == pytest.approx(_ref_info_nce(q, d, 0.5, [0, 1, 2], excluded.tolist()), rel=1e-5)
    assert got != pytest.approx(float(info_nce(q, d, temperature=0.5)), rel=1e-4)


def test_symmetric_is_mean_of_both_directions():
    g = torch.Generator().manual_seed(2)
    q, d = torch.randn(4, 3, generator=g), torch.randn(8, 3, generator=g)
    forward = _ref_info_nce(q, d, 0.5, [0, 1, 2, 3])
    backward = _ref_info_nce(d[:4], q, 0.5, [0, 1, 2, 3])
    assert float(info_nce(q, d, 0.5, symmetric=True)) == pytest.approx((forward + backward) / 2, rel=1e-5)


def test_temperature_fixed_or_learned():
    fixed = Temperature(0.05)
    assert float(fixed()) == pytest.approx(0.05) and not list(fixed.parameters())
    learned = Temperature(0.05, learn=True)
    q = torch.randn(3, 4)
    info_nce(q, torch.randn(3, 4), learned()).backward()
    assert learned.log_inv_tau.grad is not None and float(learned.log_inv_tau.grad) != 0.0
    with pytest.raises(ValueError):
        Temperature(0.0)


def test_listwise_worked_example_and_padding():
    assert float(listwise_ce(torch.tensor([[2.0, 0.0, 0.0]]))) == pytest.approx(-math.log(math.e**2 / (math.e**2 + 2)))
    scores = torch.tensor([[1.0, 3.0, 100.0]])
    valid = torch.tensor([[True, True, False]])
    assert float(listwise_ce(scores, valid)) == pytest.approx(-math.log(math.e / (math.e + math.e**3)), rel=1e-6)
    with pytest.raises(ValueError, match="negative"):
        listwise_ce(torch.tensor([[1.0]]))


def test_pointwise_matches_bce_formula():
    logits = torch.tensor([0.3, -1.2, 2.0])
    labels = torch.tensor([1.0, 0.0, 0.5])
    sig = torch.sigmoid(logits)
    ref = -(labels * sig.log() + (1 - labels) * (1 - sig).log()).mean()
    assert float(pointwise_bce(logits, labels)) == pytest.approx(float(ref), rel=1e-6)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        pointwise_bce(logits, torch.tensor([2.0, 0.0, 1.0]))


# ---- GradCache -----------------------------------------------------------------------------------------
def _towers(dropout: float):
    from twotower.encoder.core.encode import SentenceEncoder

    torch.manual_seed(0)
    enc = SentenceEncoder.from_pretrained(tiny_model_dir(), pooling="mean", normalize=True, bf16=False)
    for m in enc.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
    for layer in enc.model.encoder.layer:
        layer.attention.self.dropout_p = dropout
    return enc.train()


def _inputs(enc, texts):
    return enc.tokenizer.encode(texts, max_length=32).model_inputs()


QUERIES = ["tea cold", "gene cell", "virus mouse", "drug dose", "heart risk", "brain tumor", "lung level"]
DOCS = [t + " " + s for t, s in zip(QUERIES, ["is a drink", "expression high", "in blood", "trial patient",
                                                "increase study", "growth signal", "low effect"])]


def _grads(enc):
    return torch.cat([p.grad.flatten() for p in enc.parameters() if p.grad is not None])


def _loss_fn(reps):
    q, d = reps
    return info_nce(q, d, 0.05)


def _chunked(enc, inputs, size):
    """Reference: the same chunked forward order as GradCache's first pass, but with a graph."""
    from twotower.retrieval.training.losses import split_inputs

    return torch.cat([enc(**c) for c in split_inputs(inputs, size)])


def test_gradcache_equals_uncached_without_dropout():
    enc = _towers(0.0)
    q_in, d_in = _inputs(enc, QUERIES), _inputs(enc, DOCS)
    loss = _loss_fn([enc(**q_in), enc(**d_in)])
    loss.backward()
    ref = _grads(enc).clone()
    enc.zero_grad()
    cached = cached_step([(lambda x: enc(**x), q_in), (lambda x: enc(**x), d_in)], _loss_fn, chunk_size=3, device="cpu")
    assert float(cached) == pytest.approx(float(loss.detach()), abs=1e-6)
    torch.testing.assert_close(_grads(enc), ref, atol=1e-5, rtol=1e-4)


def _dropout_reference_then_cached(enc) -> torch.Tensor:
    """Gradients of the chunked reference under seed 123; then, zeroed, GradCache runs under the same seed."""
    q_in, d_in = _inputs(enc, QUERIES), _inputs(enc, DOCS)
    torch.manual_seed(123)
    _loss_fn([_chunked(enc, q_in, 2), _chunked(enc, d_in, 2)]).backward()
    ref = _grads(enc).clone()
    enc.zero_grad()
    torch.manual_seed(123)
    cached_step([(lambda x: enc(**x), q_in), (lambda x: enc(**x), d_in)], _loss_fn, chunk_size=2, device="cpu")
    return ref


def test_gradcache_replays_dropout_exactly():
    enc = _towers(0.3)
    ref = _dropout_reference_then_cached(enc)
    torch.testing.assert_close(_grads(enc), ref, atol=1e-5, rtol=1e-4)


def test_gradcache_without_replay_would_differ(monkeypatch):
    """The replay is what makes dropout gradients exact: disabling it must break equality."""
    from twotower.retrieval.training.losses import gradcache

    monkeypatch.setattr(gradcache.RngState, "replay", lambda self: contextlib.nullcontext())
    enc = _towers(0.3)
    ref = _dropout_reference_then_cached(enc)
    assert not torch.allclose(_grads(enc), ref, atol=1e-5)


def test_gradcache_saves_the_generator_of_the_device_the_encoders_run_on(monkeypatch):
    """The inputs are CPU batches that the encoders move to the GPU: the CUDA generator that draws dropout is
    that of the encoders' device, and must be saved for the replay even though no input is on it."""
    from twotower.retrieval.training.losses import gradcache

    saved: list[int] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i: saved.append(i) or torch.zeros(1, dtype=torch.uint8))
    monkeypatch.setattr(gradcache.RngState, "replay", lambda self: contextlib.nullcontext())  # no real GPU
    assert gradcache.RngState("cuda").cuda_devices == [1]  # the current one, where torch.device("cuda") runs
    assert gradcache.RngState("cpu").cuda_devices == []
    saved.clear()
    enc = _towers(0.0)
    q_in, d_in = _inputs(enc, QUERIES), _inputs(enc, DOCS)
    cached_step([(lambda x: enc(**x), q_in), (lambda x: enc(**x), d_in)], _loss_fn, chunk_size=2, device="cuda:2")
    assert saved and set(saved) == {2}


# ---- cross-rank gather ---------------------------------------------------------------------------------
def _worker(rank_id: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from twotower.common.distributed import DistInfo, cleanup
    from twotower.retrieval.training.train_dual import contrastive_loss

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_id, world_size=world)
    torch.manual_seed(0)
    B, k, H = 3, 2, 5
    q = torch.randn(world, B, H)
    pos = torch.randn(world, B, H)
    neg = torch.randn(world, B * k, H)
    mine = [t[rank_id].clone().requires_grad_(True) for t in (q, pos, neg)]
    loss = contrastive_loss(*mine, torch.tensor(0.1), None, symmetric=True)
    loss.backward()
    torch.save({"loss": loss.detach(), "grads": [t.grad / world for t in mine]},
               os.path.join(out_dir, f"rank{rank_id}.pt"))
    del loss, mine  # the autograd graph holds the group; see encoder.distributed.cleanup
    cleanup(DistInfo(world, rank_id, rank_id))


def test_gathered_loss_equals_single_process_loss():
    """2 gloo ranks: each rank's loss and (averaged) gradients equal the one-process loss on the concatenated batch."""
    import torch.multiprocessing as mp

    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world, join=True)
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    torch.manual_seed(0)
    B, k, H = 3, 2, 5
    q = torch.randn(world, B, H).requires_grad_(True)
    pos = torch.randn(world, B, H).requires_grad_(True)
    neg = torch.randn(world, B * k, H).requires_grad_(True)
    docs = torch.cat([pos.reshape(-1, H), neg.reshape(-1, H)])
    ref = info_nce(q.reshape(-1, H), docs, torch.tensor(0.1), symmetric=True)
    ref.backward()
    for r, res in enumerate(results):
        assert float(res["loss"]) == pytest.approx(float(ref), abs=1e-6)
        for got, full in zip(res["grads"], (q.grad, pos.grad, neg.grad)):
            torch.testing.assert_close(got, full[r], atol=1e-6, rtol=1e-5)


def test_listwise_kl_worked_example_and_shift_invariance():
    s = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    t = torch.tensor([[1.0, 1.0, 0.0], [3.0, 0.0, 0.0]])
    p = t.softmax(-1)
    ref = (p * (p.log() - s.log_softmax(-1))).sum(-1).mean()  # KL(teacher || student), mean over groups
    assert float(listwise_kl(s, t)) == pytest.approx(float(ref), abs=1e-6)
    assert float(listwise_kl(s + 7.0, t - 3.0)) == pytest.approx(float(ref), abs=1e-5)  # a softmax ignores shifts
    assert float(listwise_kl(t, t)) == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match=r"must both be \(G, n\)"):
        listwise_kl(s, t[:, :2])


def test_listwise_kl_gradient_moves_the_student_towards_the_teacher():
    s = torch.zeros(1, 3, requires_grad=True)
    listwise_kl(s, torch.tensor([[0.0, 2.0, -2.0]])).backward()
    # d/ds KL = softmax(s) - softmax(t): raise the teacher's favourite, lower its least liked
    assert s.grad[0, 1] < 0 < s.grad[0, 2]
