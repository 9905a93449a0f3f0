"""Long documents as overlapping passages: split at build time, aggregate back to documents at search time.

Why: the document tower reads at most ``document_max_length`` tokens (256 for all-MiniLM-L6-v2);
everything after that used to be truncated away, so a sentence deep in a long document could
never be found.  With passages on, a document whose text is longer than one window becomes
several *rows* of the index, one per token window, each with its own vector and BM25 entry:

    text --document tokenizer (offsets)--> tokens --windows of W, every S tokens--> spans (start, end)
    row id ``<doc id>\\x1f<n>``, title = the document's title, text = text[start:end],
    metadata = the document's metadata (filters match every passage of a matching document)

A document that fits in one window stays one row under its own id, so an index of short
documents is byte-for-byte what it was without passages.  ``\\x1f`` cannot occur in a user's id
(`twotower.retrieval.corpus` refuses control characters), so a row id names its document; and no
reader of document ids (get, delete, contains: the Python API, the CLI and the service) takes a row's
id for a document's (`is_passage_row`). The id format and the rule that a document's rows give its
text back are `twotower.indexing.passage_rows`, which ``twotower index check`` applies too.

Windows (`passage_spans`): ``W`` tokens starting every ``S`` tokens (``S <= W``; ``W - S`` tokens
overlap), cut at word boundaries (a window never starts or ends inside a word unless one word is
longer than the window).  The character spans cover the whole text: the first starts at 0, the
last ends at ``len(text)`` and each starts at or before the previous one's end.  The title (when
there is one) is encoded with every passage (``title + " " + passage``, `indexing.document_text`),
so a document's window shrinks by its title's tokens and the encoder reads each passage whole, unless
the title leaves fewer than ``MIN_WINDOW`` tokens: those passages are cut by the encoder, and the
build or add warns (`title_warning`), since their vectors then encode little but the title.

The parent's text is not stored a second time: it is the union of its passages' spans, so
`get_documents` rebuilds it exactly (``assemble_parent``) from its passage rows (the docs table
records each row's parent and character offsets, indexed by parent).  The cost is the overlap
(a factor ``W / S`` of text for long documents), the gain one source of truth per character.

Search (`document_candidates`): the first stage (dense, BM25 or fused) returns rows; rows are
grouped by document and each document scored by its best passage (MaxP, Dai & Callan 2019;
"sum" and "first" are the other aggregations), fetching more rows until ``recall_k`` documents
come back or the index has no more.  The candidate keeps its best passage, whose text the
reranker scores and whose offsets the hit carries.
"""

from __future__ import annotations

import logging
import math
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from twotower.indexing import Document
from twotower.indexing.docstore import _Row
from twotower.indexing.passage_rows import SEPARATOR, in_passage_order, passage_number, passages_problem
from twotower.indexing.search_result import is_count
from twotower.retrieval.candidates import Candidate

logger = logging.getLogger(__name__)

AGGREGATIONS = ("max", "sum", "first")
# Chosen on SciFact train claims with all-MiniLM-L6-v2 (docs/results.md, "Long documents").
DEFAULT_WINDOW = 128
DEFAULT_STRIDE = 96
MIN_WINDOW = 16  # a title so long that less is left still gets windows of this many tokens


def passage_id(doc_id: str, n: int) -> str:
    return f"{doc_id}{SEPARATOR}{n}"


def parent_of(row_id: str) -> str:
    """The document id a row belongs to (the row id itself for a document stored whole)."""
    return row_id.split(SEPARATOR, 1)[0]


def passage_spans(
    offsets: Sequence[tuple[int, int]], word_ids: Sequence[int | None], text: str, window: int, stride: int,
) -> list[tuple[int, int]]:
    """Character spans of the token windows of one text (see the module docstring for the rules).

    Args:
        offsets: (start, end) of each token in the text, no special tokens (`Tokenizer.token_spans`).
        word_ids: the word each token belongs to (tokens of one word share it).
        text: the text the offsets index.
    Returns:
        ``[(0, len(text))]`` when the text fits in one window, else one span per window. A span ends after
        the combining marks that follow its last character: an uncased tokenizer drops accents, so a
        token's offsets end before a decomposed one ("e" + U+0301), which would start the next passage.
    """
    text_length = len(text)
    if not 1 <= stride <= window:
        raise ValueError(f"passage stride must be between 1 and the window ({window}), got {stride}")
    n = len(offsets)
    if n <= window:
        return [(0, text_length)]
    starts_word = [j == 0 or word_ids[j] is None or word_ids[j] != word_ids[j - 1] for j in range(n)]
    spans: list[tuple[int, int]] = []
    a, prev_end = 0, 0
    while True:
        b = a + window
        if b >= n:
            b = n
        else:
            cut = b
            while cut > a and not starts_word[cut]:
                cut -= 1  # end before the word the window would cut
            if cut > a:
                b = cut
        start = 0 if a == 0 else min(offsets[a][0], prev_end)
        end = text_length if b == n else offsets[b - 1][1]
        while end < text_length and unicodedata.combining(text[end]):
            end += 1
        spans.append((start, end))
        if b == n:
            return spans
        prev_end = end
        nxt = a + stride
        while nxt < b and not starts_word[nxt]:
            nxt += 1  # start at a word
        a = min(nxt, b)  # never a gap of tokens between two windows


