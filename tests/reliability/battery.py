"""Shared pieces of the reliability battery: an observer session that measures its own
cadence and output while another client misbehaves, and small raw clients.

Cadence bounds are generous on purpose (the CI box has 2 shared cores): an observer must get
at least OBSERVER_MIN_SHARE of its frames, no gap over OBSERVER_MAX_GAP_S, and its own audio
back (echo backend: the tone it sent is the peak of what it hears). The attacks' regression checks are the
attacker's own outcome (the close code and reason it gets), not these timings.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import numpy as np

from websockets.exceptions import ConnectionClosed

from server_harness import FRAME, SR, ChatResult, chat_session, tone

OBSERVER_SECONDS = 3.0
OBSERVER_MIN_SHARE = 0.4
OBSERVER_MAX_GAP_S = 2.5  # loose: a 2-core box at load 14 shows gaps of 1.6 s with no attack at all
OBSERVER_TONE_HZ = 330.0


async def observer(base: str, seconds: float = OBSERVER_SECONDS) -> tuple[np.ndarray, ChatResult]:
    sent = tone(OBSERVER_TONE_HZ, seconds)
    return sent, await chat_session(base, sent, tail_seconds=0.4)


async def under_observation(base: str, attack, seconds: float = 3.5, lead: float = 0.5):
    """Run `attack(base)` while an observer streams: (the attack's result, (sent, observer's result))."""
    watch = asyncio.create_task(observer(base, seconds=seconds))
    await asyncio.sleep(lead)  # the observer is live when the attack comes
    result = await attack(base)
    return result, await watch


async def flood_until_closed(ws, payload, seconds: float = 6.0) -> int:
    """Send `payload` in a tight loop (yielding every 64 sends so the observer's client runs too)
    until the server closes the connection or `seconds` pass; then wait for the close."""
    sent = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            await ws.send(payload)
            sent += 1
            if sent % 64 == 0:
                await asyncio.sleep(0)
        while True:
            await asyncio.wait_for(ws.recv(), 5)
    except (ConnectionClosed, asyncio.TimeoutError):
        pass
    return sent


def assert_observer_ok(sent: np.ndarray, res: ChatResult) -> None:
    """The concurrent session kept its cadence and got its own audio back."""
    assert res.handshake_at is not None, "observer got no handshake"
    expected = sent.size / FRAME
    assert res.audio_messages >= OBSERVER_MIN_SHARE * expected, (res.audio_messages, expected)
    gaps = np.diff(res.arrivals[2:]) if len(res.arrivals) > 3 else np.array([0.0])
    assert gaps.max() < OBSERVER_MAX_GAP_S, f"observer stalled {gaps.max():.2f} s"
    # Its own audio: the echo of its tone. The spectral peak survives lost frames and
    # misalignment under contention, where a sample-level correlation does not.
    pcm = res.pcm[SR // 4:]
    spectrum = np.abs(np.fft.rfft(pcm))
    peak_hz = np.fft.rfftfreq(pcm.size, 1 / SR)[int(spectrum.argmax())]
    assert abs(peak_hz - OBSERVER_TONE_HZ) < 10, peak_hz
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


__all__ = ["FRAME", "SR", "assert_observer_ok", "engine_healthy", "flood_until_closed", "get_json", "observer",
           "under_observation"]
