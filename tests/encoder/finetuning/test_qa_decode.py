"""QA decoding: the worked example of docs/architecture.md ("Heads"), windows with doc stride, spans across windows, no-answer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.encoder import task_fixtures
from twotower.encoder.core.tokenizer import Tokenizer
from twotower.encoder.finetuning.qa_decode import (
    QAPrediction,
    best_span,
    choose_null_threshold,
    decode_predictions,
    make_windows,
    span_f1,
)
from twotower.encoder.finetuning.task_examples import QAExample, check_qa_examples


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer.from_pretrained(task_fixtures.tiny_encoder(tmp_path_factory))


def test_worked_example_exact():
    assert best_span([0, 0, 0, 4, 1, -2], [0, 0, 0, 1, 5, -2], max_answer_length=3) == (9, 3, 4)


def _brute(s, e, max_len, allowed):
    best = None
    for i, j in itertools.product(range(len(s)), repeat=2):
        if i <= j < i + max_len and allowed[i] and allowed[j]:
            if best is None or s[i] + e[j] > best[0]:
                best = (s[i] + e[j], i, j)
    return best


def test_best_span_equals_brute_force_with_constraints():
    rng = np.random.default_rng(0)
    for _ in range(200):
        T = int(rng.integers(1, 15))
        s, e = rng.normal(size=T), rng.normal(size=T)
        allowed = rng.random(T) < 0.7
        max_len = int(rng.integers(1, 6))
        got, want = best_span(s, e, max_len, allowed), _brute(s, e, max_len, allowed)
        if want is None:
            assert got is None
        else:
            assert got[1:] == want[1:] and got[0] == pytest.approx(want[0])
            assert got[1] <= got[2] and got[2] - got[1] + 1 <= max_len


def test_best_span_never_picks_disallowed_even_when_it_scores_highest():
    s, e = [10.0, 0, 0, 1], [10.0, 0, 2, 0]
    assert best_span(s, e, 3, allowed=[False, True, True, True]) == (2.0, 1, 2)


CONTEXT = ("The tower was built in 1889 for the world fair. It is in Paris, the capital of France. "
           "The river flows north through the valley. Many people live in the city.")


def _example(qid="q", question="when was the tower built", answer="Paris"):
    return QAExample(qid, question, CONTEXT, [(answer, CONTEXT.index(answer))])


def test_windows_overlap_by_doc_stride_and_map_back_to_the_context(tok):
    ex = _example()
    windows = make_windows(tok, [ex], max_length=24, doc_stride=6, with_targets=True)
    assert len(windows) > 2
    full = tok.encode([CONTEXT], max_length=10**6).offsets[0][1:-1]
    q_len = sum(o is None for o in windows[0].context_offsets) - 1  # [CLS] q [SEP] ... [SEP]
    spans = []
    for w in windows:
        assert len(w.input_ids) <= 24 and w.input_ids[0] == tok.cls_id and w.input_ids[-1] == tok.sep_id
        ctx = [o for o in w.context_offsets if o is not None]
        assert w.token_type_ids.count(1) == len(ctx) + 1
        assert ctx == [tuple(o) for o in full[full.index(ctx[0]):full.index(ctx[0]) + len(ctx)]]
        spans.append((full.index(ctx[0]), full.index(ctx[0]) + len(ctx)))
        assert sum(o is None for o in w.context_offsets) - 1 == q_len
    assert spans[0][0] == 0 and spans[-1][1] == len(full)
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 - b0 == 6  # consecutive windows share doc_stride tokens
    # targets: windows holding the whole answer point at it, the others at [CLS]
    hits = [w for w in windows if w.start > 0]
    assert hits, "some window must contain the answer"
    for w in hits:
        c0, c1 = w.context_offsets[w.start][0], w.context_offsets[w.end][1]
        assert CONTEXT[c0:c1] == "Paris"
    assert all((w.start, w.end) == (0, 0) for w in windows if w not in hits)


def test_decode_picks_the_best_window_and_returns_character_offsets(tok):
    ex = _example(answer="the capital of France")
    windows = make_windows(tok, [ex], max_length=24, doc_stride=6, with_targets=True)
    target = [k for k, w in enumerate(windows) if w.start > 0][-1]
    starts, ends = [], []
    for k, w in enumerate(windows):
        s, e = np.zeros(len(w.input_ids)), np.zeros(len(w.input_ids))
        s[0] = e[0] = -5.0  # [CLS]: no-answer score
        if k == target:
            s[w.start], e[w.end] = 3.0, 4.0
        else:  # a decoy in a question position, which must never be chosen
            s[1], e[1] = 50.0, 50.0
        starts.append(s)
        ends.append(e)
    (pred,) = decode_predictions([ex], windows, starts, ends, max_answer_length=10)
    assert pred.text == "the capital of France" and CONTEXT[pred.start:pred.end] == pred.text
    assert pred.score == pytest.approx(7.0) and pred.null_score == pytest.approx(-10.0)
    assert not pred.no_answer


def test_span_widens_to_whole_words(tok):
    ex = QAExample("q", "who", "unbelievable performance", [])
    (w,) = make_windows(tok, [ex], max_length=30, doc_stride=4)
    pieces = [k for k, o in enumerate(w.context_offsets) if o is not None]
    assert len(pieces) > 2, "the tiny vocabulary must split 'unbelievable'"
    s, e = np.zeros(len(w.input_ids)), np.zeros(len(w.input_ids))
    s[pieces[1]] = e[pieces[1]] = 5.0  # a span inside the first word
    (pred,) = decode_predictions([ex], [w], [s], [e], 5)
    assert pred.text == "unbelievable"


def test_no_answer_threshold_from_dev():
    exs = [QAExample(f"q{i}", "q", "some context here", [("context", 5)] if i % 2 else []) for i in range(6)]
    # answerable questions have a low null - span difference, unanswerable ones a high one
    diffs = [3.0, -2.0, 4.0, -1.0, 2.0, 0.5]
    preds = [QAPrediction(ex.id, "context", 5, 12, 1.0, 1.0 + d) for ex, d in zip(exs, diffs)]
    t = choose_null_threshold(preds, exs)
    assert 0.5 < t < 2.0  # midpoint between the largest answerable diff and the smallest unanswerable one
    assert t == pytest.approx(1.25)
    for p, ex in zip(preds, exs):
        p.no_answer = p.score_diff > t
        assert span_f1(p, ex) == 1.0


def test_threshold_is_none_without_unanswerable_dev_questions():
    exs = [QAExample("a", "q", "some context", [("context", 5)])]
    assert choose_null_threshold([QAPrediction("a", "context", 5, 12, 1.0, 9.0)], exs) is None


def test_decode_applies_the_threshold(tok):
    ex = _example()
    windows = make_windows(tok, [ex], max_length=64, doc_stride=8)
    s = [np.zeros(len(w.input_ids)) for w in windows]
    e = [np.zeros(len(w.input_ids)) for w in windows]
    for a in s:
        a[0] = 3.0  # null score 3 + 0 = 3 vs best span 0: diff 3
    assert decode_predictions([ex], windows, s, e, 5, null_threshold=2.0)[0].no_answer
    assert not decode_predictions([ex], windows, s, e, 5, null_threshold=4.0)[0].no_answer
    assert not decode_predictions([ex], windows, s, e, 5, null_threshold=None)[0].no_answer


def test_bad_qa_input_is_reported_with_its_source(tok):
    bad = QAExample("q7", "who", "Paris is big", [("Paris", 3)], source="dev.json: data[0].paragraphs[2].qas[1]")
    with pytest.raises(ValueError, match=r"dev.json: data\[0\].paragraphs\[2\].qas\[1\]: question 'q7': answer "
                                         r"'Paris' is not at character 3"):
        check_qa_examples([bad])
    with pytest.raises(ValueError, match="empty context"):
        check_qa_examples([QAExample("q", "who", " ", [])])
    with pytest.raises(ValueError, match="must exceed doc_stride"):
        make_windows(tok, [_example()], max_length=16, doc_stride=12)
