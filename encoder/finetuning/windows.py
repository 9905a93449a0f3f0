"""Overlapping token windows, shared by QA (a long context) and tagging (a long sentence).

An input longer than a model reads is not cut off: its tokens are cut into windows of at most
``room`` tokens, consecutive windows overlapping by ``overlap`` tokens (HF tokenizers' ``stride``,
this project's ``--doc-stride``), and each window is one model row.  A token that lies in two
windows is read from the one where it has the most context, BERT's max-context rule
(``_check_is_max_context`` in run_squad.py): the window where min(tokens left of it, tokens right
of it) is largest; ties go to the longer window (only the last one is shorter), then to the
earlier one.  BERT adds 0.01 x the window's length to the context instead, which is the same
rule for windows under 100 tokens; above that the bonus can outweigh a real difference in
context, so here it only breaks ties.

Example: 10 tokens, windows of 4 overlapping by 2:
    >>> window_spans(10, 4, 2)
    [(0, 4), (2, 6), (4, 8), (6, 10)]
    >>> max_context_owners(window_spans(10, 4, 2), 10)
    [0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_DEFAULT_OVERLAP = 128  # HF run_qa's doc_stride


def window_spans(n_tokens: int, room: int, overlap: int) -> list[tuple[int, int]]:
    """``[first, last)`` token spans of windows of at most `room` tokens covering `n_tokens` tokens, each
    starting ``room - overlap`` tokens after the one before; the last one ends at the last token.

    An empty input still gives one (empty) window, so every input has a row.
    """
    if room < 1 or not 0 <= overlap < room:
        raise ValueError(f"windows of {room} tokens overlapping by {overlap}: the overlap must be >= 0 and "
                         "smaller than the window, or windows would never advance")
    spans, first = [], 0
    while True:
        last = min(first + room, n_tokens)
        spans.append((first, last))
        if last >= n_tokens:
            return spans
        first += room - overlap


def max_context_owners(spans: Sequence[tuple[int, int]], n_tokens: int) -> list[int]:
    """For each of `n_tokens` tokens, the index of the span (of `window_spans`) where it has the most context."""
    best = [(-1, -1)] * n_tokens
    owner = [-1] * n_tokens
    for k, (first, last) in enumerate(spans):
        for p in range(first, last):
            score = (min(p - first, last - 1 - p), last - first)  # context, then the longer window
            if score > best[p]:  # strictly: a tie stays with the earlier window
                best[p], owner[p] = score, k
    return owner


def default_overlap(room: int) -> int:
    """The overlap when none is given: half the window's room, at most 128 (HF run_qa's doc_stride)."""
    return min(MAX_DEFAULT_OVERLAP, room // 2)


def qa_window(max_length: int, doc_stride: int | None, max_query_length: int | None) -> tuple[int, int, int]:
    """``(doc_stride, max_query_length, room)`` of QA windows of `max_length` tokens; room: the context tokens a
    window holds after the longest question kept and [CLS], [SEP], [SEP].

    A None setting is derived from `max_length`: the question keeps a quarter of it (at most 64, HF's default),
    the overlap is half the room (at most 128, HF's default). With 384 tokens that is HF's 64 and 128.
    The caller refuses ``doc_stride >= room``: windows would never advance (make_windows refuses it too, but
    only at the first long question, after the model had loaded).
    """
    query = max_query_length if max_query_length is not None else max(1, min(64, max_length // 4))
    room = max_length - query - 3
    stride = doc_stride if doc_stride is not None else max(1, default_overlap(room))
    return stride, query, room


def tag_window(max_length: int, doc_stride: int | None) -> tuple[int, int]:
    """``(doc_stride, room)`` of tagging windows of `max_length` tokens; room: the sentence's tokens a window
    holds after [CLS] and before [SEP].

    A None overlap is half the room, at most 128, as for QA (with 128 tokens: 63). The caller refuses
    ``doc_stride >= room``.
    """
    room = max_length - 2
    return (doc_stride if doc_stride is not None else default_overlap(room)), room
