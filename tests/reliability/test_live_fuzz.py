"""Fuzzing GPT-Live's event handling (`/v1/live/sessions`), as test_fuzz.py does /v1/realtime's:
whatever comes in after session.start, the answers are events the openai SDK's types parse, bad
input gets an `error`, the session goes on (a probe is answered) and the engine stays healthy."""

from __future__ import annotations

import asyncio
import json

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.live import ServerEvent
from websockets.asyncio.client import connect

from battery import engine_healthy
from server_harness import delay_app, serve
from test_fuzz import FUZZ, JSON_VALUE

pytestmark = pytest.mark.timeout(240)
SERVER_EVENT = pydantic.TypeAdapter(ServerEvent)
EVENT_TYPES = ["session.start", "session.update", "session.input_audio.append", "session.input_audio.mute",
               "session.input_audio.unmute", "session.commentary.append", "session.thinking.append",
               "session.instructions.append", "response.create", "decision.create", "bogus"]
FIELDS = ["session", "audio", "content", "delegation_id", "event_id", "item", "type"]
EVENT = st.builds(lambda kind, fields: {"type": kind, **fields}, st.sampled_from(EVENT_TYPES),
                  st.dictionaries(st.sampled_from(FIELDS[:-1]), JSON_VALUE, max_size=4))
RAW = st.one_of(EVENT.map(json.dumps), st.text(max_size=80), JSON_VALUE.map(json.dumps))


@pytest.fixture(scope="module")
def server():
    app, _ = delay_app(2)
    with serve(app) as base:
        yield base


@settings(FUZZ, max_examples=25)
@given(st.lists(RAW, min_size=1, max_size=5))
def test_live_event_fuzz(server, raws):
    async def scenario():
        async with connect(f"ws://{server}/v1/live/sessions", open_timeout=10, max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.start", "session": {"model": "delay"}}))
            events = [json.loads(await asyncio.wait_for(ws.recv(), 10))]
            assert events[0]["type"] == "session.started"
            for raw in raws:
                await ws.send(raw)
            await ws.send(json.dumps({"type": "session.input_audio.mute", "event_id": "probe"}))
            while events[-1].get("client_event_id") != "probe":  # the probe's answer: the session goes on
                events.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
            return events, ws.close_code

    events, code = asyncio.run(scenario())
    assert code is None
    for event in events:
        SERVER_EVENT.validate_python(event)
    assert events[-1]["type"] == "session.input_audio.muted"
    assert engine_healthy(server)
