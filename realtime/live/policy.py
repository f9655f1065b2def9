"""When a GPT-Live session delegates: the server's policy (`parley serve --live-delegation`).

OpenAI's Live model decides for itself when to hand work to its delegate; Moshi and PersonaPlex
cannot, so Parley decides, at the end of each user turn (realtime/live/delegation.py sees it):

    every_turn       every user turn (the default)
    never            no delegation: the model only talks
    pattern:REGEX    turns whose input transcript matches REGEX (Python `re.search`, case-insensitive);
                     needs a paired speech-to-text model (--stt-model), which writes that transcript

`DelegateBackend` is where Responses delegations go (`--delegate-url`; live/responses.py).

Standard library only: `parley serve --help` and the flag's parsing import it without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("every_turn", "never", "pattern")
MAX_PATTERN_CHARS = 500


class PolicyError(ValueError):
    """A --live-delegation value that is not a policy; the message says what is."""


@dataclass(frozen=True)
class DelegationPolicy:
    kind: str = "every_turn"
    pattern: str | None = None  # kind "pattern": the regular expression

    @property
    def needs_transcript(self) -> bool:
        return self.kind == "pattern"

    def delegates(self, transcript: str) -> bool:
        """Whether a user turn that ended with this input transcript gets a delegation."""
        if self.kind == "never":
            return False
        if self.kind == "every_turn":
            return True
        assert self.pattern is not None
        return re.search(self.pattern, transcript, re.IGNORECASE) is not None

    def __str__(self) -> str:
        return f"pattern:{self.pattern}" if self.kind == "pattern" else self.kind


@dataclass(frozen=True)
class DelegateBackend:
    """`parley serve --delegate-url` (and --delegate-api-key-file): an OpenAI-compatible backend."""

    url: str
    api_key: str | None = None

    def __repr__(self) -> str:  # the key stays out of logs
        return f"DelegateBackend(url={self.url!r})"


def parse_policy(text: str) -> DelegationPolicy:
    """`every_turn`, `never` or `pattern:REGEX` -> the policy; PolicyError otherwise."""
    kind, _, pattern = text.partition(":")
    if kind not in KINDS or (kind == "pattern") != bool(_):
        raise PolicyError(f"--live-delegation {text!r:.80}: use every_turn, never or pattern:REGEX")
    if kind != "pattern":
        return DelegationPolicy(kind)
    if not pattern or len(pattern) > MAX_PATTERN_CHARS:
        raise PolicyError(f"--live-delegation pattern: give a regular expression of 1 to {MAX_PATTERN_CHARS} "
                          "characters after 'pattern:'")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise PolicyError(f"--live-delegation pattern {pattern!r:.80} is not a regular expression: {exc}") from None
    return DelegationPolicy("pattern", pattern)
