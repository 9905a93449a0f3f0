"""Tab-separated classification sets with a header line (GLUE style).

Examples: SST-2 ``sentence<TAB>label``; TREC-QC ``label_coarse<TAB>label_fine<TAB>text``.
Fields are split on tabs only and never unquoted (GLUE files contain bare
quote characters), so text is read exactly as written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

from twotower.common.atomic import atomic_open
from twotower.common.errors import DataError
from twotower.common.lines import numbered_lines

TEXT_COLUMNS = ("text", "sentence", "sentence1", "question")
PAIR_COLUMNS = ("text_pair", "sentence2")


class LabeledExample(NamedTuple):
    text: str
    label: str | None  # None: a blank label cell, read with ``missing_labels=True`` (prediction)
    text_pair: str | None = None


def _pick(
    path: str | os.PathLike[str], header: list[str], wanted: str | None, defaults: tuple[str, ...], kind: str
):
    if wanted is not None:
        if wanted not in header:
            raise DataError(path, 1, f"no {kind} column {wanted!r}; columns are {header}")
        return header.index(wanted)
    for name in defaults:
        if name in header:
            return header.index(name)
    return None


def read_classification_tsv(
    path: str | os.PathLike[str],
    text_column: str | None = None,
    label_column: str | None = None,
    text_pair_column: str | None = None,
    missing_labels: bool = False,
) -> list[LabeledExample]:
    """Read labelled texts from a TSV with a header.

    Args:
        path: the file.
        text_column: column holding the text; default the first of ``text``,
            ``sentence``, ``sentence1``, ``question`` present.
        label_column: default ``label``, else the only column whose name starts
            with ``label`` (TREC-QC has two: pass ``label_coarse`` or ``label_fine``).
        text_pair_column: second text for pair tasks; default ``text_pair`` / ``sentence2`` if present.
        missing_labels: a blank label cell gives the label None instead of an error (files to predict on,
            where a row without a label is predicted and the file is scored only if every row has one).

    Raises:
        DataError: no usable column (names the columns found), a row with the wrong
            number of fields, or an empty label (names the line).
    """
    rows = numbered_lines(path)
    header_line = next(rows, None)
    if header_line is None:
        raise DataError(path, None, "file is empty (a header line is required)")
    header = [h.strip() for h in header_line[1].split("\t")]
    text_i = _pick(path, header, text_column, TEXT_COLUMNS, "text")
    if text_i is None:
        raise DataError(path, 1, f"no text column (tried {list(TEXT_COLUMNS)}); columns are {header}")
    if label_column is None:
        labels = [h for h in header if h.startswith("label")]
        if "label" in header:
            label_column = "label"
        elif len(labels) == 1:
            label_column = labels[0]
        else:
            raise DataError(
                path, 1, f"cannot choose the label column among {labels or header}; choose one with "
                "--label-column"
            )
    label_i = _pick(path, header, label_column, (), "label")
    pair_i = _pick(path, header, text_pair_column, PAIR_COLUMNS, "text pair")
    examples: list[LabeledExample] = []
    for number, line in rows:
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(header):
            raise DataError(path, number, f"expected {len(header)} tab-separated fields, got {len(fields)}")
        label = fields[label_i].strip()
        if not label and not missing_labels:
            raise DataError(path, number, f"empty label in column {header[label_i]!r}")
        pair = fields[pair_i] if pair_i is not None else None
        examples.append(LabeledExample(fields[text_i], label or None, pair))
    return examples


def write_classification_tsv(examples: Iterable[LabeledExample], path: str | os.PathLike[str]) -> None:
    """Write ``text<TAB>label`` (plus ``text_pair`` when any example has one) with a header, atomically."""
    items = list(examples)
    with_pair = any(ex.text_pair is not None for ex in items)
    with atomic_open(path) as handle:
        handle.write("text\ttext_pair\tlabel\n" if with_pair else "text\tlabel\n")
        for i, ex in enumerate(items):
            cells = [ex.text, ex.text_pair or ""] if with_pair else [ex.text]
            cells.append(str(ex.label))
            if any(ch in "\t\n" for cell in cells for ch in cell):
                raise ValueError(f"example {i}: a field contains a tab or newline")
            handle.write("\t".join(cells) + "\n")