@dataclass(frozen=True)
class PassageSettings:
    """Window and stride in tokens, as recorded in the index manifest (``passages``)."""

    window: int = DEFAULT_WINDOW
    stride: int = DEFAULT_STRIDE

    def to_json(self) -> dict[str, int]:
        return {"window": self.window, "stride": self.stride}

    @classmethod
    def from_json(cls, block: Mapping[str, Any] | None) -> PassageSettings | None:
        if not block:
            return None
        return cls(int(block["window"]), int(block["stride"]))


def max_window(encoder: Any) -> int:
    """The largest window the document tower reads whole: its maximum length less [CLS], [SEP] and the prefix."""
    tower = encoder.document_tower
    prefix = len(tower.tokenizer.tokenize(encoder.document_prefix)) if encoder.document_prefix else 0
    return tower.max_length - 2 - prefix


def check_settings(encoder: Any, window: int, stride: int) -> PassageSettings:
    """Refuse a window the encoder cannot read whole, or a stride outside 1..window (errors name the flags)."""
    cap = max_window(encoder)
    if not is_count(window) or window < 1:  # numpy's integers too; True is an int to Python, not a count
        raise ValueError(f"--passage-window (passage_window) must be a positive number of tokens, got {window!r}")
    if window > cap:
        raise ValueError(
            f"--passage-window (passage_window) {window} is larger than the model's maximum of {cap} tokens per "
            f"passage ({encoder.document_max_length} tokens less [CLS], [SEP] and the document prefix); "
            f"choose at most {cap}")
    if not is_count(stride) or not 1 <= stride <= window:
        raise ValueError(f"--passage-stride (passage_stride) must be between 1 and --passage-window ({window}), "
                         f"got {stride!r}")
    return PassageSettings(int(window), int(stride))  # recorded in the manifest's JSON


class PassageSplitter:
    """Turns documents into index rows: each long document into its passages, a short one into itself.

    Deterministic (a function of the text, the title and the tokenizer), which is what lets a
    resumed bulk build know every shard's row count before encoding it.
    """

    def __init__(self, encoder: Any, settings: PassageSettings) -> None:
        self.settings = check_settings(encoder, settings.window, settings.stride)
        self.encoder = encoder
        self.tokenizer = encoder.document_tower.tokenizer
        self.cap = max_window(encoder)

    def _title_tokens(self, docs: Sequence[Mapping[str, Any]]) -> list[int]:
        titles = [d.get("title") or "" for d in docs]
        return [len(o) for o, _ in self.tokenizer.token_spans(titles)] if any(titles) else [0] * len(docs)

    def _window(self, title_tokens: int) -> int:
        """A document's window: the title is encoded with every passage, so it shrinks by the title's tokens,
        down to MIN_WINDOW."""
        w = self.settings.window
        return max(min(w, self.cap - title_tokens), min(w, MIN_WINDOW))

    def spans(self, docs: Sequence[Mapping[str, Any]]) -> list[list[tuple[int, int]]]:
        """Character spans of each document's passages (one span covering the text when it fits)."""
        w, s = self.settings.window, self.settings.stride
        out = []
        for d, (offsets, words), t in zip(docs, self.tokenizer.token_spans([d["text"] for d in docs]),
                                          self._title_tokens(docs)):
            win = self._window(t)
            stride = s if win == w else max(1, round(s * win / w))  # the same overlap, in proportion
            out.append(passage_spans(offsets, words, d["text"], win, stride))
        return out

    def rows(self, docs: Sequence[Mapping[str, Any]]) -> list[Document]:
        """The index rows of `docs`, in order (a document's passages are consecutive)."""
        out: list[Document] = []
        for d, spans in zip(docs, self.spans(docs)):
            if len(spans) == 1:
                out.append(d)  # type: ignore[arg-type]
                continue
            for n, (start, end) in enumerate(spans):
                # a _Row: the pipeline's own passage row (a user's `parent` field is metadata, `as_document`)
                out.append(_Row(id=passage_id(d["id"], n), title=d.get("title") or "", text=d["text"][start:end],
                                metadata=dict(d.get("metadata") or {}), parent=d["id"], start=start, end=end))
        return out

    def cut_rows(self, docs: Sequence[Mapping[str, Any]]) -> int:
        """How many rows of `docs` the encoder will truncate (`title_warning`).

        Only a document whose window stopped shrinking at MIN_WINDOW can have any: elsewhere the window
        leaves room for the title (test_passages checks that property). So only those documents' rows are
        tokenized again, not every passage of the corpus (which doubled the build's counting pass).
        """
        crowded = [d for d, t in zip(docs, self._title_tokens(docs)) if self._window(t) > self.cap - t]
        return longer_than_model(self.encoder, self.rows(crowded)) if crowded else 0


