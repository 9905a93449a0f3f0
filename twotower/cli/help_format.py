"""The help formatter of the `twotower` commands: defaults shown where they say something.

argparse's `ArgumentDefaultsHelpFormatter` appends "(default: X)" to every option, which printed
"(default: cuda when available) (default: None)" where a help text already names the real default, and
"(default: None)" / "(default: False)" for options that are simply off unless given.

The rule every command keeps, so that `--help` shows each default once: an option whose default is a value
leaves it to the formatter ("(default: 10)"); one whose default is None (worked out when the command runs,
or told apart from a value given) says in its help what happens without it ("(default: cuda when
available)"); a switch (store_true) shows none.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only when X is a value and the help text does not already name a default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        # by identity: `0 in (None, False)` is true, which hid "--seed ... (default: 0)"
        unset = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if unset or action.default == [] or "default" in text.lower():
            return action.help  # off unless given, nothing unless given ("(default: [])"), or named by the text
        return super()._get_help_string(action)


class DefaultsRawDescriptionHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`DefaultsHelpFormatter` for a command whose description is a docstring laid out by hand (`answer`)."""
