"""Token tagging: first-sub-token labels and BIO decoding, checked against seqeval."""

from __future__ import annotations

import random

import pytest

from twotower.encoder.core.tokenizer import Tokenizer
from twotower.encoder.finetuning.tagging import (
    IGNORE_INDEX,
    bio_entities,
    entity_scores,
    first_subtokens,
    join_words,
    subtoken_labels,
)
from twotower.encoder.finetuning.task_examples import TagExample, check_tag_examples

seqeval = pytest.importorskip("seqeval")
from seqeval.metrics import f1_score, precision_score, recall_score  # noqa: E402
from seqeval.metrics.sequence_labeling import get_entities  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny_dir, one_thread: tests/conftest.py


def _random_tags(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(["O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "I-ORG"]) for _ in range(n)]


def test_bio_entities_equal_seqeval_on_random_sequences():
    rng = random.Random(0)
    for _ in range(500):
        tags = _random_tags(rng, rng.randint(1, 12))
        ours = [(t, s, e - 1) for t, s, e in bio_entities(tags)]  # seqeval's end is inclusive
        assert ours == get_entities(tags), tags


def test_entity_scores_equal_seqeval():
    rng = random.Random(1)
    gold = [_random_tags(rng, rng.randint(1, 15)) for _ in range(200)]
    pred = [[t if rng.random() < 0.8 else rng.choice(["O", "B-PER", "I-LOC"]) for t in g] for g in gold]
    s = entity_scores(gold, pred)
    assert s["f1"] == pytest.approx(f1_score(gold, pred), abs=1e-12)
    assert s["precision"] == pytest.approx(precision_score(gold, pred), abs=1e-12)
    assert s["recall"] == pytest.approx(recall_score(gold, pred), abs=1e-12)
    assert set(s["per_type"]) == {"PER", "LOC", "ORG"}


def test_bio_rejects_non_bio_tags():
    with pytest.raises(ValueError, match="not a BIO tag"):
        bio_entities(["E-PER"])


def test_first_subtoken_gets_the_label_the_rest_minus_100(tiny_dir):
    tok = Tokenizer.from_pretrained(tiny_dir)
    words = ["@paulwalk", "loves", "unbelievable", "music"]
    text, starts = join_words(words)
    assert [text[s:s + len(w)] for s, w in zip(starts, words)] == words
    batch = tok.encode([text])
    first = first_subtokens(starts, batch.offsets[0], batch.sequence_ids[0])
    # every word got a sub-token, in order, none of them [CLS]
    assert all(f > 0 for f in first) and first == sorted(first)
    # each word's first sub-token starts exactly at the word's first character
    assert [batch.offsets[0][f][0] for f in first] == starts
    labels = subtoken_labels(first, [3, 0, 1, 0], batch.input_ids.shape[1])
    assert [labels[f] for f in first] == [3, 0, 1, 0]
    assert sum(y != IGNORE_INDEX for y in labels) == len(words)
    assert len(batch.offsets[0]) > len(words) + 2  # some word was split, so some positions are -100


def test_bad_tag_examples_name_their_source():
    with pytest.raises(ValueError, match=r"train.conll:12: 3 tokens but 2 tags"):
        check_tag_examples([TagExample(["a", "b", "c"], ["O", "O"], "train.conll:12")], None, True)
    with pytest.raises(ValueError, match=r"dev.conll:40: tag 'B-new' of word 2 .* not in the label map"):
        check_tag_examples([TagExample(["a", "b"], ["O", "B-new"], "dev.conll:40")], ["O", "B-x"], True)
    with pytest.raises(ValueError, match="example 1: empty sentence"):
        check_tag_examples([TagExample([], [])], None, True)
