"""Positive pairs from unlabeled text, for contrastive training of an encoder that has no labels yet.

Two recipes, both usable on any corpus:

* **Independent cropping** (Izacard et al. 2022, Contriever): two spans drawn
  independently from one document are a positive pair; spans of other documents
  in the batch are the negatives.  The spans may overlap, which keeps the task
  learnable at first; span length is a random 10%-50% of the document.
* **Inverse Cloze Task** (Lee et al. 2019, ORQA): a sentence is the query and
  the rest of its passage is the positive.  The sentence is left in its passage
  10% of the time, so the model also learns that lexical overlap matters.

The output is a `TrainingSet` (queries + positive ids over a corpus of the
generated texts), the same shape the supervised readers produce, so
`train_dual` takes it unchanged (see `write_pairs_jsonl`).  Too-short documents
are counted skips.

Example:
    >>> ts = independent_crops({"d1": "one two three four five six seven eight nine ten"}, seed=0)
    >>> len(ts.examples), len(ts.corpus)
    (1, 1)
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping

from twotower.common.atomic import atomic_path
from twotower.common.errors import check_setting
from twotower.retrieval.training.training_data import Skipped, TrainExample, TrainingSet, text_id

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(\[])")


def split_sentences(text: str) -> list[str]:
    """Sentences by terminal punctuation followed by a capital or digit (good enough for abstracts)."""
    return [s.strip() for s in _SENTENCE_END.split(text) if s.strip()]


def _crop(words: list[str], rng: random.Random, min_ratio: float, max_ratio: float, min_words: int) -> str:
    n = len(words)
    length = max(min_words, int(round(rng.uniform(min_ratio, max_ratio) * n)))
    length = min(length, n)
    start = rng.randrange(0, n - length + 1)
    return " ".join(words[start:start + length])


class _Pairs:
    """Generated (query, positive text) pairs collected into a `TrainingSet` whose corpus is the positives."""

    def __init__(self) -> None:
        self.skipped = Skipped()
        self.corpus: dict[str, str] = {}
        self.examples: list[TrainExample] = []

    def add(self, query_id: str, query: str, positive: str) -> None:
        pid = text_id(positive)
        self.corpus[pid] = positive
        self.examples.append(TrainExample(query_id, query, (pid,)))

    def training_set(self, source: str, none_made: str) -> TrainingSet:
        """The set; with no pair at all, a ValueError saying `none_made` and what was skipped."""
        if not self.examples:
            raise ValueError(f"{none_made} ({self.skipped.summary()})")
        return TrainingSet(self.examples, self.corpus, self.skipped, source)


def crop_count(words: int, min_ratio: float = 0.1, max_ratio: float = 0.5, min_words: int = 5) -> int:
    """At most how many distinct crops `_crop` draws from a document of `words` words: every (length, start)
    with a length it can choose (the rounded ratios, at least `min_words`, at most `words`).

    Why: a pair's query is one crop, so a document yields at most this many distinct queries; drawing
    more only repeats them, and ``pairs_per_document`` far beyond it (1e11) ran without end.

    Example:
        >>> crop_count(10), crop_count(40)
        (6, 456)
    """
    lo = min(words, max(min_words, int(round(min_ratio * words))))
    hi = min(words, max(min_words, int(round(max_ratio * words))))
    lengths = hi - lo + 1
    return lengths * (words + 1) - (lo + hi) * lengths // 2  # sum of words - length + 1 over the lengths


def max_crops(documents: Mapping[str, str], min_ratio: float = 0.1, max_ratio: float = 0.5,
              min_words: int = 5) -> tuple[int, int]:
    """(distinct crops, words) of the document with the most crops among those long enough to crop ((0, 0):
    none is); no document can yield more distinct pairs' queries than that."""
    longest = max((len(text.split()) for text in documents.values()), default=0)
    if longest < 2 * min_words:
        return 0, 0
    return crop_count(longest, min_ratio, max_ratio, min_words), longest


def independent_crops(
    documents: Mapping[str, str],
    pairs_per_document: int = 1,
    min_ratio: float = 0.1,
    max_ratio: float = 0.5,
    min_words: int = 5,
    seed: int = 0,
) -> TrainingSet:
    """Contriever pairs: (span, another independent span) of each document, `pairs_per_document` times."""
    if not 0 < min_ratio <= max_ratio <= 1:
        raise ValueError(f"need 0 < min_ratio <= max_ratio <= 1, got {min_ratio}, {max_ratio}")
    if pairs_per_document < 1:
        raise ValueError(f"pairs_per_document must be >= 1, got {pairs_per_document}")
    most, words = max_crops(documents, min_ratio, max_ratio, min_words)
    check_setting(not most or pairs_per_document <= most, "pairs_per_document", pairs_per_document,
                  "--pairs-per-document", f"the longest document ({words} words) can be cropped {most} distinct "
                  f"ways, and more pairs a document would only repeat queries; give at most {most}")
    rng = random.Random(seed)
    pairs = _Pairs()
    for doc_id, text in documents.items():
        words = text.split()
        if len(words) < 2 * min_words:
            pairs.skipped.add(f"documents shorter than {2 * min_words} words", doc_id)
            continue
        for j in range(pairs_per_document):
            query = _crop(words, rng, min_ratio, max_ratio, min_words)
            pairs.add(f"crop:{doc_id}:{j}", query, _crop(words, rng, min_ratio, max_ratio, min_words))
    return pairs.training_set("independent-cropping", "no document is long enough for cropping")


def inverse_cloze(
    documents: Mapping[str, str],
    keep_sentence: float = 0.1,
    min_sentences: int = 3,
    seed: int = 0,
) -> TrainingSet:
    """ICT pairs: (one sentence, the document without it) per document; the sentence stays with prob 0.1."""
    rng = random.Random(seed)
    pairs = _Pairs()
    for doc_id, text in documents.items():
        sentences = split_sentences(text)
        if len(sentences) < min_sentences:
            pairs.skipped.add(f"documents with fewer than {min_sentences} sentences", doc_id)
            continue
        i = rng.randrange(len(sentences))
        context = sentences if rng.random() < keep_sentence else sentences[:i] + sentences[i + 1:]
        pairs.add(f"ict:{doc_id}", sentences[i], " ".join(context))
    return pairs.training_set("inverse-cloze", f"no document has {min_sentences}+ sentences")


def write_pairs_jsonl(path: str, data: TrainingSet) -> int:
    """Write ``{"query_id", "query", "pos": [text]}`` lines (readable by `read_jsonl_training`). Returns lines."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for e in data.examples:
            f.write(json.dumps({"query_id": e.query_id, "query": e.query,
                                "pos": [data.corpus[d] for d in e.positives]}, ensure_ascii=False) + "\n")
            n += 1
    return n
