"""Refused sessions and requests: one INFO line and one counter step each, from one place.

Every door that turns a client away calls `Refusals.record` (server/security.py for keys and
Origins, sessions/capacity.py for the 503s before an upgrade, `Outbox.refuse` for closes after
it, the HTTP doors for a full TTS pool, STT queue or image queue), so a refusal never shows
only as uvicorn's `connection open`. The line names the door
(the path, never the query string: keys ride there), the reason and the client address;
`parley_refusals_total{door, reason}` counts them. Both labels are bounded: `door` is a path
of the doors table or `other` (server/doors.py), `reason` one of REASONS.
"""

from __future__ import annotations

import logging
from typing import Mapping

from prometheus_client import CollectorRegistry, Counter

from ..server import doors

log = logging.getLogger("parley.refusals")

REASONS = {
    "full": "every session slot, transcription row, TTS row or image queue place is taken",
    "memory": "the KV cache cannot hold another session to the end of its window (engine/kv_blocks.py)",
    "draining": "the server is draining",
    "unhealthy": "the engine is not serving",
    "origin": "a browser Origin that is not allowed",
    "api_key": "a missing or wrong API key",
    "options": "a setting the model cannot serve (sampling, persona, voice, transcript)",
    "unavailable": "the engine closed while the session opened",
    "codec": "no audio codec worker for the session",
    "rate_limit": "over the message or byte rate",
    "too_large": "a message over the size limit",
    "session_not_found": "a sideband's session is unknown, has ended, or is another key's",
    "sidebands": "a session already has --max-sidebands attached connections",
}
MAX_DETAIL_CHARS = 200  # a client's text can reach the message: keep the line short


class Refusals:
    """The refusal counter of one app, and the one function that logs and counts."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.counter = Counter("parley_refusals", "sessions and requests refused, by door (path) and reason "
                               "(docs/protocols.md lists the reasons)", ["door", "reason"], registry=registry)

    def record(self, scope: Mapping, reason: str, detail: str) -> None:
        """Log and count one refusal of the connection or request `scope` (an ASGI scope)."""
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        path = str(scope.get("path", ""))
        client = scope.get("client")
        address = f"{client[0]}:{client[1]}" if client else "?"
        log.info("refused %s from %s: %s (%s)", path[:100], address, reason, detail[:MAX_DETAIL_CHARS])
        self.counter.labels(doors.label(path), reason).inc()
