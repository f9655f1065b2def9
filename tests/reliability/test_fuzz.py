"""Fuzzing (Hypothesis, derandomized and bounded, so CI runs the same examples every time):
the Ogg-Opus decoder, /api/chat's tag framing and /v1/realtime's event parser. Whatever comes
in, the answer is a clear error on that connection (an OpusError / close 1007-1009, or an
`error` event with the session going on), never a crash, a 1006/1011 or a sick engine."""

from __future__ import annotations

import asyncio
import json
import string

import numpy as np
import pytest
import sphn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from battery import engine_healthy
from parley.realtime.media.opus_codec import OpusCodec, OpusError
from server_harness import FRAME, SR, delay_app, serve, tone

pytestmark = pytest.mark.timeout(240)
FUZZ = settings(derandomize=True, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _valid_ogg(seconds: float = 0.6) -> bytes:
    writer = sphn.OpusStreamWriter(SR)
    pcm = tone(500, seconds)
    return b"".join(bytes(writer.append_pcm(pcm[i:i + FRAME])) for i in range(0, pcm.size - FRAME + 1, FRAME))


VALID = _valid_ogg()


@st.composite
def mangled_ogg(draw) -> list[bytes]:
    """A valid stream with a few bytes overwritten, cut or inserted, split into random chunks."""
    data = bytearray(VALID)
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[pos:pos + draw(st.integers(1, 64))]
        else:
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    return [bytes(data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)])]


@settings(FUZZ, max_examples=150)
@given(st.one_of(mangled_ogg(), st.lists(st.binary(max_size=2048), max_size=4)))
def test_ogg_decoder_returns_audio_or_opus_error(chunks):
    codec = OpusCodec()
    for chunk in chunks:
        try:
            pcm = codec.decode(chunk)
        except OpusError:
            continue
        assert pcm.dtype == np.float32 and pcm.ndim == 1 and np.isfinite(pcm).all()


@pytest.fixture(scope="module")
def server():
    app, _ = delay_app(2)
    with serve(app) as base:
        yield base


TAGS = st.sampled_from([0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x7F, 0xFF])
CHAT_MESSAGE = st.one_of(
    st.builds(lambda tag, body: bytes([tag]) + body, TAGS, st.binary(max_size=512)),
    st.builds(lambda chunks: b"\x01" + b"".join(chunks), mangled_ogg()),
    st.binary(max_size=64),
    st.text(max_size=64),
)


@settings(FUZZ, max_examples=20)
@given(st.lists(CHAT_MESSAGE, min_size=1, max_size=6))
def test_chat_framing_fuzz(server, messages):
    async def scenario():
        async with connect(f"ws://{server}/api/chat", open_timeout=10, max_size=None) as ws:
            await asyncio.wait_for(ws.recv(), 10)  # handshake
            try:
                for message in messages:
                    await ws.send(message)
                await asyncio.wait_for(ws.recv(), 5)  # still served: frames keep coming
            except ConnectionClosed:
                pass
            if ws.close_code is None:
                return None
            return ws.close_code

    code = asyncio.run(scenario())
    assert code in (None, 1007, 1009), code  # open, or a clear close for bad bytes
    assert engine_healthy(server)


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, width=64),
                      st.text(string.printable, max_size=20))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(string.ascii_lowercase + "_", max_size=12), inner,
                                                 max_size=4)), max_leaves=12)
EVENT_TYPES = ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
               "conversation.item.create", "conversation.item.retrieve", "conversation.item.truncate",
               "conversation.item.delete", "response.create", "response.cancel", "output_audio_buffer.clear", "bogus"]
FIELDS = ["session", "audio", "item", "item_id", "audio_end_ms", "content_index", "event_id", "previous_item_id",
          "response", "instructions", "voice", "temperature", "turn_detection", "output_modalities", "type"]
EVENT = st.builds(lambda kind, fields: {"type": kind, **fields}, st.sampled_from(EVENT_TYPES),
                  st.dictionaries(st.sampled_from(FIELDS[:-1]), JSON_VALUE, max_size=4))
RAW = st.one_of(EVENT.map(json.dumps), st.text(max_size=80), JSON_VALUE.map(json.dumps))


@settings(FUZZ, max_examples=25)
@given(st.lists(RAW, min_size=1, max_size=5))
def test_realtime_event_parser_fuzz(server, raws):
    async def scenario():
        async with connect(f"ws://{server}/v1/realtime", open_timeout=10, max_size=None) as ws:
            await asyncio.wait_for(ws.recv(), 10)  # session.created
            for raw in raws:
                await ws.send(raw)
            await ws.send(json.dumps({"type": "input_audio_buffer.clear", "event_id": "probe"}))
            while True:  # every answer is JSON; the probe's answer proves the session goes on
                event = json.loads(await asyncio.wait_for(ws.recv(), 10))
                if event["type"] == "input_audio_buffer.cleared":
                    return ws.close_code

    assert asyncio.run(scenario()) is None
    assert engine_healthy(server)
