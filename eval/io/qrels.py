"""Read qrels without being told the format: BEIR TSV (3 columns, header) or TREC (4 columns)."""

from __future__ import annotations

import os

from twotower.common.errors import DataError
from twotower.common.lines import numbered_lines
from twotower.eval.io.beir import read_beir_qrels
from twotower.eval.io.trec import Qrels, read_trec_qrels


def detect_qrels_format(path: str | os.PathLike[str]) -> str:
    """``"beir"`` or ``"trec"`` from the first non-blank line (3 vs 4 columns).

    Raises:
        DataError: the file is empty or its first line has another column count.
    """
    for number, line in numbered_lines(path):
        fields = line.split()
        if not fields:
            continue
        if len(fields) == 3:
            return "beir"
        if len(fields) == 4:
            return "trec"
        raise DataError(
            path,
            number,
            f"cannot tell the qrels format: {len(fields)} columns "
            "(want 3 for BEIR 'query-id corpus-id score' or 4 for TREC 'qid 0 docid rel')",
        )
    raise DataError(path, None, "qrels file is empty")


def read_qrels(path: str | os.PathLike[str]) -> Qrels:
    """Read BEIR or TREC qrels into ``{qid: {docid: relevance}}``, detecting the format."""
    if detect_qrels_format(path) == "beir":
        return read_beir_qrels(path)
    return read_trec_qrels(path)
