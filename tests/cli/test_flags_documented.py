"""Every flag of every command says what it does, `--help` shows its default, and docs/cli.md mentions it.

docs/cli.md promises that `twotower COMMAND --help` lists every flag with its default: argparse's defaults
formatter shows a default only beside help text, and only when the command uses it; and a flag the guide
never names is found only by reading the source. Walks `build_parser()`, so a new flag is held to it too.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from twotower.cli import build_parser
from twotower.cli.help_format import DefaultsHelpFormatter

CLI_PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) of the program and of every command and action under it: (), ("search",), ("index", "add")."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(build_parser()))
LEAVES = [(path, p) for path, p in COMMANDS
          if path and not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)]


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The arguments a user sees: all but -h/--help, the sub-command choice and the hidden (test hooks)."""
    return [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            and a.help is not argparse.SUPPRESS]


def _name(path: tuple[str, ...]) -> str:
    return " ".join(("twotower", *path))


def test_every_argument_has_help() -> None:
    missing = [f"{_name(path)} {a.option_strings[0] if a.option_strings else a.metavar or a.dest}"
               for path, p in COMMANDS for a in _arguments(p) if not (a.help or "").strip()]
    assert not missing, f"arguments without a help text: {missing}"


def test_every_command_shows_its_defaults() -> None:
    plain = [f"{_name(path)} ({p.formatter_class.__name__})" for path, p in LEAVES
             if not issubclass(p.formatter_class, DefaultsHelpFormatter)]
    assert not plain, f"commands whose --help shows no defaults: {plain}"


@pytest.mark.parametrize(("path", "parser"), LEAVES, ids=[" ".join(path) for path, _ in LEAVES])
def test_help_shows_each_default_once(path, parser) -> None:
    """A value default is named once, by the formatter or by the help text; off switches and None say nothing."""
    formatter = parser._get_formatter()
    for action in _arguments(parser):
        text = formatter._get_help_string(action) or ""
        shown = len(re.findall(r"\(default: ", text))
        assert shown <= 1 and "(default: None)" not in text and "(default: False)" not in text, (path, text)
        if action.option_strings and action.default not in (None, [], argparse.SUPPRESS) \
                and not isinstance(action.default, bool):
            assert "default" in text.lower(), f"{_name(path)} {action.option_strings[0]}: no default shown: {text}"


def _section(page: str, path: tuple[str, ...]) -> str:
    """The part of docs/cli.md about a command: from its "## twotower ..." heading to the next (an action such as
    `index build` is in its command's section); the program's own flags are on the page before the first."""
    if not path:
        return page.split("\n## ", 1)[0]
    for n in range(len(path), 0, -1):
        m = re.search(rf"^## {re.escape(_name(path[:n]))}\n(.*?)(?=^## |\Z)", page, re.M | re.S)
        if m:
            return m.group(1)
    raise AssertionError(f"docs/cli.md has no section for {_name(path)}")


def test_every_flag_is_in_the_guide() -> None:
    page = CLI_PAGE.read_text(encoding="utf-8")
    missing = []
    for path, parser in COMMANDS:
        if not _arguments(parser):  # `train`, `index`: a choice of actions
            continue
        section = _section(page, path)
        for action in _arguments(parser):
            flags = [o for o in action.option_strings if o.startswith("--")] or action.option_strings[:1]
            missing += [f"{_name(path)} {flag}" for flag in flags
                        if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", section)]
    assert not missing, f"flags docs/cli.md does not mention in the command's section: {missing}"


def test_the_defaults_help_shows_for_lr_and_mine_ranks_are_the_trainers_own() -> None:
    """`--lr` and `--mine-ranks` stay None in the arguments (so `--lr 0` is told from no --lr); the values
    --help shows for them are the CLI's constants, which must be the training configs' defaults."""
    from twotower.cli.train_cmd import DUAL_DEFAULTS, RERANKER_DEFAULTS
    from twotower.retrieval.training.train_dual import DualTrainConfig
    from twotower.retrieval.training.train_reranker import RerankerTrainConfig

    for constants, config in ((DUAL_DEFAULTS, DualTrainConfig), (RERANKER_DEFAULTS, RerankerTrainConfig)):
        fields = {f.name: f.default for f in dataclasses.fields(config)}
        assert constants == (fields["lr"], fields["mine_ranks"]), config.__name__
