"""Tagging a sentence longer than max_length: overlapping windows, each word read where it has the most context.

Checked against plain reference implementations written here: the windows as a list comprehension, the
max-context rule as a max over the windows holding the word, and the model run on each window alone (no
batching, no padding).  And, exactly, with a model that reads no context (attention output and position
embeddings zeroed): its windowed predictions equal those made with a max_length that holds the whole sentence.
"""

from __future__ import annotations

import random

import pytest
import torch

from twotower.encoder.finetuning.tagging import IGNORE_INDEX
from twotower.encoder.finetuning.task_examples import TagExample
from twotower.encoder.finetuning.task_model import TaskModel
from twotower.encoder.finetuning.tasks import TaskInfo, get_task
from twotower.encoder.finetuning.windows import max_context_owners, tag_window, window_spans

LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]
# whole words and words the tiny vocabulary splits into pieces ("unbelievable", "@paulwalk", "1889")
WORDS = ["john", "smith", "lives", "in", "new", "york", "the", "tea", "is", "cold", "unbelievable", "performance",
         "@paulwalk", "capital", "france", "1889", "loves", "#music", "emojis", ",", "."]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py


def _sentences(seed: int, count: int, most: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[rng.choice(WORDS) for _ in range(rng.randint(1, most))] for _ in range(count)]


def _model(tiny_dir: str, seed: int = 0) -> TaskModel:
    tm = TaskModel.from_encoder(tiny_dir, TaskInfo("tag", LABELS, max_length=96), seed=seed)
    tm.model.eval()
    return tm


def _predict(tm: TaskModel, sentences, max_length: int, doc_stride: int | None) -> list[list[str]]:
    tm.info.max_length, tm.info.doc_stride = max_length, doc_stride
    return [p.tags for p in tm.predict([TagExample(w) for w in sentences], batch_size=7)]


def _plain_windows(n: int, room: int, overlap: int) -> list[tuple[int, int]]:
    """Windows start every room - overlap tokens; a window is there when the one before did not reach the end."""
    step = room - overlap
    return [(a, min(a + room, n)) for a in range(0, max(n, 1), step) if a == 0 or a - step + room < n]


def _plain_owner(windows, t: int) -> int:
    """The window holding token t farthest from its nearer edge; ties: the longer window, then the earlier."""
    holding = [k for k, (a, b) in enumerate(windows) if a <= t < b]
    return max(holding, key=lambda k: (min(t - windows[k][0], windows[k][1] - 1 - t),
                                       windows[k][1] - windows[k][0], -k))


def _first_tokens(tm: TaskModel, words: list[str]) -> tuple[list[int], list[int]]:
    """The sentence's token ids (no [CLS]/[SEP]) and the index of each word's first token."""
    enc = tm.tokenizer.encode([" ".join(words)], max_length=10**6)
    offsets = enc.offsets[0][1:-1]
    starts = [sum(len(w) + 1 for w in words[:i]) for i in range(len(words))]
    first = [next(k for k, (s, _) in enumerate(offsets) if s >= start) for start in starts]
    return enc.input_ids[0, 1:-1].tolist(), first


@torch.no_grad()
def _reference_tags(tm: TaskModel, words: list[str], max_length: int, overlap: int) -> tuple[list[str], int]:
    """Each window run alone; each word tagged from its max-context window. Also: how many windows."""
    tokens, first = _first_tokens(tm, words)
    windows = _plain_windows(len(tokens), max_length - 2, overlap)
    tok = tm.tokenizer
    logits = [tm.model(torch.tensor([[tok.cls_id, *tokens[a:b], tok.sep_id]]))[0] for a, b in windows]
    tags = []
    for t in first:
        k = _plain_owner(windows, t)
        tags.append(LABELS[int(logits[k][t - windows[k][0] + 1].argmax())])
    return tags, len(windows)


# ---- the window arithmetic --------------------------------------------------------------------------------


def test_window_spans_and_max_context_owners_equal_the_plain_rule():
    for n in range(0, 40):
        for room in range(1, 12):
            for overlap in range(room):
                spans = window_spans(n, room, overlap)
                assert spans == _plain_windows(n, room, overlap), (n, room, overlap)
                assert all(b - a <= room for a, b in spans) and spans[-1][1] == n
                assert max_context_owners(spans, n) == [_plain_owner(spans, t) for t in range(n)]
    with pytest.raises(ValueError, match="overlap must be"):
        window_spans(10, 4, 4)


def test_the_default_overlap_is_half_a_window_at_most_128():
    assert tag_window(128, None) == (63, 126)
    assert tag_window(512, None) == (128, 510)
    assert tag_window(3, None) == (0, 1)  # one token a window: no overlap
    assert tag_window(32, 5) == (5, 30)


# ---- featurizing: rows, labels, where each word is read ---------------------------------------------------


