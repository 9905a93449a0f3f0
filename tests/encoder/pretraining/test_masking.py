"""MLM masking: the worked example of docs/architecture.md ("MLM"), the 15% / 80-10-10 statistics, and the exclusion rules."""

from __future__ import annotations

import math

import pytest
import torch

from twotower.encoder.pretraining.masking import (
    IGNORE_INDEX,
    KEPT,
    MASKED,
    RANDOM,
    MaskingSpec,
    TokenSpace,
    corrupt,
    mask_tokens,
    masked_lm_loss,
    select_positions,
)

# Toy vocabulary of docs/architecture.md ("MLM"): PAD=0 CLS=1 SEP=2 MASK=3 the=4 tea=5 is=6 cold=7 hot=8
PAD, CLS, SEP, MASK = 0, 1, 2, 3
TOY = TokenSpace(vocab_size=9, mask_id=MASK, special_ids=[0, 1, 2, 3], never_select=[PAD, CLS, SEP, MASK])


def test_worked_example_of_design_md():
    clean = torch.tensor([[CLS, 4, 5, 6, 7, SEP, PAD]])  # [CLS] the tea is cold [SEP] [PAD]
    attention = (clean != PAD).long()
    selected = torch.zeros_like(clean, dtype=torch.bool)
    selected[0, 2] = selected[0, 4] = True  # select "tea" and "cold"
    branch = torch.full_like(clean, KEPT)
    branch[0, 4] = MASKED  # keep tea, mask cold
    ids, labels = corrupt(clean, selected, branch, torch.zeros_like(clean), MASK)
    assert ids.tolist() == [[1, 4, 5, 6, 3, 2, 0]]
    assert labels.tolist() == [[-100, -100, 5, -100, 7, -100, -100]]
    assert attention.tolist() == [[1, 1, 1, 1, 1, 1, 0]]
    # The loss mask is the selection: position 2 is scored although its input is not [MASK].
    assert (labels != IGNORE_INDEX).tolist() != (ids == MASK).tolist()

    # Logits whose softmax gives the target 0.8 at "tea" and 0.25 at "cold"; anything elsewhere.
    logits = torch.randn(1, 7, 9)
    for pos, target, p in ((2, 5, 0.8), (4, 7, 0.25)):
        row = torch.full((9,), math.log((1 - p) / 8))
        row[target] = math.log(p)
        logits[0, pos] = row
    loss = masked_lm_loss(logits, labels)
    assert loss.item() == pytest.approx(0.804719, abs=1e-6)
    assert loss.item() != pytest.approx(0.229920, abs=1e-3)  # the divide-by-all-positions bug


def test_zero_targets_is_an_error():
    with pytest.raises(ValueError, match="zero target"):
        masked_lm_loss(torch.randn(2, 5, 9), torch.full((2, 5), IGNORE_INDEX))


