"""`import twotower`: its lazy re-exports resolve, the errors the docs tell callers to catch are among them, and the
import itself stays cheap (neither torch nor FAISS)."""

from __future__ import annotations

import json
import subprocess
import sys

import twotower

# The errors docs/python-api.md names for a caller to catch, with the built-in class each one extends.
DOCUMENTED_ERRORS = {"DataError": ValueError, "FilterError": ValueError, "DiskFullError": OSError,
                     "EncoderMismatchError": ValueError, "BaseMismatchError": ValueError}


def test_the_documented_errors_are_exported():
    """They were reachable only by their full module paths (twotower.retrieval.build.DiskFullError ...)."""
    for name, base in DOCUMENTED_ERRORS.items():
        assert name in twotower.__all__ and name in dir(twotower)
        error = getattr(twotower, name)
        assert isinstance(error, type) and issubclass(error, base) and error.__name__ == name


def test_every_export_resolves_and_the_import_stays_cheap():
    code = ("import json, sys, twotower; heavy = sorted(m for m in ('torch', 'faiss') if m in sys.modules); "
            "[getattr(twotower, n) for n in twotower.__all__]; print(json.dumps(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []  # measured before the exports were touched


def test_the_fine_tuning_api_is_exported():
    """docs/python-api.md documents these; they were reachable only by their full module paths."""
    names = {"finetune", "FinetuneConfig", "TaskModel", "TextExample", "TagExample", "QAExample",
             "read_text_examples", "read_tag_examples", "read_qa_examples"}
    assert names <= set(twotower.__all__) and names <= set(dir(twotower))
    assert twotower.TaskModel.__name__ == "TaskModel" and callable(twotower.finetune)