def test_long_sentences_become_windows_and_each_word_is_labelled_once_where_it_is_read(tiny_dir):
    tm = _model(tiny_dir)
    rng = random.Random(3)
    sentences = _sentences(1, 40, 30)
    examples = [TagExample(w, [rng.choice(LABELS) for _ in w]) for w in sentences]
    index = {label: i for i, label in enumerate(LABELS)}
    for max_length, overlap in ((8, None), (8, 0), (11, 8), (96, None)):
        info = TaskInfo("tag", LABELS, max_length=max_length, doc_stride=overlap)
        feats = get_task("tag").featurize(tm.tokenizer, examples, info, with_targets=True)
        stride, room = tag_window(max_length, overlap)
        assert len(feats) == sum(len(p.rows) for p in feats.aux)
        for ex, place in zip(examples, feats.aux):
            tokens, first = _first_tokens(tm, ex.words)
            windows = _plain_windows(len(tokens), room, stride)
            assert len(place.rows) == len(windows)
            for row, (a, b) in zip(place.rows, windows):
                assert feats.input_ids[row] == [tm.tokenizer.cls_id, *tokens[a:b], tm.tokenizer.sep_id]
                assert len(feats.input_ids[row]) <= max_length
            # each word: read in its max-context window, at its first token, and labelled there and only there
            expected = [(place.rows[_plain_owner(windows, t)], t - windows[_plain_owner(windows, t)][0] + 1)
                        for t in first]
            assert place.words == expected
            labelled = sorted((r, p, y) for r in place.rows for p, y in enumerate(feats.targets[r])
                              if y != IGNORE_INDEX)
            assert labelled == sorted((r, p, index[tag]) for (r, p), tag in zip(expected, ex.tags))
    short = [ex for ex in examples if len(_first_tokens(tm, ex.words)[0]) <= 94]
    feats = get_task("tag").featurize(tm.tokenizer, short, TaskInfo("tag", LABELS, max_length=96), True)
    batch = tm.tokenizer.encode([" ".join(ex.words) for ex in short], max_length=96)
    for k in range(len(short)):  # a sentence that fits is one row, as it always was
        assert feats.input_ids[k] == batch.input_ids[k, :int(batch.attention_mask[k].sum())].tolist()


# ---- predictions ------------------------------------------------------------------------------------------


def test_windowed_predictions_equal_a_plain_max_context_reference(tiny_dir):
    """A model that reads context: every word of a long sentence is tagged from its max-context window,
    word for word as the reference that runs each window alone (the old code tagged words past max_length O)."""
    tm = _model(tiny_dir, seed=1)
    sentences = _sentences(2, 30, 40)
    past_first_window = 0
    for max_length, overlap in ((6, None), (9, 3), (12, 0), (12, 9)):
        stride, _ = tag_window(max_length, overlap)
        got = _predict(tm, sentences, max_length, overlap)
        for words, tags in zip(sentences, got):
            expected, n_windows = _reference_tags(tm, words, max_length, stride)
            assert tags == expected, (max_length, overlap, words)
            if n_windows > 1:
                tokens, first = _first_tokens(tm, words)
                past_first_window += sum(t >= max_length - 2 and tag != "O" for t, tag in zip(first, expected))
    assert past_first_window > 50  # words the old code tagged O unread carry real tags here


def test_a_model_that_reads_no_context_tags_long_sentences_as_if_it_saw_them_whole(tiny_dir):
    """Attention output and position embeddings zeroed: a word's logits depend on its own tokens only, so
    windowed predictions must equal, word for word, those made with a max_length holding the whole sentence."""
    tm = _model(tiny_dir, seed=2)
    with torch.no_grad():
        tm.model.bert.embeddings.position_embeddings.weight.zero_()
        for layer in tm.model.bert.encoder.layer:
            layer.attention.output.dense.weight.zero_()
            if layer.attention.output.dense.bias is not None:
                layer.attention.output.dense.bias.zero_()
    sentences = _sentences(4, 40, 30)
    whole = _predict(tm, sentences, 96, None)
    assert max(len(_first_tokens(tm, w)[0]) for w in sentences) <= 94  # 96 holds every sentence whole
    assert sum(t != "O" for tags in whole for t in tags[8:]) > 20  # late words with real tags
    for max_length, overlap in ((5, None), (8, 0), (8, 5), (20, None)):
        assert _predict(tm, sentences, max_length, overlap) == whole, (max_length, overlap)


def test_every_window_row_is_batched_with_the_others(tiny_dir, monkeypatch):
    """The windows of all sentences are rows of one featurized set, run in batches of batch_size rows."""
    tm = _model(tiny_dir)
    calls = []
    forward = tm.model.forward
    monkeypatch.setattr(tm.model, "forward", lambda *a, **k: calls.append(k["input_ids"].shape) or forward(*a, **k))
    sentences = _sentences(5, 12, 30)
    tm.info.max_length, tm.info.doc_stride = 8, None
    preds = tm.predict([TagExample(w) for w in sentences], batch_size=16)
    rows = sum(p.windows for p in preds)
    assert rows > len(sentences) and [p.windows > 1 for p in preds].count(True) > 6
    assert sum(shape[0] for shape in calls) == rows and len(calls) == -(-rows // 16)
    assert all(shape[1] <= 8 for shape in calls)
