"""SST-2 dev split of whole held-out sentences, with none of their labelled pieces left in train.

GLUE's SST-2 train set is every sentence of the treebank's train split *and every sub-phrase of it* (67,349
rows), and ``../shared/data/sst2`` cut those rows 90/10 at random into train.tsv and dev.tsv.  So a dev row is
nearly always a span of a train row (5,969 of 6,735, 88.6 %; ``main`` below prints it), labelled from the same
parse tree: dev accuracy rewards remembering phrases, which a randomly initialised model does as well as a
pretrained one.
Test (GLUE dev) is 872 whole sentences none of which occurs in train or dev.  Choices made on the phrase dev
did not carry over to test in the earlier pretraining-gain runs (docs/results.md describes this split).

``sentence_dev`` makes dev the whole sentences of dev.tsv — rows that are not a span of any other row of
train.tsv or dev.tsv (678 of them, 19.9 words on average; test: 19.5) — and drops from train every row that is
a span of one of them (60,614 -> 54,129 rows), so no piece of a dev sentence is trained on with its label.
The sentences come from dev.tsv, not train.tsv, because the pretraining text of ``dapt_movie_text.py`` holds
train.tsv's text: a dev sentence's whole text was never pretrained on, though some of its sub-phrases were
(as train.tsv phrases).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

T = TypeVar("T")


def spans(words: Sequence[str]) -> Iterator[tuple[str, ...]]:
    """Every contiguous run of ``words``, the whole included."""
    n = len(words)
    for i in range(n):
        for j in range(i + 1, n + 1):
            yield tuple(words[i:j])


def sentence_dev(train: list[T], dev: list[T], text=lambda e: e.text) -> tuple[list[T], list[T]]:
    """(train rows that are no span of a dev sentence, dev rows that are whole sentences).

    Rows compare as whitespace-split words (SST-2 is pre-tokenised), so "good" is not a span of "goods".
    """
    words = [tuple(text(e).split()) for e in train + dev]
    inside = {s for w in words for s in spans(w) if len(s) < len(w)}  # proper spans of some row
    whole = [(e, w) for e, w in zip(dev, words[len(train):]) if w and w not in inside]
    pieces = {s for _, w in whole for s in spans(w)}
    kept = [e for e, w in zip(train, words[:len(train)]) if w not in pieces]
    return kept, [e for e, _ in whole]


def main() -> None:
    """Print the overlap figures quoted above and in docs/results.md.

        .venv/bin/python benchmarks/sst2_splits.py
    """
    import argparse
    import os
    import statistics

    from tasks_common import DEFAULT_DATA

    from twotower.eval.tasks import read_text_examples

    ap = argparse.ArgumentParser(description="overlap between SST-2 train, dev and test rows")
    ap.add_argument("--data", default=DEFAULT_DATA)
    d = os.path.join(ap.parse_args().data, "sst2")
    train, dev, test = (read_text_examples(os.path.join(d, f)) for f in ("train.tsv", "dev.tsv", "test.tsv"))
    train_spans = {s for e in train for s in spans(tuple(e.text.split()))}
    in_train = sum(tuple(e.text.split()) in train_spans for e in dev)
    rows = {tuple(e.text.split()) for e in train + dev}
    kept, sentences = sentence_dev(train, dev)
    print(f"dev rows that are a span of a train row: {in_train} / {len(dev)} ({in_train / len(dev):.1%})")
    print(f"test sentences that are a train or dev row: {sum(tuple(e.text.split()) in rows for e in test)} / {len(test)}")
    print(f"whole dev sentences: {len(sentences)}, {statistics.mean(len(e.text.split()) for e in sentences):.1f} words "
          f"on average (test {statistics.mean(len(e.text.split()) for e in test):.1f}); train rows kept {len(kept)} "
          f"/ {len(train)}")


if __name__ == "__main__":
    main()
