"""The examples in eval's docstrings run as tests."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import twotower.eval as eval_package

MODULES = sorted(m.name for m in pkgutil.walk_packages(eval_package.__path__, prefix="twotower.eval.") if not m.ispkg)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
