"""twotower.common.documents: the one reading of a document record (its rules are tested where each reader uses
them: tests/eval/test_io_formats.py, tests/retrieval/test_pipeline_corpus.py, tests/indexing/test_docstore.py)."""

from __future__ import annotations

import doctest

import twotower.common.documents


def test_docstring_examples():
    """parse_beir_document's examples moved here from eval.io.beir, whose doctests no longer see them."""
    result = doctest.testmod(twotower.common.documents, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