def _random_rows(B: int, T: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of real tokens (ids 4..99) framed by [CLS]/[SEP], some with a padded tail and a [SEP] inside."""
    ids = torch.randint(4, 100, (B, T), generator=gen)
    ids[:, 0] = CLS
    lengths = torch.randint(T // 2, T + 1, (B,), generator=gen)
    attn = (torch.arange(T)[None, :] < lengths[:, None]).long()
    ids[torch.arange(B), lengths - 1] = SEP
    ids[:, T // 3] = SEP  # a packed-row boundary in the middle
    ids = ids.masked_fill(attn == 0, PAD)
    return ids, attn


SPACE = TokenSpace(vocab_size=100, mask_id=MASK, special_ids=[0, 1, 2, 3], never_select=[PAD, CLS, SEP, MASK])


def test_statistics_on_100k_tokens():
    gen = torch.Generator().manual_seed(0)
    ids, attn = _random_rows(1400, 128, gen)
    selectable = SPACE.selectable(ids, attn)
    assert int(selectable.sum()) >= 100_000
    out = mask_tokens(ids, SPACE, MaskingSpec(), gen, attention_mask=attn)
    sel = out.selected
    frac = sel.sum().item() / selectable.sum().item()
    assert abs(frac - 0.15) < 0.005
    n = sel.sum().item()
    for b, want in ((MASKED, 0.8), (RANDOM, 0.1), (KEPT, 0.1)):
        assert abs((out.branch == b).sum().item() / n - want) < 0.01, b
    # Never special tokens or padding; the branch tensor matches what happened to the ids.
    assert not (sel & ~selectable).any()
    assert not sel[ids == CLS].any() and not sel[ids == SEP].any() and not sel[attn == 0].any()
    assert (out.input_ids[out.branch == MASKED] == MASK).all()
    assert (out.input_ids[out.branch == KEPT] == ids[out.branch == KEPT]).all()
    rnd = out.input_ids[out.branch == RANDOM]
    assert ((rnd >= 4) & (rnd < 100)).all()  # random replacements come from the non-special vocabulary
    assert (rnd != ids[out.branch == RANDOM]).float().mean() > 0.9  # and really are random draws
    assert (out.labels[sel] == ids[sel]).all() and (out.labels[~sel] == IGNORE_INDEX).all()
    assert (out.input_ids[~sel] == ids[~sel]).all()


def test_bernoulli_free_counts_and_fixed_count():
    gen = torch.Generator().manual_seed(1)
    ids, attn = _random_rows(13, 37, gen)
    n_ok = SPACE.selectable(ids, attn).sum(1)
    sel = select_positions(SPACE.selectable(ids, attn), MaskingSpec(), gen)
    assert sel.sum(1).tolist() == torch.clamp((n_ok * 0.15).double().round().long(), min=1).tolist()
    fixed = select_positions(SPACE.selectable(ids, attn), MaskingSpec(num_masks=3), gen)
    assert fixed.sum(1).tolist() == [3] * 13
    with pytest.raises(ValueError, match="num_masks"):
        select_positions(SPACE.selectable(ids, attn), MaskingSpec(num_masks=40), gen)


def test_dynamic_masks_differ_and_seed_reproduces():
    ids, attn = _random_rows(4, 64, torch.Generator().manual_seed(2))
    a = mask_tokens(ids, SPACE, MaskingSpec(), torch.Generator().manual_seed(5), attention_mask=attn)
    b = mask_tokens(ids, SPACE, MaskingSpec(), torch.Generator().manual_seed(5), attention_mask=attn)
    c = mask_tokens(ids, SPACE, MaskingSpec(), torch.Generator().manual_seed(6), attention_mask=attn)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.labels, c.labels)


def test_whole_word_masking_never_splits_a_word():
    gen = torch.Generator().manual_seed(3)
    ids, attn = _random_rows(200, 64, gen)
    # words of 1-4 tokens
    starts = torch.rand(ids.shape, generator=gen) < 0.45
    spec = MaskingSpec(whole_word=True)
    out = mask_tokens(ids, SPACE, spec, gen, attention_mask=attn, word_starts=starts)
    sel = out.selected
    selectable = SPACE.selectable(ids, attn)
    assert not (sel & ~selectable).any()
    # walk words: every selectable token of a word shares the word's selection
    n_words_partial = 0
    for b in range(ids.shape[0]):
        cur = []
        for t in range(ids.shape[1]):
            if starts[b, t] or not selectable[b, t]:
                if cur and len({bool(sel[b, i]) for i in cur}) > 1:
                    n_words_partial += 1
                cur = []
            if selectable[b, t]:
                cur.append(t)
        if cur and len({bool(sel[b, i]) for i in cur}) > 1:
            n_words_partial += 1
    assert n_words_partial == 0
    frac = sel.sum().item() / selectable.sum().item()
    assert 0.13 < frac < 0.2  # about 15%, overshooting by at most part of one word per row
    multi = [(b, t) for b in range(ids.shape[0]) for t in range(1, ids.shape[1])
             if sel[b, t] and not starts[b, t] and selectable[b, t - 1]]
    assert multi, "some selected words must span several tokens for the test to mean anything"
    with pytest.raises(ValueError, match="word_starts"):
        mask_tokens(ids, SPACE, spec, gen, attention_mask=attn)


def test_spec_validation():
    with pytest.raises(ValueError, match="rate"):
        MaskingSpec(rate=0.0)
    with pytest.raises(ValueError, match="cannot be combined"):
        MaskingSpec(whole_word=True, num_masks=4)
