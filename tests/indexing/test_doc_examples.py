"""The examples in the indexing docstrings run as written."""

import doctest

import pytest

import twotower.indexing.bm25
import twotower.indexing.vector_index


@pytest.mark.parametrize("module", [twotower.indexing.vector_index, twotower.indexing.bm25])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
