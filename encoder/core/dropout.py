"""Dropout whose mask is cheap to draw on a CPU.

`torch.bernoulli_` (what `nn.Dropout` and SDPA's dropout call) costs ~6 ns per element on this
2-core CPU: with dropout 0.1 on every hidden state and attention map of a `mini` model it was a
fifth of a whole pretraining step (`benchmarks/mlm_throughput.py --profile 2`).  Drawing 64 random bits per call of
the generator and reading them as four 16-bit lanes needs a quarter of the generator calls and no
float conversion: about 3x cheaper for an 8192 x 256 mask (`benchmarks/cpu_train_kernels.py`).  The price is that the drop probability is rounded to a
multiple of 2^-16 (0.1 becomes 6554/65536 = 0.100006); kept values are scaled by the exact
1 / keep-probability of that rounded rate, so the layer stays unbiased.

The bits come from the tensor's device generator (`torch.manual_seed` seeds it and checkpoints save
it), so runs are reproducible and resume exactly.  On other devices `F.dropout` is used: CUDA's
kernel draws and applies the mask in one fused pass already.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_LANES = 65536  # values of one 16-bit lane


def drop_threshold(p: float) -> int:
    """Number of the 65,536 lane values that drop an element: round(p * 2^16)."""
    return int(round(p * _LANES))


def keep_mask(shape: torch.Size | tuple[int, ...], p: float, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """Scaled keep mask of `shape`: 0 where dropped, 1 / P(keep) elsewhere, in `dtype`.

    Each element reads one uniformly random signed 16-bit lane; it is dropped when the lane is
    among the lowest `drop_threshold(p)` values.
    """
    n = math.prod(shape)
    drop = drop_threshold(p)
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=device).random_(-(2**63), None)
    lanes = words.view(torch.int16)[:n].view(shape)  # (shape) uniform over [-32768, 32767]
    scale = torch.tensor(_LANES / (_LANES - drop), dtype=dtype, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(lanes >= -32768 + drop, scale, zero)


def dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Inverted dropout of `x` with probability `p`; the identity when not training or p == 0."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if x.device.type != "cpu":
        return F.dropout(x, p, True)
    # autograd saves only the mask for the backward (the mask needs no grad, so x is not kept)
    return x * keep_mask(x.shape, p, x.dtype, x.device)


class Dropout(nn.Dropout):
    """`nn.Dropout` with the cheap CPU mask above.

    A subclass, so code that finds dropout layers with ``isinstance(m, nn.Dropout)`` and sets ``m.p``
    (a common way to switch dropout off) keeps working; no parameters, the same state_dict.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
