"""/v1/realtime under attack, with an /api/chat observer measuring its cadence meanwhile.

Bad events get an `error` event and the session goes on; only a flood closes (1008)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from websockets.asyncio.client import connect

from attacks import stalled_reader
from battery import assert_observer_ok, engine_healthy, flood_until_closed, under_observation
from parley.realtime.sessions.limits import EdgeLimits
from parley.realtime.sessions.session import ServerDefaults
from server_harness import delay_app, serve

pytestmark = pytest.mark.timeout(90)


async def _open(base: str, **kwargs):
    ws = await connect(f"ws://{base}/v1/realtime", open_timeout=10, max_size=None, **kwargs)
    created = json.loads(await asyncio.wait_for(ws.recv(), 10))
    assert created["type"] == "session.created"
    return ws


async def _next(ws, kind: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic())))
        if event["type"] == kind:
            return event


async def _still_serving(ws) -> bool:
    """The session answers a harmless event (input_audio_buffer.clear -> cleared)."""
    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    return (await _next(ws, "input_audio_buffer.cleared"))["type"] == "input_audio_buffer.cleared"


def test_bad_events_get_error_events_and_the_session_goes_on():
    app, _ = delay_app(4, defaults=ServerDefaults(limits=EdgeLimits(max_conversation_bytes=64 * 1024,
                                                                    max_event_bytes=512 * 1024)))

    async def attack(base):
        ws = await _open(base)
        errors = {}
        # The critical case on this door: a temperature the model cannot hold.
        await ws.send(json.dumps({"type": "session.update", "session": {"temperature": 1e39}}))
        errors["temperature"] = (await _next(ws, "error"))["error"]
        # 100k-deep nesting: once a RecursionError and close 1006.
        await ws.send('{"type":"x","a":' + "[" * 100_000 + "]" * 100_000 + "}")
        errors["deep"] = (await _next(ws, "error"))["error"]
        await ws.send('{"type":"x","a":' + "[" * 33 + "1" + "]" * 33 + "}")  # 34 levels: over 32
        errors["depth 34"] = (await _next(ws, "error"))["error"]
        await ws.send(json.dumps({"type": "x", "pad": "a" * 600_000}))
        errors["size"] = (await _next(ws, "error"))["error"]
        # The conversation budget: ~18 KiB items (450 tiny audio parts each: the model hears audio
        # only, and a stored part keeps ~41 bytes) until the 64 KiB budget refuses one.
        parts = [{"type": "input_audio", "audio": "AAAAAAAA"}] * 450
        ids = []
        for i in range(5):
            await ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "id": f"item_{i}", "type": "message", "role": "user", "content": parts}}))
            event = json.loads(await asyncio.wait_for(ws.recv(), 10))
            while event["type"] not in ("error", "conversation.item.created", "conversation.item.added"):
                event = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if event["type"] == "error":
                errors["budget"] = event["error"]
                break
            ids.append(f"item_{i}")
        # Deleting an item makes room again.
        await ws.send(json.dumps({"type": "conversation.item.delete", "item_id": ids[0]}))
        await _next(ws, "conversation.item.deleted")
        await ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "id": "again", "type": "message", "role": "user", "content": parts}}))
        event = json.loads(await asyncio.wait_for(ws.recv(), 10))
        serving = await _still_serving(ws)
        await ws.close()
        return errors, ids, event, serving

    with serve(app) as base:
        (errors, ids, after_delete, serving), (sent, res) = asyncio.run(under_observation(base, attack, seconds=3.0))
        healthy = engine_healthy(base)
    assert errors["temperature"]["code"] == "invalid_value"
    assert errors["temperature"]["param"] == "session.temperature"
    assert "temperature" in errors["temperature"]["message"]
    assert errors["deep"]["code"] == "invalid_json" and "deeper" in errors["deep"]["message"]
    assert errors["depth 34"]["code"] == "invalid_json"
    assert errors["size"]["code"] == "message_too_large"
    assert errors["budget"]["code"] == "conversation_too_large" and errors["budget"]["param"] == "item"
    assert len(ids) == 3  # 3 x ~18 KiB fit in 64 KiB, the 4th does not
    assert after_delete["type"] != "error"
    assert serving
    assert_observer_ok(sent, res)
    assert healthy


def test_a_flooding_realtime_client_is_closed_1008():
    app, _ = delay_app(4)

    async def flood(base):
        ws = await _open(base)
        await flood_until_closed(ws, '{"type":"input_audio_buffer.clear"}')
        return ws.close_code, ws.close_reason or ""

    with serve(app) as base:
        (code, reason), (sent, res) = asyncio.run(under_observation(base, flood))
    assert code == 1008 and "rate limit" in reason, (code, reason)
    assert_observer_ok(sent, res)


def test_a_client_that_stops_reading_is_not_served_stale_audio():
    """It stops reading for 5 s while its input keeps coming: when it reads again it gets at
    most about the lag limit of old audio (the rest was dropped, counted), not 5 s of it."""
    app, _ = delay_app(2)
    with serve(app) as base:
        result = asyncio.run(stalled_reader(f"ws://{base}", f"http://{base}", stall=5.0))
    # 3 s live is ~38 frames; 5 s stalled is 62 more (old main: ~100 in all). Now what waited is
    # at most the 1 s limit (12 frames) plus the few the client's own socket had accepted.
    assert result["audio_deltas_in_3s_after"] <= 60, result
    assert result["frames_dropped"] >= 30, result
