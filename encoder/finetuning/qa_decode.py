"""Extractive QA around the model: question + context -> overlapping windows -> best character span.

Why windows: a context longer than the model's maximum length is not
unanswerable, its answer is merely cut off by truncation (docs/architecture.md, "Heads").  So the
context is cut into windows of at most ``max_length`` tokens (with the
question in front of each) that overlap by ``doc_stride`` tokens, every
window is scored, and the best span over all windows wins.  ``doc_stride`` is
the *overlap*, as in HF tokenizers' ``stride`` (the window cutting is shared with tagging:
``encoder/finetuning/windows.py``).

Why a threshold: the highest-scoring span is not necessarily an answer.  The
[CLS] position's start+end score is the model's "no answer" score; when it
beats the best span by more than a threshold chosen on dev, the prediction is
"no answer" (SQuAD 2.0, Devlin et al. 2019 sec. 4.3).  With every window
scored, the no-answer score of an example is its *smallest* [CLS] score over
windows (the window that saw the answer is the one that matters).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from twotower.encoder.core.tokenizer import Tokenizer
from twotower.encoder.finetuning.task_examples import QAExample
from twotower.encoder.finetuning.windows import window_spans

NEG_INF = float("-inf")


@dataclasses.dataclass
class QAWindow:
    """One model input: [CLS] question [SEP] context window [SEP]."""

    example: int  # index of the QAExample it came from
    input_ids: list[int]
    token_type_ids: list[int]
    context_offsets: list[tuple[int, int] | None]  # per position: character span in the context, None elsewhere
    context_words: list[int | None] = dataclasses.field(default_factory=list)  # pre-tokenizer word id per position
    start: int = 0  # training targets; 0 ([CLS]) when the answer is not inside this window
    end: int = 0


@dataclasses.dataclass
class QAPrediction:
    """The best span of one question (over all windows) and the no-answer decision.

    ``text``/``start``/``end``/``score`` describe the best span even when the
    prediction is "no answer", so a threshold can be re-chosen without
    re-running the model.  ``answer`` is what a user should see.
    """

    id: str
    text: str
    start: int  # character offsets in the context, end exclusive; -1 when no span was possible
    end: int
    score: float  # start + end logit of the best span
    null_score: float  # smallest [CLS] start + end logit over the windows
    no_answer: bool = False

    @property
    def answer(self) -> str:
        return "" if self.no_answer else self.text

    @property
    def score_diff(self) -> float:
        """null_score - span score: "no answer" is predicted when this exceeds the threshold."""
        return self.null_score - self.score


def make_windows(
    tokenizer: Tokenizer,
    examples: Sequence[QAExample],
    max_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    with_targets: bool = False,
) -> list[QAWindow]:
    """Cut each (question, context) into windows; with targets, mark the first answer's token span.

    A question longer than ``max_query_length`` tokens is truncated.  Windows
    overlap by ``doc_stride`` tokens; a window that does not contain the whole
    answer is trained to point at [CLS] (as BERT's run_squad does).
    """
    if not examples:
        return []
    questions = tokenizer.encode([ex.question for ex in examples], max_length=max_query_length + 2)
    # Contexts are tokenized whole (no truncation) and cut into windows here.
    contexts = tokenizer.encode([ex.context for ex in examples], max_length=10**8)
    windows: list[QAWindow] = []
    for i, ex in enumerate(examples):
        q_len = len(questions.offsets[i])
        q_ids = questions.input_ids[i, 1:q_len - 1].tolist()  # without [CLS] / [SEP]
        n_ctx = len(contexts.offsets[i]) - 2
        c_ids = contexts.input_ids[i, 1:n_ctx + 1].tolist()
        c_off = [tuple(o) for o in contexts.offsets[i][1:n_ctx + 1]]
        c_words = list(contexts.word_ids[i][1:n_ctx + 1])
        room = max_length - len(q_ids) - 3
        if room <= doc_stride:
            raise ValueError(
                f"max_length={max_length} leaves {room} context tokens after a {len(q_ids)}-token question; "
                f"that must exceed doc_stride={doc_stride}"
            )
        span = _answer_tokens(ex, c_off) if with_targets and ex.answers else None
        prefix = len(q_ids) + 2
        for first, last in window_spans(n_ctx, room, doc_stride):  # window covers context tokens [first, last)
            ids = [tokenizer.cls_id, *q_ids, tokenizer.sep_id, *c_ids[first:last], tokenizer.sep_id]
            types = [0] * prefix + [1] * (last - first + 1)
            offs: list[tuple[int, int] | None] = [None] * prefix + list(c_off[first:last]) + [None]
            words = [None] * prefix + c_words[first:last] + [None]
            start = end = 0
            if span is not None and first <= span[0] and span[1] < last:
                start, end = prefix + span[0] - first, prefix + span[1] - first
            windows.append(QAWindow(i, ids, types, offs, words, start, end))
    return windows


def _answer_tokens(ex: QAExample, offsets: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """Context-token span (inclusive) covering the first answer, or None if no token covers it."""
    text, start_char = ex.answers[0]
    end_char = start_char + len(text)
    starts = [s for s, _ in offsets]
    ends = [e for _, e in offsets]
    ts = bisect.bisect_right(starts, start_char) - 1  # last token starting at or before the answer
    te = bisect.bisect_left(ends, end_char)  # first token ending at or after it
    if ts < 0 or te >= len(offsets) or ts > te:
        return None
    if offsets[ts][1] <= start_char:  # answer starts in the gap after a token
        ts += 1
    return (ts, te) if ts <= te else None


def best_span(
    start_logits: Sequence[float] | np.ndarray,
    end_logits: Sequence[float] | np.ndarray,
    max_answer_length: int,
    allowed: Sequence[bool] | np.ndarray | None = None,
) -> tuple[float, int, int] | None:
    """The allowed span (start <= end, end - start + 1 <= max_answer_length) maximising start + end.

    Returns ``(score, start, end)`` with ``end`` inclusive, or None when no
    position is allowed.  Exact (not an n-best heuristic): every band of
    widths ``0 .. max_answer_length - 1`` is scanned, O(T * max_answer_length).

    Example (docs/architecture.md, "Heads"):
        >>> best_span([0, 0, 0, 4, 1, -2], [0, 0, 0, 1, 5, -2], max_answer_length=3)
        (9.0, 3, 4)
    """
    s = np.asarray(start_logits, dtype=np.float64)  # (T,)
    e = np.asarray(end_logits, dtype=np.float64)  # (T,)
    T = s.shape[0]
    ok = np.ones(T, dtype=bool) if allowed is None else np.asarray(allowed, dtype=bool)
    if max_answer_length < 1:
        raise ValueError(f"max_answer_length must be >= 1, got {max_answer_length}")
    best: tuple[float, int, int] | None = None
    for width in range(min(max_answer_length, T)):
        cand = s[:T - width] + e[width:]  # (T - width,) score of span (i, i + width)
        valid = ok[:T - width] & ok[width:]
        if not valid.any():
            continue
        cand = np.where(valid, cand, NEG_INF)
        i = int(np.argmax(cand))
        if best is None or cand[i] > best[0] or (cand[i] == best[0] and i < best[1]):
            best = (float(cand[i]), i, i + width)
    return best


def decode_predictions(
    examples: Sequence[QAExample],
    windows: Sequence[QAWindow],
    start_logits: Sequence[np.ndarray],
    end_logits: Sequence[np.ndarray],
    max_answer_length: int = 30,
    null_threshold: float | None = None,
) -> list[QAPrediction]:
    """Best span per example over its windows; "no answer" when null - span score > ``null_threshold``.

    ``start_logits[k]`` / ``end_logits[k]`` are window k's scores, (T_k,) each.
    ``null_threshold=None`` never answers "no answer".
    """
    best: list[tuple[float, int, int, int] | None] = [None] * len(examples)  # (score, window, start, end)
    null = [float("inf")] * len(examples)
    for k, w in enumerate(windows):
        s, e = np.asarray(start_logits[k]), np.asarray(end_logits[k])
        allowed = [o is not None for o in w.context_offsets]
        span = best_span(s[:len(allowed)], e[:len(allowed)], max_answer_length, allowed)
        null[w.example] = min(null[w.example], float(s[0] + e[0]))
        if span is not None and (best[w.example] is None or span[0] > best[w.example][0]):
            best[w.example] = (span[0], k, span[1], span[2])
    preds = []
    for i, ex in enumerate(examples):
        if best[i] is None:  # nothing to point at (empty context): only "no answer" is possible
            preds.append(QAPrediction(ex.id, "", -1, -1, NEG_INF, null[i], no_answer=True))
            continue
        score, k, a, b = best[i]
        a, b = _whole_words(windows[k], a, b)
        c0 = windows[k].context_offsets[a][0]  # type: ignore[index]
        c1 = windows[k].context_offsets[b][1]  # type: ignore[index]
        pred = QAPrediction(ex.id, ex.context[c0:c1], c0, c1, score, null[i])
        pred.no_answer = null_threshold is not None and pred.score_diff > null_threshold
        preds.append(pred)
    return preds


def _whole_words(w: QAWindow, a: int, b: int) -> tuple[int, int]:
    """Widen a token span to whole pre-tokenizer words ("##ows nor" -> "flows north"), as BERT's run_squad
    does by mapping WordPiece spans back to the original words; never past the window's context."""
    if not w.context_words:
        return a, b
    while a > 0 and w.context_words[a - 1] is not None and w.context_words[a - 1] == w.context_words[a]:
        a -= 1
    last = len(w.context_words) - 1
    while b < last and w.context_words[b + 1] is not None and w.context_words[b + 1] == w.context_words[b]:
        b += 1
    return a, b


def span_f1(pred: QAPrediction, ex: QAExample) -> float:
    """Character-overlap F1 of the predicted span against the best-matching gold span.

    A proxy for SQuAD token F1 that needs no text normalisation; used to pick
    epochs and thresholds inside the encoder (report SQuAD EM/F1 with
    ``twotower.eval.metrics.qa``).  Unanswerable gold: 1 for "no answer", else 0.
    """
    if ex.is_impossible:
        return float(pred.no_answer)
    if pred.no_answer or pred.start < 0:
        return 0.0
    best = 0.0
    for text, start in ex.answers:
        overlap = max(0, min(pred.end, start + len(text)) - max(pred.start, start))
        if overlap:
            p, r = overlap / (pred.end - pred.start), overlap / len(text)
            best = max(best, 2 * p * r / (p + r))
    return best


def span_exact(pred: QAPrediction, ex: QAExample) -> float:
    """1 when the predicted span equals a gold span character for character (or both are "no answer")."""
    if ex.is_impossible:
        return float(pred.no_answer)
    return float(not pred.no_answer and any(pred.start == s and pred.end == s + len(t) for t, s in ex.answers))


def span_scores(preds: Sequence[QAPrediction], examples: Sequence[QAExample]) -> dict[str, float]:
    """Mean character-span exact match and F1 (fractions in [0, 1])."""
    n = max(1, len(examples))
    return {
        "span_exact": sum(span_exact(p, ex) for p, ex in zip(preds, examples)) / n,
        "span_f1": sum(span_f1(p, ex) for p, ex in zip(preds, examples)) / n,
    }


def choose_null_threshold(
    preds: Sequence[QAPrediction],
    examples: Sequence[QAExample],
    answer_value: Callable[[QAPrediction, QAExample], float] | None = None,
) -> float | None:
    """The threshold on ``score_diff`` maximising the dev score (SQuAD 2.0's best-threshold search).

    Each question is worth ``answer_value`` (default: :func:`span_f1` of the
    span, 0 for an unanswerable one) when answered, and 1 / 0 when "no
    answer" is predicted for an unanswerable / answerable one.  Sorting by
    ``score_diff`` makes every cut a candidate; the threshold is the midpoint
    of the best cut.  Returns None (never "no answer") when answering
    everything scores best, and when dev has no unanswerable question: such a
    dev set carries no evidence for abstaining.
    """
    if len(preds) != len(examples):
        raise ValueError(f"{len(preds)} predictions for {len(examples)} examples")
    if not any(ex.is_impossible for ex in examples):
        return None
    value = answer_value or (lambda p, ex: span_f1(dataclasses.replace(p, no_answer=False), ex))
    items = sorted(zip(preds, examples), key=lambda pe: pe[0].score_diff)
    diffs = [p.score_diff for p, _ in items]
    # cut k: the k smallest diffs are answered, the rest abstain.
    total = sum(1.0 for _, ex in items if ex.is_impossible)  # k = 0: all abstain
    best_total, best_k = total, 0
    for k, (p, ex) in enumerate(items, start=1):
        total += (0.0 if ex.is_impossible or p.start < 0 else value(p, ex)) - float(ex.is_impossible)
        if total > best_total:
            best_total, best_k = total, k
    if best_k == len(items):
        return None
    if best_k == 0:
        return diffs[0] - 1.0
    return (diffs[best_k - 1] + diffs[best_k]) / 2.0
