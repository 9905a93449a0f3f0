"""Extractive QA metrics: SQuAD v1.1 and v2.0 exact match and token F1.

These re-implement the official evaluation scripts (``evaluate-v1.1.py`` and
``evaluate-v2.0.py``) rather than approximating them, because reported SQuAD
numbers are only comparable under the exact normalisation: lower-case, drop
ASCII punctuation (``string.punctuation``), drop the articles a/an/the, and
collapse whitespace.  A prediction is scored against every gold answer and the
best score is kept.  Numbers are percentages, as the official scripts print.

v1.1 and v2.0 differ only where an answer normalises to nothing: v1.1's F1 is
0 whenever no token is shared; v2.0 treats an empty gold list as "no answer",
scores an empty prediction against it as correct (EM = F1 = 1), and adds the
no-answer threshold machinery (``na_probs``).

One deliberate difference: a question without a prediction scores 0 and is
counted in ``missing`` (v1.1 does the same; v2.0 would silently drop it from
the total, which flatters incomplete prediction files).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Official SQuAD normalisation: lower, strip punctuation, strip articles, fix whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    """1.0 when the normalised strings are equal."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD v1.1 token F1 (0 when nothing is shared, including two empty answers)."""
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1_v2(prediction: str, gold: str) -> float:
    """SQuAD v2.0 token F1: if either side is empty, 1.0 when both are, else 0.0."""
    pred_tokens = normalize_answer(prediction).split() if prediction else []
    gold_tokens = normalize_answer(gold).split() if gold else []
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    return token_f1(prediction, gold)


def _check_references(references: Mapping[str, Sequence[str]]) -> None:
    if not references:
        raise ValueError("no reference questions to score")
    for qid, golds in references.items():
        if isinstance(golds, str):
            raise ValueError(f"question {qid!r}: references must be a list of answer strings, not one string")


def squad_v1_scores(predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]) -> dict:
    """SQuAD v1.1 EM and F1 (percent) over every reference question.

    Args:
        predictions: ``{question id: predicted answer text}``.
        references: ``{question id: [gold answer texts]}``; each needs at least one answer.

    Returns:
        ``{"exact_match", "f1", "total", "missing"}``.
    """
    _check_references(references)
    em = f1 = 0.0
    missing = 0
    for qid, golds in references.items():
        if not golds:
            raise ValueError(
                f"question {qid!r} has no gold answer (SQuAD v1.1 needs one; use squad_v2_scores)"
            )
        if qid not in predictions:
            missing += 1
            continue
        pred = predictions[qid]
        em += max(exact_match(pred, g) for g in golds)
        f1 += max(token_f1(pred, g) for g in golds)
    total = len(references)
    return {"exact_match": 100.0 * em / total, "f1": 100.0 * f1 / total, "total": total, "missing": missing}


def squad_v2_raw_scores(
    predictions: Mapping[str, str], references: Mapping[str, Sequence[str]]
) -> tuple[dict[str, float], dict[str, float], dict[str, bool]]:
    """Per-question EM and F1 (0/1 and 0..1) plus whether each question has an answer."""
    _check_references(references)
    exact: dict[str, float] = {}
    f1: dict[str, float] = {}
    has_answer: dict[str, bool] = {}
    for qid, golds in references.items():
        gold_texts = [g for g in golds if normalize_answer(g)] or [""]
        has_answer[qid] = bool(golds)
        if qid not in predictions:
            exact[qid] = f1[qid] = 0.0
            continue
        pred = predictions[qid]
        exact[qid] = max(exact_match(pred, g) for g in gold_texts)
        f1[qid] = max(token_f1_v2(pred, g) for g in gold_texts)
    return exact, f1, has_answer


def _best_threshold(
    predictions: Mapping[str, str],
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    has_answer: Mapping[str, bool],
) -> tuple[float, float]:
    """Sweep the no-answer threshold over the sorted na_probs; keep the best total score (official rule)."""
    current = best = float(sum(1 for v in has_answer.values() if not v))
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            current += scores[qid]
        elif qid not in predictions or predictions[qid]:  # answered (or missing, scored 0) though none exists
            current -= 1
        if current > best:
            best, best_thresh = current, na_probs[qid]
    return 100.0 * best / len(scores), best_thresh


def squad_v2_scores(
    predictions: Mapping[str, str],
    references: Mapping[str, Sequence[str]],
    na_probs: Mapping[str, float] | None = None,
    na_prob_thresh: float = 1.0,
) -> dict:
    """SQuAD v2.0 EM and F1 (percent), split into HasAns / NoAns, with the best no-answer threshold.

    Args:
        predictions: ``{question id: answer text}``; ``""`` means "no answer".
        references: ``{question id: [gold texts]}``; an empty list marks an unanswerable question.
        na_probs: optional ``{question id: probability of no answer}``; questions
            above ``na_prob_thresh`` are treated as answered with "".  When given,
            ``best_exact``/``best_f1`` and their thresholds are reported — choose
            the threshold on dev, then apply it on test.
        na_prob_thresh: the threshold applied to ``na_probs``.

    Returns:
        ``{"exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total",
        "NoAns_exact", "NoAns_f1", "NoAns_total", "missing"}`` plus the ``best_*`` keys with ``na_probs``.
    """
    exact_raw, f1_raw, has_answer = squad_v2_raw_scores(predictions, references)
    probs = (
        {qid: float(na_probs.get(qid, 0.0)) for qid in references}
        if na_probs
        else dict.fromkeys(references, 0.0)
    )

    def thresholded(raw: dict[str, float]) -> dict[str, float]:
        return {q: (float(not has_answer[q]) if probs[q] > na_prob_thresh else s) for q, s in raw.items()}

    exact, f1 = thresholded(exact_raw), thresholded(f1_raw)
    out: dict = {
        "exact": 100.0 * sum(exact.values()) / len(exact),
        "f1": 100.0 * sum(f1.values()) / len(f1),
        "total": len(exact),
    }
    for prefix, want in (("HasAns", True), ("NoAns", False)):
        ids = [q for q, h in has_answer.items() if h == want]
        if ids:
            out[f"{prefix}_exact"] = 100.0 * sum(exact[q] for q in ids) / len(ids)
            out[f"{prefix}_f1"] = 100.0 * sum(f1[q] for q in ids) / len(ids)
        out[f"{prefix}_total"] = len(ids)
    out["missing"] = sum(1 for q in references if q not in predictions)
    if na_probs:
        out["best_exact"], out["best_exact_thresh"] = _best_threshold(
            predictions, exact_raw, probs, has_answer
        )
        out["best_f1"], out["best_f1_thresh"] = _best_threshold(predictions, f1_raw, probs, has_answer)
    return out
