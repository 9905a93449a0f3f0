"""The examples in the indexing docstrings run as written."""

import doctest

import pytest

import indexing.bm25
import indexing.vector_index


@pytest.mark.parametrize("module", [indexing.vector_index, indexing.bm25])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
