"""The SST-2 sentence dev split: whole sentences only, and none of their pieces left in train."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from sst2_splits import sentence_dev, spans  # noqa: E402


def test_spans_are_every_contiguous_run():
    assert sorted(spans(("a", "b", "c"))) == sorted([("a",), ("b",), ("c",), ("a", "b"), ("b", "c"), ("a", "b", "c")])


def test_dev_keeps_whole_sentences_and_train_loses_their_pieces():
    train = ["the film is good", "good", "a dull plot", "dull", "goods", "the film"]
    dev = ["the film is good .",  # whole sentence: no other row contains it
           "is good",             # a piece of a train row: not a sentence
           "a dull plot twist",   # whole sentence
           "plot twist"]          # a piece of the dev sentence above
    kept, sentences = sentence_dev(train, dev, text=lambda e: e)
    assert sentences == ["the film is good .", "a dull plot twist"]
    # every train row that is a span of a dev sentence is gone; "goods" is a different word, not a span
    assert kept == ["goods"]


def test_a_train_row_containing_a_dev_row_makes_it_a_piece():
    kept, sentences = sentence_dev(["a b c d"], ["b c", "e f"], text=lambda e: e)
    assert sentences == ["e f"] and kept == ["a b c d"]
