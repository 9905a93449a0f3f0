"""Pooling: from per-token hidden states to one vector per text.

Mean pooling must average over *real* tokens only: a padding position computes
something finite but meaningless (docs/architecture.md, "Attention mask"), and letting it
into the average would make a text's vector depend on the longest text it was
batched with.  [CLS] pooling takes position 0, which is never padding.

These match sentence-transformers' `Pooling` modes of the same name, so a
directory whose ``1_Pooling/config.json`` says ``pooling_mode_mean_tokens``
gives the same vector here as there.
"""

from __future__ import annotations

import torch

POOLING_MODES = ("mean", "cls", "max")

# sentence-transformers' 1_Pooling/config.json keys -> our mode names.
ST_POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
}


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average of the real-token vectors.

    hidden:         (B, T, H)
    attention_mask: (B, T) 1 real / 0 padding
    returns:        (B, H), in hidden's dtype; the sum is taken in float32 so a
                    bf16 forward does not lose precision over hundreds of tokens.
    """
    m = attention_mask.to(torch.float32).unsqueeze(-1)  # (B, T, 1)
    summed = (hidden.to(torch.float32) * m).sum(dim=1)  # (B, H)
    counts = m.sum(dim=1).clamp_min(1e-9)  # (B, 1); an all-padding row gives 0, not NaN
    return summed / counts


def cls_pool(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The [CLS] vector. hidden: (B, T, H) -> (B, H). The mask is accepted for a uniform signature."""
    return hidden[:, 0].to(torch.float32)


def max_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over real tokens. hidden: (B, T, H), mask: (B, T) -> (B, H)."""
    h = hidden.to(torch.float32).masked_fill(~attention_mask.bool().unsqueeze(-1), float("-inf"))  # (B, T, H)
    out = h.max(dim=1).values  # (B, H)
    return torch.where(torch.isinf(out), torch.zeros_like(out), out)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Dispatch on `mode` (one of POOLING_MODES). hidden: (B, T, H), mask: (B, T) -> (B, H) float32."""
    if mode == "mean":
        return mean_pool(hidden, attention_mask)
    if mode == "cls":
        return cls_pool(hidden, attention_mask)
    if mode == "max":
        return max_pool(hidden, attention_mask)
    raise ValueError(f"pooling={mode!r}; choose one of {POOLING_MODES}")
