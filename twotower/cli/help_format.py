"""The help formatter of the `twotower` commands: defaults shown where they say something.

argparse's `ArgumentDefaultsHelpFormatter` appends "(default: X)" to every option, which printed
"(default: cuda when available) (default: None)" where a help text already names the real default, and
"(default: None)" / "(default: False)" for options that are simply off unless given.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only when X is a value and the help text does not already name a default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return action.help
        return super()._get_help_string(action)


class DefaultsRawDescriptionHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`DefaultsHelpFormatter` for a command whose description is a docstring laid out by hand (`answer`)."""
