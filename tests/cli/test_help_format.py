"""`--help` shows a default where it says something, once."""

from __future__ import annotations

import re

import pytest

from twotower.cli import build_parser


def _help(capsys, *command: str) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines; compare words


@pytest.mark.parametrize("command", [("train", "reranker"), ("train", "dual"), ("train", "demo-reranker"),
                                     ("train", "mine"), ("train", "pairs"), ("embed",), ("pretrain",),
                                     ("tokenizer", "train"), ("finetune", "classify"), ("predict", "tag"),
                                     ("answer",)])
def test_defaults_are_shown_once_and_never_as_none(command, capsys):
    text = _help(capsys, *command)
    assert "(default: None)" not in text and "(default: False)" not in text
    assert not re.search(r"default[^()]*\) \(default:", text), text  # "(default: an epoch) (default: None)" was shown


def test_values_still_show_their_default(capsys):
    text = _help(capsys, "train", "reranker")
    assert "fraction of the run spent warming up (default: 0.1)" in text
    assert "steps between dev evaluations (default: an epoch) --eval-interval" in text


def _parsers(parser, path=()):
    """Every (sub)command's parser, with the words that reach it."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_descriptions_are_plain_text():
    """The module docstrings that `--help` shows printed reStructuredText (``--bm25``) and internal names
    (SearchPipeline, twotower.eval.metrics.retrieval)."""
    for path, parser in _parsers(build_parser()):
        text = parser.description or ""
        assert "`" not in text and "SearchPipeline" not in text and "twotower.eval." not in text, (path, text)
