"""MLM example construction: which positions to predict and how to corrupt them (docs/architecture.md, "MLM").

The rules, in the order the code applies them:

1. *Selection*: about `rate` (15%) of the selectable positions of each row are
   chosen as targets.  [CLS], [SEP], [MASK] and padding are never selectable.
   By default each row gets ``round(rate * n_selectable)`` targets (at least
   one), which keeps the per-batch count close to 15% with far less variance
   than an independent coin per token; `num_masks` fixes the count per row
   instead so that the gathered MLM head always sees the same shape.
   With whole-word masking the unit of selection is a word (from the
   tokenizer's word ids, carried as a "starts a word" bit per token), and all
   of a selected word's tokens are targets, so a word is never split.
2. *Corruption* of the selected positions: 80% -> [MASK], 10% -> a random
   token drawn from the non-special vocabulary, 10% unchanged.
3. *Labels*: the original token at every selected position (unchanged ones
   included), -100 elsewhere.  The loss mask is the selection, never
   ``input_ids == mask_id``.

Randomness always comes from an explicit `torch.Generator`, so a batch's mask is
a pure function of (seed, step) and a resumed run masks exactly as an
uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100

# Corruption branches of a selected position (the `branch` tensor; -1 = not selected).
MASKED, RANDOM, KEPT = 0, 1, 2


@dataclass(frozen=True)
class MaskingSpec:
    """How to build MLM examples.

    rate:        fraction of selectable positions that become targets.
    mask_prob / random_prob: branch probabilities of a selected position (rest: unchanged).
    whole_word:  select whole words (needs word starts) instead of single tokens.
    num_masks:   exactly this many targets per row (static shapes); None = round(rate * n).
    """

    rate: float = 0.15
    mask_prob: float = 0.8
    random_prob: float = 0.1
    whole_word: bool = False
    num_masks: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.rate < 1.0:
            raise ValueError(f"masking rate must be in (0, 1), got {self.rate}")
        if self.mask_prob < 0 or self.random_prob < 0 or self.mask_prob + self.random_prob > 1.0:
            raise ValueError(f"mask_prob ({self.mask_prob}) + random_prob ({self.random_prob}) must lie in [0, 1]")
        if self.num_masks is not None and self.num_masks < 1:
            raise ValueError(f"num_masks must be >= 1, got {self.num_masks}")
        if self.num_masks is not None and self.whole_word:
            raise ValueError("num_masks and whole-word masking cannot be combined: a whole word may not fit the count")


@dataclass
class MaskedBatch:
    """input_ids (B, T) corrupted; labels (B, T) original id at targets, -100 elsewhere;
    branch (B, T) int8: -1 not selected, 0 [MASK], 1 random token, 2 kept."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    branch: torch.Tensor

    @property
    def selected(self) -> torch.Tensor:
        return self.labels != IGNORE_INDEX


