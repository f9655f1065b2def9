"""/api/chat under attack, each case with an observer session measuring its own cadence and
output at the same time (echo backend). The attacked connection gets its clear close; the
observer notices nothing; the engine stays healthy."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from attacks import oversized_handshake
from battery import assert_observer_ok, engine_healthy, flood_until_closed, under_observation
from server_harness import delay_app, serve

pytestmark = pytest.mark.timeout(90)

# The critical case and its siblings: each once ended every live session and left the engine dead.
OVERFLOWING = [
    ("text_temperature", "1e39"), ("text_topk", "1e19"), ("audio_topk", "9223372036854775808"),
    ("audio_topk", "1e30"), ("audio_temperature", "4e38"),
]


async def _close_of(base: str, query: str) -> tuple[int | None, str]:
    async with connect(f"ws://{base}/api/chat?{query}", open_timeout=10) as ws:
        try:
            while True:
                await asyncio.wait_for(ws.recv(), 10)
        except ConnectionClosed:
            pass
        return ws.close_code, ws.close_reason or ""


def test_unrepresentable_sampling_settings_close_1008_and_nobody_else_notices():
    app, _ = delay_app(4)

    async def attacks(base):
        return [await _close_of(base, f"{param}={value}") for param, value in OVERFLOWING]

    with serve(app) as base:
        closes, (sent, res) = asyncio.run(under_observation(base, attacks, seconds=3.0, lead=0.8))
        healthy = engine_healthy(base)
    for (param, _), (code, reason) in zip(OVERFLOWING, closes):
        assert code == 1008, (param, code, reason)
        assert param in reason, reason
    assert_observer_ok(sent, res)
    assert healthy


FLOODS = {"ping tag": b"\x06", "empty audio": b"\x01", "text frame": "\x01x"}


@pytest.mark.parametrize("kind", sorted(FLOODS))
def test_a_flooding_client_is_closed_1008_and_others_keep_cadence(kind):
    app, _ = delay_app(4)
    payload = FLOODS[kind]

    async def flood(base):
        async with connect(f"ws://{base}/api/chat", open_timeout=10) as ws:
            await asyncio.wait_for(ws.recv(), 10)  # handshake
            sent = await flood_until_closed(ws, payload)
            return ws.close_code, ws.close_reason or "", sent

    with serve(app) as base:
        (code, reason, sent_count), (sent, res) = asyncio.run(under_observation(base, flood))
        metrics = _metrics(base)
    assert code == 1008 and "rate limit" in reason, (code, reason, sent_count)
    assert 'parley_rate_limited_total{protocol="moshi"} 1.0' in metrics
    assert_observer_ok(sent, res)


def _metrics(base: str) -> str:
    import urllib.request
    return urllib.request.urlopen(f"http://{base}/metrics", timeout=5).read().decode()


def test_text_frames_are_ignored_not_decoded_as_audio():
    """A text frame starting with 0x01 is not Ogg audio (the docs say text frames are ignored)."""
    app, _ = delay_app(1)

    async def scenario(base):
        async with connect(f"ws://{base}/api/chat", open_timeout=10) as ws:
            await asyncio.wait_for(ws.recv(), 10)
            await ws.send("\x01OggS not really")
            await ws.send("\x01garbage")
            got = [await asyncio.wait_for(ws.recv(), 5) for _ in range(4)]  # frames keep coming
            return got, ws.close_code

    with serve(app) as base:
        got, code = asyncio.run(scenario(base))
    assert code is None and len(got) == 4


def test_disconnect_right_after_upgrade_logs_no_traceback(caplog):
    app, _ = delay_app(1)
    caplog.set_level(logging.INFO)

    with serve(app) as base:
        host, port = base.split(":")
        for _ in range(5):
            s = socket.create_connection((host, int(port)))
            s.sendall(f"GET /api/chat HTTP/1.1\r\nHost: {base}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
            s.recv(200)  # the 101, then gone before the handshake byte
            s.close()
        time.sleep(1.0)
        healthy = engine_healthy(base)
    assert healthy
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_oversized_request_line_is_answered_414_and_closed():
    app, _ = delay_app(1)
    with serve(app) as base:
        host, port = base.split(":")
        data = oversized_handshake(host, int(port))
        healthy = engine_healthy(base)
    assert data.startswith(b"HTTP/1.1 414 ")
    assert b"persona" in data  # says what to do instead
    assert healthy
