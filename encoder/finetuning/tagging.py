"""Token tagging: words -> sub-token labels (first sub-token only), and BIO tags -> entity spans.

A tagging set labels *words*; the model sees WordPiece sub-tokens.  Each word's
label goes on its first sub-token and every other sub-token gets -100, so the
loss counts each word exactly once however many pieces it was cut into
(docs/architecture.md, "Heads").  At prediction the first sub-token's argmax is the word's
tag.  A sentence longer than the model reads is cut into overlapping windows, and each word
is read from the window where it has the most context (tasks.TagTask, windows.py).

Words are joined with single spaces and each sub-token is assigned to a word
by its character offset, not by the tokenizer's own word ids: the BERT
pre-tokenizer splits "@paulwalk" into "@" and "paulwalk", two of *its* words,
while the dataset counts one.

BIO decoding follows conlleval / seqeval's default mode, so entity F1 here
equals ``seqeval.metrics.f1_score`` (tested): an I- tag after O or after a
different type opens a new entity rather than being dropped.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

IGNORE_INDEX = -100


def join_words(words: Sequence[str]) -> tuple[str, list[int]]:
    """Text of the words joined by single spaces, and each word's start character."""
    starts, pos = [], 0
    for w in words:
        starts.append(pos)
        pos += len(w) + 1
    return " ".join(words), starts


def first_subtokens(
    word_starts: Sequence[int], offsets: Sequence[tuple[int, int]], sequence_ids: Sequence[int | None]
) -> list[int]:
    """Index of each word's first sub-token in the encoded row, or -1 when the word has none.

    A word has none when normalisation deleted it (a zero-width space, a BOM, a lone combining accent, a
    control character) or truncation cut it off (fine-tuning does not truncate: a long sentence is read in
    windows, tasks.TagTask, and a deleted word is given [UNK] by `unk_for_tokenless`).
    """
    first = [-1] * len(word_starts)
    for t, ((s, e), seq) in enumerate(zip(offsets, sequence_ids)):
        if seq != 0 or e <= s:  # special tokens and padding
            continue
        w = bisect.bisect_right(word_starts, s) - 1
        if w >= 0 and first[w] == -1:
            first[w] = t
    return first


def unk_for_tokenless(first: Sequence[int], tokens: Sequence[int], unk_id: int) -> tuple[list[int], list[int]]:
    """(tokens, first sub-token of each word) with an [UNK] token inserted, where it stands in the sentence,
    for each word that has no token (``first`` -1: normalisation deleted all of it).

    Why: such a word was predicted "O" without being read and never trained on, so its gold entities always
    counted as misses. Given [UNK] it is trained on and predicted like any word the vocabulary does not know,
    which is what a WordPiece tokenizer does with a character it has no piece for.

    Example:
        >>> unk_for_tokenless([0, -1, 2], [7, 8, 9], unk_id=1)
        ([7, 8, 1, 9], [0, 2, 3])
    """
    if all(f >= 0 for f in first):
        return list(tokens), list(first)
    at = [len(tokens)] * len(first)  # where each tokenless word's [UNK] goes: before the next word's tokens
    following = len(tokens)
    for w in range(len(first) - 1, -1, -1):
        if first[w] >= 0:
            following = first[w]
        at[w] = following
    out: list[int] = []
    new_first: list[int] = []
    done = 0  # tokens[:done] are in `out`
    for f, where in zip(first, at):
        upto = f if f >= 0 else where
        out += tokens[done:upto]
        done = upto
        new_first.append(len(out))
        if f < 0:
            out.append(unk_id)
    out += tokens[done:]
    return out, new_first


def subtoken_labels(first: Sequence[int], word_label_ids: Sequence[int], length: int) -> list[int]:
    """Per-position labels for one row: the word's label at its first sub-token, -100 elsewhere."""
    labels = [IGNORE_INDEX] * length
    for t, y in zip(first, word_label_ids):
        if t >= 0:
            labels[t] = y
    return labels


def is_bio_tag(tag: str) -> bool:
    """Whether `tag` is one BIO decoding understands: ``O``, ``B-TYPE`` or ``I-TYPE``."""
    return tag == "O" or (tag[:2] in ("B-", "I-") and len(tag) > 2)


def _split_tag(tag: str) -> tuple[str, str]:
    if tag == "O":
        return "O", ""
    prefix, _, kind = tag.partition("-")
    if prefix not in ("B", "I"):
        raise ValueError(f"tag {tag!r} is not a BIO tag (expected O, B-TYPE or I-TYPE)")
    return prefix, kind


def bio_entities(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """Entity spans ``(type, start, end)`` of a BIO tag sequence; ``end`` is exclusive.

    Example:
        >>> bio_entities(["B-PER", "I-PER", "O", "I-LOC", "B-LOC"])
        [('PER', 0, 2), ('LOC', 3, 4), ('LOC', 4, 5)]
    """
    entities: list[tuple[str, int, int]] = []
    start, kind = -1, ""
    for i, tag in enumerate([*tags, "O"]):
        prefix, t = _split_tag(tag)
        if start >= 0 and (prefix != "I" or t != kind):
            entities.append((kind, start, i))
            start = -1
        if prefix == "B" or (prefix == "I" and start < 0):
            start, kind = i, t
    return entities


def entity_scores(gold: Sequence[Sequence[str]], predicted: Sequence[Sequence[str]]) -> dict:
    """Entity-level micro precision / recall / F1 (exact type and span), plus the same per type.

    Returns ``{"precision", "recall", "f1", "per_type": {type: {"precision", "recall", "f1", "support"}}}``.
    """
    if len(gold) != len(predicted):
        raise ValueError(f"{len(gold)} gold sentences but {len(predicted)} predicted")
    g_set, p_set = set(), set()
    for s, (g, p) in enumerate(zip(gold, predicted)):
        if len(g) != len(p):
            raise ValueError(f"sentence {s + 1}: {len(g)} gold tags but {len(p)} predicted")
        g_set.update((s, *e) for e in bio_entities(g))
        p_set.update((s, *e) for e in bio_entities(p))

    def prf(gs: set, ps: set) -> dict:
        tp = len(gs & ps)
        precision = tp / len(ps) if ps else 0.0
        recall = tp / len(gs) if gs else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        return {"precision": precision, "recall": recall, "f1": f1, "support": len(gs)}

    types = sorted({e[1] for e in g_set | p_set})
    per_type = {t: prf({e for e in g_set if e[1] == t}, {e for e in p_set if e[1] == t}) for t in types}
    return {**prf(g_set, p_set), "per_type": per_type}