class TokenSpace:
    """The vocabulary facts masking needs: which ids are structural and which may replace a token."""

    def __init__(self, vocab_size: int, mask_id: int, special_ids: Sequence[int], never_select: Sequence[int]):
        self.vocab_size = vocab_size
        self.mask_id = mask_id
        special = set(int(i) for i in special_ids)
        self.random_ids = torch.tensor([i for i in range(vocab_size) if i not in special], dtype=torch.long)
        if len(self.random_ids) == 0:
            raise ValueError("vocabulary has no non-special tokens to draw random replacements from")
        self.never_select = torch.tensor(sorted(set(int(i) for i in never_select)), dtype=torch.long)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenSpace:
        """[PAD] [CLS] [SEP] [MASK] are never targets; random replacements avoid all five special tokens.

        [UNK] stays selectable: it is a real position of the text (HF does the same).
        """
        return cls(
            vocab_size=tokenizer.vocab_size,
            mask_id=tokenizer.mask_id,
            special_ids=tokenizer.special_ids,
            never_select=[tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id],
        )

    def selectable(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) bool: positions that may become targets."""
        ok = ~torch.isin(input_ids, self.never_select.to(input_ids.device))
        if attention_mask is not None:
            ok &= attention_mask.bool()
        return ok


def _rank_within_row(scores: torch.Tensor) -> torch.Tensor:
    """(B, N) float -> (B, N) long: 0 for the smallest score of each row, 1 for the next ..."""
    order = scores.argsort(dim=1)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(scores.shape[1], device=scores.device).expand_as(order))
    return ranks


def select_positions(
    selectable: torch.Tensor,
    spec: MaskingSpec,
    generator: torch.Generator,
    word_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Choose the MLM targets of each row.

    selectable:  (B, T) bool
    word_starts: (B, T) bool, True where a token starts a word (needed for whole-word masking)
    returns:     (B, T) bool selection, a subset of `selectable`
    """
    B, T = selectable.shape
    n_ok = selectable.sum(dim=1)  # (B,)
    if spec.num_masks is not None:
        short = (n_ok < spec.num_masks).nonzero().flatten()
        if len(short):
            r = int(short[0])
            raise ValueError(
                f"row {r} has only {int(n_ok[r])} selectable tokens but num_masks={spec.num_masks}; "
                "lower num_masks or use longer rows"
            )
        k = torch.full_like(n_ok, spec.num_masks)
    else:
        k = torch.clamp((n_ok.double() * spec.rate).round().long(), min=1)
        k = torch.minimum(k, n_ok)
    scores = torch.rand((B, T), generator=generator, device=selectable.device)
    if not spec.whole_word:
        scores = scores.masked_fill(~selectable, 2.0)  # unselectable positions rank last
        return (_rank_within_row(scores) < k[:, None]) & selectable

    if word_starts is None:
        raise ValueError("whole-word masking needs word_starts (the tokenizer's word boundaries)")
    # A word = a start token and the continuation tokens after it.  Special tokens always start their own word
    # so a word never swallows [SEP]/[CLS] of a neighbouring sample.
    starts = word_starts.bool() | ~selectable
    word_id = starts.long().cumsum(dim=1) - 1  # (B, T) index of the word each token belongs to
    word_id = word_id.clamp(min=0)
    # Every word takes the random score of its start token (min over its tokens, the others score 3):
    # words are shuffled, not tokens.  Words whose start is not selectable keep 3 and are never taken.
    token_score = torch.where(starts & selectable, scores, torch.full_like(scores, 3.0))
    word_score = torch.full((B, T), 3.0, device=selectable.device).scatter_reduce(
        1, word_id, token_score, reduce="amin"
    )  # (B, W<=T) per word slot
    word_ok = word_score < 3.0
    word_len = torch.zeros((B, T), dtype=torch.long, device=selectable.device)
    word_len.scatter_add_(1, word_id, selectable.long())
    # Walk words in random order, taking each while fewer than k tokens are taken so far.
    order = word_score.argsort(dim=1)  # (B, T) word indices, best first
    len_sorted = word_len.gather(1, order) * word_ok.gather(1, order)
    before = len_sorted.cumsum(dim=1) - len_sorted  # tokens taken before each word in that order
    take_sorted = (before < k[:, None]) & word_ok.gather(1, order)
    take_word = torch.zeros_like(take_sorted)
    take_word.scatter_(1, order, take_sorted)
    return take_word.gather(1, word_id) & selectable


def corrupt(
    input_ids: torch.Tensor, selected: torch.Tensor, branch: torch.Tensor, random_tokens: torch.Tensor, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply the chosen branch at each selected position.

    input_ids, selected, branch, random_tokens: (B, T); branch 0 = [MASK], 1 = random token, 2 = keep.
    returns (corrupted input_ids (B, T), labels (B, T) with the original id at selected positions, -100 elsewhere)
    """
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    out = input_ids.clone()
    out = torch.where(selected & (branch == MASKED), torch.full_like(out, mask_id), out)
    out = torch.where(selected & (branch == RANDOM), random_tokens.to(out.dtype), out)
    return out, labels


def mask_tokens(
    input_ids: torch.Tensor,
    space: TokenSpace,
    spec: MaskingSpec,
    generator: torch.Generator,
    attention_mask: torch.Tensor | None = None,
    word_starts: torch.Tensor | None = None,
) -> MaskedBatch:
    """Build one MLM batch from clean token ids (B, T): selection, 80/10/10 corruption, labels."""
    selectable = space.selectable(input_ids, attention_mask)
    selected = select_positions(selectable, spec, generator, word_starts)
    u = torch.rand(input_ids.shape, generator=generator, device=input_ids.device)
    branch = torch.where(
        u < spec.mask_prob,
        torch.tensor(MASKED, device=input_ids.device),
        torch.where(u < spec.mask_prob + spec.random_prob, torch.tensor(RANDOM, device=input_ids.device),
                    torch.tensor(KEPT, device=input_ids.device)),
    )
    pick = torch.randint(len(space.random_ids), input_ids.shape, generator=generator, device=input_ids.device)
    random_tokens = space.random_ids.to(input_ids.device)[pick]
    ids, labels = corrupt(input_ids, selected, branch, random_tokens, space.mask_id)
    branch = torch.where(selected, branch, torch.tensor(-1, device=input_ids.device)).to(torch.int8)
    return MaskedBatch(input_ids=ids, labels=labels, branch=branch)


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets only (labels != -100); zero targets is an error.

    logits: (..., V) either at all positions (labels of the same leading shape) or already
            gathered at the targets (N, V) with labels (N,).
    Dividing by every position instead of the targets is the classic bug this function exists to avoid.
    """
    flat_labels = labels.reshape(-1)
    keep = flat_labels != IGNORE_INDEX
    n = int(keep.sum())
    if n == 0:
        raise ValueError("MLM batch has zero target positions (every label is -100); nothing to predict")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if n < flat_labels.numel():  # logits at all positions: select the targets (gathered logits need no copy)
        flat_logits, flat_labels = flat_logits[keep], flat_labels[keep]
    return torch.nn.functional.cross_entropy(flat_logits.float(), flat_labels, reduction="mean")
