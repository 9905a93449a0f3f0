"""Entity-level precision / recall / F1 for BIO (and IOBES) tag sequences, CoNLL semantics.

Why entity level: token accuracy on NER is dominated by ``O`` and says little;
the CoNLL shared tasks score *chunks*: an entity counts only when its type,
start and end all match.  Chunks are read the way ``conlleval.pl`` reads
them — and ``seqeval`` in its default mode, against which this file is tested:

* ``B-X`` starts a chunk; ``I-X`` continues one of the same type;
* an ``I-X`` after ``O``, after a chunk of another type, or at the start of a
  sentence *starts a new chunk* (malformed but common in model output);
* ``E-``/``S-`` (IOBES) end / are single-token chunks;
* a chunk never crosses a sentence boundary.

Scores are micro-averaged over all entities; per-type numbers come with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def _split(tag: str) -> tuple[str, str]:
    """``"B-PER"`` -> ``("B", "PER")``; ``"O"`` -> ``("O", "_")`` (conlleval's reading)."""
    if not tag:
        raise ValueError("empty tag")
    return tag[0], tag[1:].split("-", maxsplit=1)[-1] or "_"


def _chunk_ends(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    if prev_tag in ("E", "S"):
        return True
    if prev_tag in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev_tag not in ("O", ".") and prev_type != type_


def _chunk_starts(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    if tag in ("B", "S"):
        return True
    if prev_tag in ("E", "S", "O") and tag in ("E", "I"):
        return True
    return tag not in ("O", ".") and prev_type != type_


def get_entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """Chunks of one sentence as ``(type, start, end)`` with ``end`` inclusive.

    Example:
        >>> get_entities(["B-PER", "I-PER", "O", "I-LOC", "B-LOC"])
        [('PER', 0, 1), ('LOC', 3, 3), ('LOC', 4, 4)]
    """
    chunks: list[tuple[str, int, int]] = []
    prev_tag, prev_type, begin = "O", "_", 0
    for i, raw in enumerate([*tags, "O"]):  # the sentinel "O" closes a chunk open at the end
        tag, type_ = _split(raw)
        if _chunk_ends(prev_tag, tag, prev_type, type_):
            chunks.append((prev_type, begin, i - 1))
        if _chunk_starts(prev_tag, tag, prev_type, type_):
            begin = i
        prev_tag, prev_type = tag, type_
    return chunks


class TaggingReport(NamedTuple):
    """Micro-averaged entity P/R/F1, per-type numbers and token accuracy."""

    precision: float
    recall: float
    f1: float
    per_type: dict[str, dict[str, float]]  # {type: {"precision", "recall", "f1", "support"}}
    token_accuracy: float
    num_true: int
    num_pred: int
    num_correct: int

    def format(self, digits: int = 4) -> str:
        """Plain-text table, one row per entity type plus the micro average."""
        width = max(12, *(len(t) for t in self.per_type)) if self.per_type else 12
        lines = [f"{'':>{width}} {'precision':>10} {'recall':>10} {'f1':>10} {'support':>10}", ""]
        for name, v in self.per_type.items():
            lines.append(
                f"{name:>{width}} {v['precision']:>10.{digits}f} {v['recall']:>10.{digits}f} "
                f"{v['f1']:>10.{digits}f} {int(v['support']):>10d}"
            )
        lines += [
            "",
            f"{'micro avg':>{width}} {self.precision:>10.{digits}f} {self.recall:>10.{digits}f} "
            f"{self.f1:>10.{digits}f} {self.num_true:>10d}",
            f"{'token acc':>{width}} {self.token_accuracy:>10.{digits}f}",
        ]
        return "\n".join(lines)


def _prf(correct: int, predicted: int, true: int) -> tuple[float, float, float]:
    p = correct / predicted if predicted else 0.0
    r = correct / true if true else 0.0
    f = 2 * p * r / (p + r) if p + r else 0.0
    return p, r, f


def tagging_report(y_true: Sequence[Sequence[str]], y_pred: Sequence[Sequence[str]]) -> TaggingReport:
    """Score predicted tag sequences against gold ones, sentence by sentence.

    Args:
        y_true: gold tags, one list per sentence.
        y_pred: predicted tags, same shape.

    Raises:
        ValueError: different numbers of sentences, or a sentence whose lengths differ.
    """
    if len(y_true) != len(y_pred):
        raise ValueError(f"{len(y_true)} gold sentences but {len(y_pred)} predicted")
    gold: set[tuple[int, str, int, int]] = set()
    pred: set[tuple[int, str, int, int]] = set()
    tokens = same = 0
    for s, (t_tags, p_tags) in enumerate(zip(y_true, y_pred)):
        if len(t_tags) != len(p_tags):
            raise ValueError(f"sentence {s}: {len(t_tags)} gold tags but {len(p_tags)} predicted")
        gold.update((s, *chunk) for chunk in get_entities(t_tags))
        pred.update((s, *chunk) for chunk in get_entities(p_tags))
        tokens += len(t_tags)
        same += sum(a == b for a, b in zip(t_tags, p_tags))
    correct = gold & pred
    per_type: dict[str, dict[str, float]] = {}
    for type_ in sorted({c[1] for c in gold} | {c[1] for c in pred}):
        n_true = sum(1 for c in gold if c[1] == type_)
        n_pred = sum(1 for c in pred if c[1] == type_)
        n_ok = sum(1 for c in correct if c[1] == type_)
        p, r, f = _prf(n_ok, n_pred, n_true)
        per_type[type_] = {"precision": p, "recall": r, "f1": f, "support": n_true}
    p, r, f = _prf(len(correct), len(pred), len(gold))
    return TaggingReport(
        precision=p,
        recall=r,
        f1=f,
        per_type=per_type,
        token_accuracy=same / tokens if tokens else 0.0,
        num_true=len(gold),
        num_pred=len(pred),
        num_correct=len(correct),
    )
