"""TREC run and qrels files, read and written.

Formats (whitespace separated, one judgment or retrieved document per line):

* run:   ``qid Q0 docid rank score tag`` — trec_eval ignores ``rank`` and
  re-sorts by score (ties by docid descending), so we keep only the score;
* qrels: ``qid iteration docid relevance`` — ``iteration`` is unused (0).

Runs are written in the order trec_eval will read them, so the ranks in the
file agree with the ranks used for scoring.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

from twotower.common.atomic import atomic_open
from twotower.common.errors import DataError
from twotower.common.lines import numbered_lines
from twotower.eval.metrics.ranking import rank_documents

Run = dict[str, dict[str, float]]
Qrels = dict[str, dict[str, int]]


def parse_int(path: str | os.PathLike[str], line: int, field: str, value: str) -> int:
    """``int(value)`` or a :class:`DataError` naming the field; ``"1.0"``-style integers are accepted."""
    try:
        return int(value)
    except ValueError:
        pass
    try:
        number = float(value)
    except ValueError:
        raise DataError(path, line, f"{field} must be an integer, got {value!r}") from None
    if not number.is_integer():
        raise DataError(path, line, f"{field} must be an integer, got {value!r}")
    return int(number)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_trec_run(path: str | os.PathLike[str]) -> Run:
    """Read a TREC run into ``{qid: {docid: score}}``.

    Raises:
        DataError: wrong column count, a score that is not a finite-or-infinite
            number, or a document listed twice for one query.
    """
    run: Run = {}
    for number, line in numbered_lines(path):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 6:
            raise DataError(
                path, number, f"expected 6 columns 'qid Q0 docid rank score tag', got {len(fields)}"
            )
        qid, _, docid, _, raw_score, _ = fields
        try:
            score = float(raw_score)
        except ValueError:
            raise DataError(path, number, f"score must be a number, got {raw_score!r}") from None
        if math.isnan(score):
            raise DataError(path, number, "score is NaN")
        docs = run.setdefault(qid, {})
        if docid in docs:
            raise DataError(path, number, f"document {docid!r} appears twice for query {qid!r}")
        docs[docid] = score
    return run


def check_trec_token(kind: str, value: str) -> None:
    """A ValueError when `value` (a query id, document id or run tag) cannot stand as one column of a TREC file."""
    if not value or any(ch.isspace() for ch in value):
        raise ValueError(f"{kind} {value!r} is empty or contains whitespace; TREC files cannot hold it")


def write_trec_run(
    run: Mapping[str, Mapping[str, float]],
    path: str | os.PathLike[str],
    tag: str = "twotower",
    max_rank: int | None = None,
) -> None:
    """Write ``{qid: {docid: score}}`` as a TREC run, atomically, in trec_eval order.

    Args:
        run: scores per query; higher is better.
        path: output file.
        tag: the run name in the last column (no whitespace).
        max_rank: keep only the top ``max_rank`` documents of each query.
    """
    check_trec_token("run tag", tag)
    with atomic_open(path) as handle:
        for qid, scores in run.items():
            check_trec_token("query id", qid)
            ranked = rank_documents(scores)
            if max_rank is not None:
                ranked = ranked[:max_rank]
            for rank, docid in enumerate(ranked, start=1):
                check_trec_token("document id", docid)
                handle.write(f"{qid} Q0 {docid} {rank} {float(scores[docid])!r} {tag}\n")


def read_trec_qrels(path: str | os.PathLike[str]) -> Qrels:
    """Read TREC qrels into ``{qid: {docid: relevance}}`` (integer relevance, may be ≤ 0)."""
    qrels: Qrels = {}
    for number, line in numbered_lines(path):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 4:
            raise DataError(path, number, f"expected 4 columns 'qid 0 docid relevance', got {len(fields)}")
        qid, _, docid, raw = fields
        try:
            relevance = parse_int(path, number, "relevance", raw)
        except DataError as e:
            if not qrels and not _is_number(raw):  # a first line of words: "qid iter docid rel" is a header
                raise DataError(path, number, f"{e.message} (a header line? TREC qrels have none: every line "
                                              "is 'qid 0 docid relevance')") from None
            raise
        judgments = qrels.setdefault(qid, {})
        if docid in judgments:
            raise DataError(path, number, f"document {docid!r} is judged twice for query {qid!r}")
        judgments[docid] = relevance
    return qrels


def write_trec_qrels(qrels: Mapping[str, Mapping[str, int]], path: str | os.PathLike[str]) -> None:
    """Write ``{qid: {docid: relevance}}`` as TREC qrels (``qid 0 docid rel``), atomically."""
    with atomic_open(path) as handle:
        for qid, judgments in qrels.items():
            check_trec_token("query id", qid)
            for docid, rel in judgments.items():
                check_trec_token("document id", docid)
                handle.write(f"{qid} 0 {docid} {int(rel)}\n")