def longer_than_model(encoder: Any, docs: Sequence[Mapping[str, Any]]) -> int:
    """How many documents the document tower truncates (title + text + prefix longer than its maximum)."""
    from twotower.indexing import document_text

    tower = getattr(encoder, "document_tower", None)
    if tower is None:  # an encoder without a tokenizer (tests' stand-ins): nothing to measure
        return 0
    lengths = tower.tokenizer.lengths([encoder.document_prefix + document_text(d) for d in docs], max_length=1 << 30)
    return int((lengths > tower.max_length).sum())


def truncation_warning(long_docs: int, total: int, encoder: Any) -> str:
    return (f"{long_docs} of {total} documents are longer than the model's maximum of {encoder.document_max_length} "
            "tokens and were truncated at it (text past that cannot be found); build with --passages "
            "(passages=True) to split them into overlapping passages")


def title_warning(cut_rows: int, encoder: Any) -> str:
    """The warning for passages the encoder truncates: their document's title leaves too little of its room."""
    return (f"{cut_rows} passages are longer than the model's maximum of {encoder.document_max_length} tokens with "
            f"their document's title in front (a title leaving fewer than {MIN_WINDOW} tokens for the passage), so "
            "the encoder cut them and their vectors hold little but the title; shorten those titles")


# ---------------------------------------------------------------------- documents back from rows
def assemble_parent(rows: Sequence[Mapping[str, Any]]) -> Document:
    """A document rebuilt from its passage rows: the text is the union of their spans, in order.

    The result carries ``passages``: the ``[start, end]`` of each passage, by passage number.
    """
    rows = in_passage_order(rows)
    problem = passages_problem(rows)
    if problem:
        raise ValueError(f"document {rows[0]['parent']!r}: {problem}; delete the document and add it again")
    text, end = "", 0
    for r in rows:
        text += r["text"][end - r["start"]:]
        end = max(end, r["end"])
    first = rows[0]
    return Document(id=first["parent"], title=first["title"], text=text, metadata=first["metadata"],
                    passages=[[r["start"], r["end"]] for r in rows])


def is_passage_row(row: Mapping[str, Any]) -> bool:
    """Whether a stored row is a passage of a split document, which no id of a document names.

    Why: a passage row's id (``<doc id>\x1f<n>``) is internal. Taken as a document's, it let a
    delete remove one passage alone (the document's text could no longer be rebuilt, and every search
    that found it failed) and a get return a passage as a document. Every reader of document ids asks
    this: `get_documents`, and `expand_ids` / `contains_documents` through `_stored_whole`.
    """
    return row.get("parent") is not None


def _stored_whole(docstore: Any, ids: Sequence[str]) -> list[bool]:
    """Whether each id is a document stored as one row under that id (a passage row's id is not one).

    Only an id holding `SEPARATOR` can name a passage row (a user's id cannot hold it), so the ids
    of documents cost no second query.
    """
    present = docstore.contains_many(ids)
    suspects = [i for i, p in zip(ids, present) if p and SEPARATOR in i]
    if not suspects:
        return present
    passages = {i for i, d in zip(suspects, docstore.get(suspects)) if d is not None and is_passage_row(d)}
    return [p and i not in passages for i, p in zip(ids, present)]


