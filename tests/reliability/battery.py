"""Shared pieces of the reliability battery: an observer session that measures its own
cadence and output while another client misbehaves, and small raw clients.

Cadence bounds are generous on purpose (the CI box has 2 shared cores): an observer must get
at least OBSERVER_MIN_SHARE of its frames, no gap over OBSERVER_MAX_GAP_S, and its own audio
back (echo backend: correlation with what it sent).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import numpy as np

from server_harness import FRAME, SR, ChatResult, best_lag_correlation, chat_session, tone

OBSERVER_SECONDS = 3.0
OBSERVER_MIN_SHARE = 0.6
OBSERVER_MAX_GAP_S = 1.5  # the flood on old main: gaps of 2.8 s
MAX_LAG = 6 * FRAME


async def observer(base: str, seconds: float = OBSERVER_SECONDS, start_delay: float = 0.0) -> tuple[np.ndarray, ChatResult]:
    await asyncio.sleep(start_delay)
    sent = tone(330, seconds)
    return sent, await chat_session(base, sent, tail_seconds=0.4)


def assert_observer_ok(sent: np.ndarray, res: ChatResult) -> None:
    """The concurrent session kept its cadence and got its own audio back."""
    assert res.handshake_at is not None, "observer got no handshake"
    expected = sent.size / FRAME
    assert res.audio_messages >= OBSERVER_MIN_SHARE * expected, (res.audio_messages, expected)
    gaps = np.diff(res.arrivals[2:]) if len(res.arrivals) > 3 else np.array([0.0])
    assert gaps.max() < OBSERVER_MAX_GAP_S, f"observer stalled {gaps.max():.2f} s"
    corr, _ = best_lag_correlation(sent, res.pcm, MAX_LAG)
    assert corr > 0.8, corr
    assert res.close_code in (None, 1000), (res.close_code, res.close_reason)


def get_json(base: str, path: str, headers: dict | None = None) -> tuple[int, dict]:
    """(status, body as JSON, or {"text": ...} when it is not JSON)."""
    req = urllib.request.Request(f"http://{base}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            status, body = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read()
    try:
        return status, json.loads(body)
    except ValueError:  # a page, a file, Prometheus text or a plain-text refusal
        return status, {"text": body.decode(errors="replace")}


def engine_healthy(base: str) -> bool:
    return get_json(base, "/health")[0] == 200


__all__ = ["FRAME", "SR", "assert_observer_ok", "engine_healthy", "get_json", "observer"]
