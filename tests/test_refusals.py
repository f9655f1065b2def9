"""Every refused session or request leaves one INFO line (door, reason, client; never a key) and
one step of parley_refusals_total{door, reason} (realtime/sessions/refusals.py), whichever door refused it
and however: 503 / 401 / 403 before the upgrade, or a close after it. Real uvicorn on loopback
over the fabricated echo backend.
"""

from __future__ import annotations

import asyncio
import logging
import re
import urllib.error
import urllib.request

import pytest

from parley.engine import Engine
from delay_backend import DelayBackend
from parley.realtime.server.app import ServerInfo, create_app
from parley.realtime.server.services import Services
from parley.realtime.sessions.limits import EdgeLimits
from parley.realtime.chat.protocol import MAX_MESSAGE_BYTES
from parley.realtime.sessions.refusals import REASONS
from parley.realtime.sessions.session import ServerDefaults
from server_harness import serve

pytestmark = pytest.mark.timeout(60)

KEY = "sk-SECRET-123"


def make_app(max_sessions: int = 1, **defaults):
    return create_app(Services(Engine(DelayBackend(max_sessions)), ServerDefaults(**defaults), ServerInfo(model="delay"),
                      codec_workers=0, web_dir=None))


def refusals_total(base: str, door: str, reason: str) -> float:
    request = urllib.request.Request(f"http://{base}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    match = re.search(rf'^parley_refusals_total\{{door="{re.escape(door)}",reason="{reason}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


async def connect_ws(base: str, path: str, **kwargs):
    """('status', HTTP status of a refused upgrade) or ('closed', close code, reason) for a
    session refused after it, or ('open', the connection)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    try:
        ws = await connect(f"ws://{base}{path}", open_timeout=10, max_size=None, **kwargs)
    except InvalidStatus as exc:
        return "status", exc.response.status_code
    try:
        await asyncio.wait_for(ws.recv(), 10)  # /api/chat's handshake byte, /v1/realtime's session.created
    except ConnectionClosed:
        return "closed", ws.close_code, ws.close_reason
    return "open", ws


async def flood(ws, message, count: int):
    """Send `message` `count` times (or until closed); then the close code."""
    from websockets.exceptions import ConnectionClosed

    try:
        for _ in range(count):
            await ws.send(message)
        await asyncio.wait_for(ws.recv(), 10)
    except ConnectionClosed:
        pass
    await ws.wait_closed()
    return ws.close_code


def refused_lines(caplog) -> list[str]:
    """Every parley log line about a refusal (the refusal's own, and any other logger's)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("parley")
            and "refused" in r.getMessage().lower()]


def check_one_refusal(caplog, base: str, door: str, reason: str, before: float) -> None:
    [line] = refused_lines(caplog)
    assert re.fullmatch(rf"refused {re.escape(door)} from 127\.0\.0\.1:\d+: {reason} \(.+\)", line), line
    assert KEY not in line and "WRONG" not in line  # never a key, nor the query string it rides in
    assert refusals_total(base, door, reason) == before + 1
    caplog.clear()


def test_refusals_before_the_upgrade_and_at_the_key(caplog):
    caplog.set_level(logging.INFO, logger="parley")
    app = make_app(api_key=KEY, allowed_origins=("https://ok.example",))
    auth = {"additional_headers": {"Authorization": f"Bearer {KEY}"}}
    with serve(app) as base:
        cases = [  # (path, connect kwargs, expected, door, reason)
            ("/api/chat?api_key=WRONG", {}, ("status", 401), "/api/chat", "api_key"),
            ("/v1/realtime", {"additional_headers": {"Authorization": f"Bearer {KEY}", "Origin": "https://x.example"}},
             ("status", 403), "/v1/realtime", "origin"),
        ]
        for path, kwargs, expected, door, reason in cases:
            before = refusals_total(base, door, reason)
            assert asyncio.run(connect_ws(base, path, **kwargs)) == expected
            check_one_refusal(caplog, base, door, reason, before)
        # an HTTP door refuses a request without the key the same way
        before = refusals_total(base, "/api/info", "api_key")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://{base}/api/info?api_key=WRONG", timeout=10)
        assert err.value.code == 401
        check_one_refusal(caplog, base, "/api/info", "api_key", before)

        async def full_then_draining():
            first = await connect_ws(base, "/api/chat", **auth)
            assert first[0] == "open"
            full = await connect_ws(base, "/v1/realtime", **auth)
            await first[1].close()
            return full

        before = refusals_total(base, "/v1/realtime", "full")
        assert asyncio.run(full_then_draining()) == ("status", 503)
        check_one_refusal(caplog, base, "/v1/realtime", "full", before)
        app.state.sessions.admission.draining = True
        assert asyncio.run(connect_ws(base, "/api/chat", **auth)) == ("status", 503)
        check_one_refusal(caplog, base, "/api/chat", "draining", 0.0)


