"""The help layout of every sparkbus command line (``sparkbus``, the demo, the examples): defaults shown."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help with every default that says something: not None, not a switch's False, not one the help
    text already names. Descriptions are kept as written (they are laid out by hand)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        if "default" in help_text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return help_text
        return f"{help_text} (default: %(default)s)"
