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

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Filled as usual, except lines indented by two spaces (a table): kept as written."""
        out: list[str] = []
        prose: list[str] = []

        def flush() -> None:
            if prose:
                out.append(argparse.ArgumentDefaultsHelpFormatter._fill_text(self, " ".join(prose), width, indent))
                prose.clear()

        for line in text.splitlines():
            if line.startswith("  ") or not line.strip():
                flush()
                out.append(indent + line if line.strip() else "")
            else:
                prose.append(line)
        flush()
        return "\n".join(out)
