"""The `parley` commands' --help layout."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only where it has one worth printing (not None, not '', and
    not where the help text already explains it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, "", False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)
