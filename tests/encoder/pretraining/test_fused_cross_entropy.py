"""twotower.encoder.pretraining.fused_cross_entropy against F.cross_entropy: loss, gradient, accuracy, scaling, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from twotower.encoder.pretraining.fused_cross_entropy import cross_entropy_with_correct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_cross_entropy_and_its_gradient(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, 301, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 301, (37,), generator=g)
    targets[:5] = logits[:5].float().argmax(-1)  # some rows right, so the count is not trivially 0

    a = logits.clone().requires_grad_(True)
    loss, correct = cross_entropy_with_correct(a, targets)
    loss.backward()
    b = logits.clone().requires_grad_(True)
    ref = F.cross_entropy(b.float(), targets)
    ref.backward()

    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    assert a.grad.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # the bf16 gradient is the fp32 one rounded once
    torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=tol, rtol=1e-2)
    assert int(correct) == int((logits.float().argmax(-1) == targets).sum()) >= 5


def test_scaled_loss_scales_the_gradient_and_no_grad_path():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 50, generator=g)
    targets = torch.randint(0, 50, (8,), generator=g)
    a = logits.clone().requires_grad_(True)
    (cross_entropy_with_correct(a, targets)[0] * 0.25).backward()  # e.g. gradient accumulation over 4
    b = logits.clone().requires_grad_(True)
    (F.cross_entropy(b, targets) * 0.25).backward()
    torch.testing.assert_close(a.grad, b.grad)
    with torch.no_grad():
        loss, _ = cross_entropy_with_correct(logits, targets)
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets))


def test_workspace_reuse_across_shapes_gives_independent_results():
    g = torch.Generator().manual_seed(2)
    big = torch.randn(64, 400, generator=g)
    small = torch.randn(3, 10, generator=g)
    tb, ts = torch.randint(0, 400, (64,), generator=g), torch.randint(0, 10, (3,), generator=g)
    first = cross_entropy_with_correct(small, ts)[0]
    cross_entropy_with_correct(big, tb)
    torch.testing.assert_close(cross_entropy_with_correct(small, ts)[0], first)
    torch.testing.assert_close(first, F.cross_entropy(small, ts))


def test_bad_shapes_and_empty_batch():
    with pytest.raises(ValueError, match="zero targets"):
        cross_entropy_with_correct(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"expected logits \(N, V\)"):
        cross_entropy_with_correct(torch.zeros(4, 5), torch.zeros(3, dtype=torch.long))


def test_two_forwards_before_one_backward_keep_their_own_gradients():
    # the fp32 scratch is shared between calls; the saved gradient must not be
    g = torch.Generator().manual_seed(3)
    a1, a2 = (torch.randn(6, 40, generator=g).requires_grad_(True) for _ in range(2))
    t1, t2 = (torch.randint(0, 40, (6,), generator=g) for _ in range(2))
    (cross_entropy_with_correct(a1, t1)[0] + cross_entropy_with_correct(a2, t2)[0]).backward()
    b1, b2 = (a.detach().clone().requires_grad_(True) for a in (a1, a2))
    (F.cross_entropy(b1, t1) + F.cross_entropy(b2, t2)).backward()
    torch.testing.assert_close(a1.grad, b1.grad)
    torch.testing.assert_close(a2.grad, b2.grad)