@pytest.mark.parametrize("query,reason,code", [
    ("text_topk=abc", "options", 1008),  # a sampling parameter that is not a number
    ("voice_prompt=unknown", "options", 1008),  # a voice the model rejects
])
def test_a_session_refused_for_its_options(caplog, query, reason, code):
    caplog.set_level(logging.INFO, logger="parley")
    with serve(make_app()) as base:
        kind, close_code, close_reason = asyncio.run(connect_ws(base, f"/api/chat?{query}"))
        assert (kind, close_code) == ("closed", code)
        check_one_refusal(caplog, base, "/api/chat", reason, 0.0)


@pytest.mark.parametrize("reason", ["rate_limit", "too_large"])
def test_a_session_closed_at_a_limit(caplog, reason):
    caplog.set_level(logging.INFO, logger="parley")
    app = make_app(limits=EdgeLimits(max_messages_per_s=5))  # a burst of 10 messages, then closed

    async def scenario(base):
        kind, ws = await connect_ws(base, "/api/chat")
        assert kind == "open"
        if reason == "rate_limit":
            return await flood(ws, b"\x03", 50)  # 0x03: ignored tags, only the rate counts
        return await flood(ws, b"\x01" + bytes(MAX_MESSAGE_BYTES), 1)

    with serve(app) as base:
        assert asyncio.run(scenario(base)) == (1008 if reason == "rate_limit" else 1009)
        check_one_refusal(caplog, base, "/api/chat", reason, 0.0)


def test_reasons_are_a_fixed_set(caplog):
    """The reason is a label: a code outside the fixed set is a programming error, not a new label."""
    app = make_app()
    with pytest.raises(ValueError, match="unknown refusal reason"):
        app.state.sessions.metrics.refusals.record({"path": "/api/chat", "client": ("1.2.3.4", 5)}, "oops", "x")
    app.state.sessions.metrics.refusals.record({"path": "/no/such/door", "client": ("1.2.3.4", 5)}, "full", "x")
    text = app.state.sessions.metrics.render().decode()
    assert 'parley_refusals_total{door="other",reason="full"} 1.0' in text  # unknown paths share one label
    assert set(REASONS) >= {"full", "draining", "unhealthy", "origin", "api_key", "options", "rate_limit",
                            "too_large"}


def test_a_session_the_stopped_engine_cannot_open_is_refused(caplog):
    caplog.set_level(logging.INFO, logger="parley")
    app = make_app()
    with serve(app) as base:
        app.state.sessions.engine.shutdown()  # still healthy (not failed): admitted, then the open fails
        kind, code, _ = asyncio.run(connect_ws(base, "/api/chat"))
        assert (kind, code) == ("closed", 1011)
        check_one_refusal(caplog, base, "/api/chat", "unavailable", 0.0)


def test_a_session_without_a_codec_worker_is_refused(caplog, monkeypatch):
    from parley.realtime.media.opus import CodecUnavailable

    caplog.set_level(logging.INFO, logger="parley")
    app = make_app()

    def lost():  # as when every codec worker process is gone
        raise CodecUnavailable("no codec worker is running")

    monkeypatch.setattr(app.state.codec, "open", lost)
    with serve(app) as base:
        kind, code, _ = asyncio.run(connect_ws(base, "/api/chat"))
        assert (kind, code) == ("closed", 1011)
        check_one_refusal(caplog, base, "/api/chat", "codec", 0.0)


def test_a_request_refused_by_a_full_tts_pool(caplog, tiny_tts_dir):
    """The HTTP doors' own refusals (here 429 from a full TTS pool) take the same one line and count."""
    import httpx2 as httpx  # what the pinned openai SDK ships on
    import torch

    from parley.engine import EngineConfig
    from parley.realtime.server.speech_setup import load_speech_service

    caplog.set_level(logging.INFO, logger="parley")
    service = load_speech_service(tiny_tts_dir, slots=1, voices=tiny_tts_dir / "voices", voice_map=None,
                                  device="cpu", dtype=torch.float32)
    engine = Engine(DelayBackend(1), EngineConfig(tick_seconds=0.5))
    engine.add_slack_source(service.pool)
    app = create_app(Services(engine, info=ServerInfo(model="delay"), codec_workers=0, web_dir=None, speech=service))
    body = {"input": " ".join(["hello there my friend"] * 30), "voice": service.voices.names()[0],
            "response_format": "pcm"}
    with serve(app) as base, httpx.Client(timeout=60) as c:
        url = f"http://{base}/v1/audio/speech"
        with c.stream("POST", url, json=body) as first:  # holds the pool's one row while it streams
            assert first.status_code == 200
            second = httpx.post(url, json=body, timeout=60)
            assert second.status_code == 429
        check_one_refusal(caplog, base, "/v1/audio/speech", "full", 0.0)
