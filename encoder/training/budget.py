"""A training budget in tokens, optimizer steps or wall-clock seconds, and the progress clock keyed to it.

The learning-rate schedule is a function of `Budget.progress()` in [0, 1]
(`twotower.encoder.training.optim.lr_factor`), so warmup and decay end exactly when the budget
does, whatever the hardware's speed.  Wall-clock time survives a resume: the
elapsed seconds of earlier sessions are carried in the training state.

Example:
    >>> b = Budget.parse(tokens="20M")
    >>> b.total, b.kind
    (20000000.0, 'tokens')
    >>> b.progress(tokens=5_000_000)
    0.25
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}
_TIME = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_count(text: str | int | float) -> float:
    """'20M' -> 2e7, '1.5k' -> 1500, '300' -> 300 (k/M/G|B/T, case-insensitive)."""
    if isinstance(text, (int, float)):
        return float(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgbt]?)\s*", text.lower())
    if not m:
        raise ValueError(f"cannot parse {text!r} as a count (examples: 20M, 1.5B, 500k)")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


def parse_duration(text: str | int | float) -> float:
    """'30m' -> 1800, '2h' -> 7200, '1h30m' -> 5400, '90s' / '90' -> 90 seconds."""
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip().lower()
    if re.fullmatch(r"[0-9]*\.?[0-9]+", s):
        return float(s)
    parts = re.findall(r"([0-9]*\.?[0-9]+)\s*([smhd])", s)
    if not parts or "".join(a + b for a, b in parts) != re.sub(r"\s+", "", s):
        raise ValueError(f"cannot parse {text!r} as a duration (examples: 30m, 2h, 1h30m, 90s)")
    return sum(float(a) * _TIME[b] for a, b in parts)


@dataclass
class Budget:
    """kind: 'tokens' | 'steps' | 'seconds'; total > 0."""

    kind: str
    total: float

    def __post_init__(self) -> None:
        if self.kind not in ("tokens", "steps", "seconds"):
            raise ValueError(f"budget kind must be tokens, steps or seconds, got {self.kind!r}")
        if not self.total > 0:
            raise ValueError(f"budget must be positive, got {self.total}")

    @classmethod
    def parse(cls, budget: str | None = None, tokens: str | None = None, steps: int | None = None) -> Budget:
        given = [x is not None for x in (budget, tokens, steps)]
        if sum(given) != 1:
            raise ValueError("give exactly one budget: --budget (wall clock, e.g. 30m) or --tokens (e.g. 20M)")
        kind, flag, text, read = (("seconds", "--budget", budget, parse_duration) if budget is not None else
                                  ("tokens", "--tokens", tokens, parse_count) if tokens is not None else
                                  ("steps", "--steps", steps, float))
        try:
            total = read(text)
        except ValueError as e:  # the parsers' messages name no flag
            raise ValueError(f"{flag}: {e}") from None
        if not total > 0:  # NaN too; said "budget must be positive, got 0.0", naming no flag
            raise ValueError(f"{flag} {text}: give a budget above 0")
        if kind == "tokens" and total < 1:  # `--tokens 0.5` ran one step
            raise ValueError(f"{flag} {text}: give at least 1 token (e.g. 20M)")
        return cls(kind, total)

    def progress(self, tokens: float = 0.0, steps: int = 0, seconds: float = 0.0) -> float:
        used = {"tokens": tokens, "steps": steps, "seconds": seconds}[self.kind]
        return min(1.0, used / self.total)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "total": self.total}


class Clock:
    """Wall-clock seconds of training, including those of earlier (resumed) sessions."""

    def __init__(self, elapsed_before: float = 0.0) -> None:
        self.before = float(elapsed_before)
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return self.before + time.monotonic() - self.start
