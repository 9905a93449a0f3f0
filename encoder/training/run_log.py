"""The record of a training run: a JSONL log and a PNG of loss and validation accuracy against tokens.

One JSON object per line: ``{"type": "train", "step", "tokens", "loss", ...}`` or
``{"type": "valid", ...}``.  On resume the lines after the checkpoint's step are
dropped, so the log reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import os

from twotower.common.atomic import atomic_path, atomic_write_text


class RunLog:
    def __init__(self, path: str, enabled: bool = True) -> None:
        self.path, self.enabled = path, enabled

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()

    def read(self) -> list[dict]:
        if not os.path.isfile(self.path):
            return []
        out = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:  # a line torn by a kill: ignore it
                        continue
        return out

    def truncate_after(self, step: int) -> None:
        """Keep only records up to `step` (what a resumed run will reproduce after it)."""
        if not self.enabled or not os.path.isfile(self.path):
            return
        keep = [r for r in self.read() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in keep))


def plot_curves(records: list[dict], path: str, title: str = "") -> None:
    """Training loss and validation MLM accuracy against tokens seen (matplotlib Agg, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("type") == "train"]
    valid = [r for r in records if r.get("type") == "valid"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if train:
        ax1.plot([r["tokens"] / 1e6 for r in train], [r["loss"] for r in train], lw=0.8)
    ax1.set_xlabel("tokens (M)")
    ax1.set_ylabel("training loss")
    ax1.grid(alpha=0.3)
    if valid:
        ax2.plot([r["tokens"] / 1e6 for r in valid], [r["mlm_accuracy"] for r in valid], marker="o")
    ax2.set_xlabel("tokens (M)")
    ax2.set_ylabel("validation MLM accuracy")
    ax2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
