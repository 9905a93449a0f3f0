"""Task examples as plain values, and the checks that turn bad ones into errors naming where they came from.

The encoder reads no file formats for fine-tuning (readers live in ``twotower.eval.io``);
it receives plain Python values.  Each example may carry a ``source`` string
(``"train.tsv:17"``) set by whoever read it, so that a problem found only when
the example meets the model (a label missing from the label map, an empty
text, an answer that is not at its offset) is still reported with file and
line.  Without a source the error names the example's index.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from twotower.encoder.finetuning.tagging import is_bio_tag


@dataclass(frozen=True)
class TextExample:
    """One text (or text pair) to classify. ``label`` is None for prediction."""

    text: str
    label: str | None = None
    pair: str | None = None
    source: str = ""


@dataclass(frozen=True)
class TagExample:
    """One sentence as pre-split words, with one tag per word (None for prediction)."""

    words: list[str]
    tags: list[str] | None = None
    source: str = ""


@dataclass(frozen=True)
class QAExample:
    """A question about a context. ``answers`` are (text, character start) pairs; empty = unanswerable."""

    id: str
    question: str
    context: str
    answers: list[tuple[str, int]] = field(default_factory=list)
    source: str = ""

    @property
    def is_impossible(self) -> bool:
        return not self.answers


def where(example: TextExample | TagExample | QAExample, index: int) -> str:
    """How an error refers to an example: its source, else its position in the list."""
    return example.source or f"example {index + 1}"


_INTEGER = re.compile(r"[+-]?[0-9]+")


def build_label_map(labels: Sequence[str]) -> list[str]:
    """The label list of a training set, in a fixed order so that two runs on the same data agree on ids.

    Labels that are all integers ("0".."10", "-1"/"0"/"1") are ordered by value, so id k is class k whenever
    the classes are 0..n-1 (a transformers user's ``logits.argmax()`` is then the class number); sorted as
    strings, "10" came before "2" and id 2 meant class "10". Other labels are sorted as strings. Tagging
    labels put "O" first (HF convention and easy to read in a config). The map is saved as ``id2label`` in
    config.json; a saved model keeps its own.
    """
    unique = set(labels)
    if unique and all(_INTEGER.fullmatch(label) for label in unique):
        ordered = sorted(unique, key=lambda label: (int(label), label))  # "1" and "01" both kept, in one order
    else:
        ordered = sorted(unique)
    if "O" in ordered:
        ordered.remove("O")
        ordered.insert(0, "O")
    if not ordered:
        raise ValueError("no labels in the training data")
    return ordered


def check_text_examples(examples: Sequence[TextExample], labels: Sequence[str] | None, need_labels: bool) -> None:
    """Refuse empty texts / pairs, missing labels, and labels outside the label map."""
    known = set(labels) if labels is not None else None
    for i, ex in enumerate(examples):
        if not ex.text.strip():
            raise ValueError(f"{where(ex, i)}: empty text")
        if ex.pair is not None and not ex.pair.strip():
            raise ValueError(f"{where(ex, i)}: empty second text of a pair")
        if need_labels and ex.label is None:
            raise ValueError(f"{where(ex, i)}: no label")
        if known is not None and ex.label is not None and ex.label not in known:
            raise ValueError(f"{where(ex, i)}: label {ex.label!r} is not in the label map {sorted(known)}")


def check_tag_examples(examples: Sequence[TagExample], labels: Sequence[str] | None, need_labels: bool) -> None:
    """Refuse empty sentences, word/tag count mismatches, empty words and tags outside the label map."""
    known = set(labels) if labels is not None else None
    for i, ex in enumerate(examples):
        if not ex.words:
            raise ValueError(f"{where(ex, i)}: empty sentence")
        if any(not w.strip() for w in ex.words):
            k = next(k for k, w in enumerate(ex.words) if not w.strip())
            raise ValueError(f"{where(ex, i)}: word {k + 1} is empty")
        if ex.tags is None:
            if need_labels:
                raise ValueError(f"{where(ex, i)}: no tags")
            continue
        if len(ex.tags) != len(ex.words):
            raise ValueError(f"{where(ex, i)}: {len(ex.words)} tokens but {len(ex.tags)} tags")
        if known is not None:
            for k, tag in enumerate(ex.tags):
                if tag not in known:
                    raise ValueError(f"{where(ex, i)}: tag {tag!r} of word {k + 1} ({ex.words[k]!r}) is not in "
                                     f"the label map {sorted(known)}")


def check_bio_labels(labels: Sequence[str], examples: Sequence[TagExample]) -> None:
    """Refuse a tagging label map that is not BIO (``O``, ``B-TYPE``, ``I-TYPE``), naming the first example
    that uses such a tag and the tags.

    Why: the tagging head is scored by entity F1 and decoded as BIO, and a tag of another scheme (POS tags
    DT / NN / VB) was mapped to "O" at decoding: such a run trained with F1 0 and predicted only "O".
    """
    bad = [t for t in labels if not is_bio_tag(t)]
    if not bad:
        return
    first = next(((i, ex) for i, ex in enumerate(examples) if any(t in bad for t in ex.tags or ())), None)
    where_ = f"{where(first[1], first[0])}: " if first else ""
    shown = ", ".join(repr(t) for t in bad[:10]) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
    raise ValueError(f"{where_}the tags {shown} are not BIO tags (O, B-TYPE, I-TYPE): tagging is trained and "
                     "scored as entity spans (entity F1), and such tags would be predicted as O; relabel them "
                     "as B-/I- entity tags")


def check_qa_examples(examples: Sequence[QAExample]) -> None:
    """Refuse empty questions / contexts, and answers whose start is not a character offset or whose text is not
    at it."""
    for i, ex in enumerate(examples):
        if not ex.question.strip():
            raise ValueError(f"{where(ex, i)}: question {ex.id!r} is empty")
        if not ex.context.strip():
            raise ValueError(f"{where(ex, i)}: question {ex.id!r} has an empty context")
        for text, start in ex.answers:
            if not text.strip():
                raise ValueError(f"{where(ex, i)}: question {ex.id!r} has an empty answer text")
            if not isinstance(start, int) or isinstance(start, bool) or start < 0:  # -1 counted from the end
                raise ValueError(f"{where(ex, i)}: question {ex.id!r}: answer start {start!r} is not a character "
                                 "offset (an integer >= 0)")
            if ex.context[start:start + len(text)] != text:
                found = ex.context[start:start + len(text)]
                raise ValueError(f"{where(ex, i)}: question {ex.id!r}: answer {text!r} is not at character "
                                 f"{start} of the context (found {found!r})")


def carve_dev(task: str, examples: Sequence, fraction: float, seed: int = 0) -> tuple[list, list]:
    """Split a seeded dev set off the training examples (when no dev file is given).

    QA splits by context, so no paragraph is in both halves: a dev question about a
    paragraph the model trained on would overstate the score.  Classification splits each label apart
    (stratified): a label with n examples puts ``round(n * fraction)`` of them in dev but always keeps one in
    train, so a rare class is never only in dev (a label the model never trained on) and dev has the train
    set's class balance.  Tagging splits by example.
    Returns ``(train, dev)``, each in the input order.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the dev fraction must be in (0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    if task == "classify":
        dev_index = _stratified_dev(examples, fraction, rng)
        train = [ex for i, ex in enumerate(examples) if i not in dev_index]
        dev = [ex for i, ex in enumerate(examples) if i in dev_index]
        groups, unit = len(examples), "examples"
    else:
        keys = [ex.context for ex in examples] if task == "qa" else list(range(len(examples)))
        order = list(dict.fromkeys(keys))
        n_dev = max(1, round(len(order) * fraction))
        dev_groups = {order[i] for i in rng.permutation(len(order))[:n_dev]}
        train = [ex for ex, k in zip(examples, keys) if k not in dev_groups]
        dev = [ex for ex, k in zip(examples, keys) if k in dev_groups]
        groups, unit = len(order), "contexts" if task == "qa" else "examples"
    if not train or not dev:
        raise ValueError(f"a dev fraction of {fraction} of {groups} {unit} leaves an empty train or dev split")
    return train, dev


def _stratified_dev(examples: Sequence[TextExample], fraction: float, rng: np.random.Generator) -> set[int]:
    """Indices of a classification dev split of ``max(1, round(N * fraction))`` examples, shared out over the
    labels in proportion to their size (largest remainders), each label keeping at least one example in train.

    Why one total shared out: rounding each label on its own made dev 1 example where 5 were asked (10 labels
    of 5 at 0.1) or 20 of 30 where 15 were (10 labels of 3 at 0.5). Where the labels' spare examples cannot
    make up the total (most labels have one example), the rest is drawn from the examples left, as an
    unstratified split would: such a label is then in dev only, which the run notes.
    """
    by_label: dict[str | None, list[int]] = {}
    for i, ex in enumerate(examples):
        by_label.setdefault(ex.label, []).append(i)
    groups = list(by_label.values())  # in first-seen order: the split does not depend on set or hash order
    total = max(1, round(len(examples) * fraction))
    exact = [len(g) * fraction for g in groups]
    quota = [min(len(g) - 1, int(e)) for g, e in zip(groups, exact)]
    # the examples still to place, to the labels whose share lost most to rounding down (ties: the larger label)
    placed = sum(quota)
    for k in sorted(range(len(groups)), key=lambda k: (-(exact[k] - int(exact[k])), -len(groups[k]), k)):
        if placed >= total:
            break
        if quota[k] < len(groups[k]) - 1:
            quota[k] += 1
            placed += 1
    dev: set[int] = set()
    for g, q in zip(groups, quota):
        dev.update(g[j] for j in rng.permutation(len(g))[:q])
    short = total - len(dev)
    if short > 0:  # every label is down to its last example: the rest as an unstratified split draws it
        rest = [i for i in range(len(examples)) if i not in dev]
        dev.update(rest[j] for j in rng.permutation(len(rest))[:short])
    return dev
