"""Entity-level tagging metrics against seqeval (conlleval mode), incl. malformed I- starts."""

from __future__ import annotations

import numpy as np
import pytest

from twotower.eval.metrics import get_entities, tagging_report


def test_get_entities_worked_example():
    tags = ["I-PER", "I-PER", "O", "B-LOC", "I-ORG", "I-ORG", "B-LOC", "B-LOC", "I-LOC"]
    assert get_entities(tags) == [("PER", 0, 1), ("LOC", 3, 3), ("ORG", 4, 5), ("LOC", 6, 6), ("LOC", 7, 8)]


def test_iobes():
    assert get_entities(["S-PER", "B-LOC", "E-LOC", "O", "E-ORG"]) == [
        ("PER", 0, 0),
        ("LOC", 1, 2),
        ("ORG", 4, 4),
    ]


def test_report_worked_example():
    y_true = [["O", "B-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    y_pred = [["B-MISC", "I-MISC", "I-MISC", "I-MISC", "O"], ["B-PER", "I-PER", "O"]]
    r = tagging_report(y_true, y_pred)
    assert (r.precision, r.recall, r.f1) == (0.5, 0.5, 0.5)
    assert r.per_type["MISC"]["f1"] == 0.0 and r.per_type["PER"]["f1"] == 1.0
    assert r.token_accuracy == pytest.approx(6 / 8)  # two tokens differ in the first sentence
    assert "MISC" in r.format()


def test_entities_do_not_cross_sentences():
    r = tagging_report([["B-PER"], ["I-PER"]], [["B-PER"], ["I-PER"]])
    assert r.num_true == 2


def test_shape_errors():
    with pytest.raises(ValueError, match="sentence 0"):
        tagging_report([["O", "O"]], [["O"]])
    with pytest.raises(ValueError, match="2 gold sentences"):
        tagging_report([["O"], ["O"]], [["O"]])


def _random_sentences(rng, n, types=("PER", "LOC", "ORG")):
    tags = ["O", "O", "O"] + [f"{p}-{t}" for p in ("B", "I") for t in types]
    return [[str(t) for t in rng.choice(tags, size=int(rng.integers(1, 15)))] for _ in range(n)]


def test_matches_seqeval_on_random_bio_sequences():
    seqeval = pytest.importorskip("seqeval.metrics")
    rng = np.random.default_rng(0)
    for _ in range(100):
        y_true = _random_sentences(rng, int(rng.integers(1, 12)))
        y_pred = [
            [
                t if rng.random() < 0.6 else str(rng.choice(["O", "B-PER", "I-PER", "I-LOC", "B-ORG"]))
                for t in sent
            ]
            for sent in y_true
        ]
        r = tagging_report(y_true, y_pred)
        assert r.precision == pytest.approx(seqeval.precision_score(y_true, y_pred, zero_division=0))
        assert r.recall == pytest.approx(seqeval.recall_score(y_true, y_pred, zero_division=0))
        assert r.f1 == pytest.approx(seqeval.f1_score(y_true, y_pred, zero_division=0))
        assert r.token_accuracy == pytest.approx(seqeval.accuracy_score(y_true, y_pred))
        ref = seqeval.classification_report(y_true, y_pred, output_dict=True, zero_division=0)
        for type_, values in r.per_type.items():
            assert values["precision"] == pytest.approx(ref[type_]["precision"])
            assert values["recall"] == pytest.approx(ref[type_]["recall"])
            assert values["f1"] == pytest.approx(ref[type_]["f1-score"])
            assert values["support"] == ref[type_]["support"]


def test_entity_extraction_matches_seqeval_get_entities():
    sequence_labeling = pytest.importorskip("seqeval.metrics.sequence_labeling")
    rng = np.random.default_rng(1)
    for sentence in _random_sentences(rng, 300):
        assert get_entities(sentence) == sequence_labeling.get_entities(sentence)
