"""MS MARCO passage-ranking TSV files.

* ``collection.tsv`` / ``queries.*.tsv``: ``id<TAB>text``;
* ``qrels.*.tsv``: TREC qrels with tabs (``qid 0 pid 1``) — read with :func:`read_trec_qrels`;
* runs: ``qid<TAB>pid<TAB>rank`` (no scores).  A rank becomes the score
  ``-rank`` so that trec_eval's "higher score first" order is the file's order;
* ``triples.train.small.tsv``: ``query<TAB>positive passage<TAB>negative passage``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

from twotower.common.atomic import atomic_open
from twotower.common.errors import DataError
from twotower.common.lines import numbered_lines
from twotower.eval.io.trec import Run, parse_int, read_trec_qrels
from twotower.eval.metrics.ranking import rank_documents

__all__ = [
    "iter_id_text_tsv",
    "read_id_text_tsv",
    "read_msmarco_qrels",
    "read_msmarco_run",
    "iter_msmarco_triples",
    "write_msmarco_run",
]

read_msmarco_qrels = read_trec_qrels


_ID_HEADERS = ("id", "_id", "qid", "query-id", "query_id", "pid", "docid", "doc-id", "doc_id")
_TEXT_HEADERS = ("text", "query", "passage", "question")


def read_id_text_tsv(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read ``id<TAB>text`` lines (collection or queries) into ``{id: text}`` (`iter_id_text_tsv`'s rules)."""
    return {key: text for _, key, text in iter_id_text_tsv(path)}


def iter_id_text_tsv(path: str | os.PathLike[str]) -> Iterator[tuple[int, str, str]]:
    """Stream ``(line number, id, text)`` of ``id<TAB>text`` lines; a repeated id is an error.

    A first line that is a header (``qid<TAB>text``, ``id<TAB>query``, ...) is skipped, as the qrels reader
    skips its own: it was read as a query with the id "qid", searched, and written into the run. The line
    travels with each text so that a caller's own check of it can name ``file:line``.
    """
    seen: set[str] = set()
    first = True
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        fields = line.split("\t")
        if first:
            first = False
            if (len(fields) == 2 and fields[0].strip().lower() in _ID_HEADERS
                    and fields[1].strip().lower() in _TEXT_HEADERS):
                continue
        if len(fields) != 2:
            raise DataError(path, number, f"expected 2 tab-separated columns 'id text', got {len(fields)}")
        key, text = fields[0].strip(), fields[1]
        if not key:
            raise DataError(path, number, "empty id")
        if key in seen:
            raise DataError(path, number, f"id {key!r} appears twice")
        seen.add(key)
        yield number, key, text


def read_msmarco_run(path: str | os.PathLike[str]) -> Run:
    """Read ``qid pid rank`` lines into ``{qid: {pid: -rank}}``."""
    run: Run = {}
    for number, line in numbered_lines(path):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 3:
            raise DataError(path, number, f"expected 3 columns 'qid pid rank', got {len(fields)}")
        qid, pid, raw = fields
        rank = parse_int(path, number, "rank", raw)
        if rank < 1:
            raise DataError(path, number, f"rank must be >= 1, got {rank}")
        docs = run.setdefault(qid, {})
        if pid in docs:
            raise DataError(path, number, f"passage {pid!r} appears twice for query {qid!r}")
        docs[pid] = float(-rank)
    return run


def write_msmarco_run(
    run: Mapping[str, Mapping[str, float]], path: str | os.PathLike[str], max_rank: int | None = None
) -> None:
    """Write ``qid<TAB>pid<TAB>rank`` lines in trec_eval order, atomically."""
    with atomic_open(path) as handle:
        for qid, scores in run.items():
            ranked = rank_documents(scores)[:max_rank] if max_rank is not None else rank_documents(scores)
            for rank, pid in enumerate(ranked, start=1):
                handle.write(f"{qid}\t{pid}\t{rank}\n")


def iter_msmarco_triples(path: str | os.PathLike[str]) -> Iterator[tuple[str, str, str]]:
    """Stream ``(query, positive, negative)`` text triples."""
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise DataError(
                path, number, f"expected 3 tab-separated columns 'query pos neg', got {len(fields)}"
            )
        yield fields[0], fields[1], fields[2]