def get_documents(docstore: Any, ids: Sequence[str]) -> list[Document | None]:
    """Documents by id in order (None where unknown, or the id of a passage row): a split document is rebuilt
    from its passages."""
    docs = [None if d is not None and is_passage_row(d) else d for d in docstore.get(ids)]
    missing = [i for i, d in zip(ids, docs) if d is None and i]
    if not missing:
        return docs
    groups = docstore.passage_rows(missing)
    return [d if d is not None else (assemble_parent(groups[i]) if i in groups else None) for i, d in zip(ids, docs)]


def expand_ids(docstore: Any, ids: Iterable[str]) -> tuple[list[str], list[str]]:
    """(row ids to delete, ids that are no document: neither stored whole nor split) for document ids."""
    ids = list(dict.fromkeys(ids))
    present = _stored_whole(docstore, ids)
    rows = [i for i, p in zip(ids, present) if p]
    absent = [i for i, p in zip(ids, present) if not p]
    groups = docstore.passage_ids(absent) if absent else {}
    for i in absent:
        rows.extend(groups.get(i, ()))
    return rows, [i for i in absent if i not in groups]


def contains_documents(docstore: Any, ids: Sequence[str]) -> list[bool]:
    """Whether each id is a document of the index: stored whole, or split into passages (a passage row's
    id is not one)."""
    present = _stored_whole(docstore, ids)
    absent = [i for i, p in zip(ids, present) if not p]
    split = docstore.passage_ids(absent) if absent else {}
    return [p or i in split for i, p in zip(ids, present)]


class DocumentIdView:
    """``doc_id in view``: whether the index holds that document (whole or split into passages).

    Asked of SQLite per id, so checking an add's ids against the index costs O(documents added),
    not a read of every id in the index.
    """

    def __init__(self, docstore: Any) -> None:
        self.docstore = docstore

    def __contains__(self, doc_id: object) -> bool:
        return isinstance(doc_id, str) and contains_documents(self.docstore, [doc_id])[0]


def document_counts(docstore: Any) -> tuple[int, int]:
    """(documents, passage rows) in a docs table."""
    return docstore.count_documents()


# ---------------------------------------------------------------------- search: rows -> documents
def aggregate(rows: Sequence[Candidate], how: str = "max", limit: int | None = None) -> list[Candidate]:
    """Group a ranked row list by document: one candidate per document, scored by its passages.

    ``"max"`` (MaxP): the best passage's score; ``"sum"``: the sum of its retrieved passages' scores;
    ``"first"``: only the first passage (or the whole document) counts.  The candidate keeps its best
    passage's row id in ``passage`` (None for a document stored whole), and its dense / BM25 scores.
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregate={how!r}; choose one of {AGGREGATIONS}")
    best: dict[str, Candidate] = {}
    total: dict[str, float] = {}
    for c in rows:
        if how == "first" and (passage_number(c.id) or 0) != 0:
            continue
        doc = parent_of(c.id)
        if doc not in best or c.score > best[doc].score:
            best[doc] = c
        total[doc] = total.get(doc, 0.0) + c.score
    order = sorted(best, key=lambda d: (-(total[d] if how == "sum" else best[d].score), best[d].rank))
    if limit is not None:
        order = order[:limit]
    return [Candidate(d, total[d] if how == "sum" else best[d].score, r, best[d].dense, best[d].bm25,
                      best[d].id if best[d].id != d else None)
            for r, d in enumerate(order, start=1)]


def document_candidates(
    first_stage: Callable[[int], list[list[Candidate]]], recall_k: int, rows: int, how: str = "max",
    split: bool = True,
) -> list[list[Candidate]]:
    """`recall_k` document candidates per query from a first stage that returns rows.

    `first_stage(n)` gives each query's top ``n`` rows.  Without passages (`split` False, the
    aggregation "max") a row is a document and one call of ``recall_k`` is all.  Otherwise rows
    are fetched (twice ``recall_k`` first, doubling) until every query has `recall_k` documents, or
    has had every row its first stage can give (it returned fewer than asked: BM25 returns only the
    rows that share a word with the query), or all `rows` of the index were fetched.
    """
    if how not in AGGREGATIONS:
        raise ValueError(f"aggregate={how!r}; choose one of {AGGREGATIONS}")
    if not split and how != "sum":
        return first_stage(recall_k)
    fetch = min(rows, 2 * recall_k)
    while True:
        per_query = first_stage(max(1, fetch))
        out = [aggregate(r, how, recall_k) for r in per_query]
        if fetch >= rows or all(len(c) >= recall_k or len(r) < fetch for c, r in zip(out, per_query)):
            return out
        fetch = min(rows, math.ceil(fetch * 2))
