"""docs/protocols.md's field table, walked against a real server with the `openai` SDK: each
refused field gets an `error` naming it while the session goes on, each honoured one shows in
`session.updated` and in what the server does (per-response options, G.711 at 8 kHz, audio
items). Every emitted event is validated with the SDK's own models (and openai-agents' and
pipecat's parsers where installed). Over the echo backend: output frame t == input frame t - 1."""

from __future__ import annotations

import asyncio
import base64
import contextlib

import numpy as np
import pytest

from parley.realtime.media.audio_formats import g711_decode, g711_encode
from server_harness import FRAME, SR, delay_app, serve, tone
from test_server_realtime import Recorder, beta_validators, check_all, client, ga_validators, pcm16_b64, stream

pytestmark = pytest.mark.timeout(60)

@contextlib.asynccontextmanager
async def connected(base: str, beta: bool = False):
    """An SDK connection (GA, or beta) with its event recorder, past `session.created`."""
    realtime = client(base).beta.realtime if beta else client(base).realtime
    async with realtime.connect(model="gpt-4o-realtime-preview" if beta else "gpt-realtime") as conn:
        rec = Recorder(conn)
        await rec.wait_type("session.created")
        yield conn, rec
        await conn.close()
        await rec.task


REFUSED_GA = {
    "session.tools": {"tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]},
    "session.audio.input.transcription": {"audio": {"input": {"transcription": {"model": "whisper-1"}}}},
    "session.audio.input.noise_reduction": {"audio": {"input": {"noise_reduction": {"type": "far_field"}}}},
    "session.audio.output.speed": {"audio": {"output": {"speed": 1.3}}},
    "session.audio.input.turn_detection.silence_duration_ms":
        {"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": "abc"}}}},
    "session.audio.input.turn_detection.idle_timeout_ms":
        {"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 6000}}}},
    "session.prompt": {"prompt": {"id": "pmpt_123"}},
    "session.include": {"include": ["item.input_audio_transcription.logprobs"]},
    "session.truncation": {"truncation": "disabled"},
    "session.tool_choice": {"tool_choice": "required"},
    "session.max_output_tokens": {"max_output_tokens": 100000},
}


def test_ga_session_fields_honoured_or_refused_by_name():
    app, _ = delay_app(1)

    async def scenario(base):
        async with connected(base) as (conn, rec):
            for param, session in REFUSED_GA.items():
                await conn.session.update(session={"type": "realtime", **session})
                err = await rec.wait(lambda e: e["type"] == "error" and e["error"]["param"] == param)
                assert err["error"]["type"] == "invalid_request_error"
            # honoured, all at once; tools: [] is what openai-agents sends for an agent without tools
            await conn.session.update(session={
                "type": "realtime", "tools": [], "tool_choice": "auto", "output_modalities": ["audio"],
                "max_output_tokens": 40, "tracing": {"workflow_name": "field-walk"},
                "audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": 300,
                                                       "threshold": 0.6},
                                    "transcription": None},
                          "output": {"voice": "marin", "speed": 1.0}}})
            updated = await rec.wait(lambda e: e["type"] == "session.updated"
                                     and e["session"]["max_output_tokens"] == 40)
            session = updated["session"]
            assert session["audio"]["input"]["turn_detection"]["silence_duration_ms"] == 300
            assert session["audio"]["input"]["turn_detection"]["threshold"] == 0.6
            assert session["tracing"] == {"workflow_name": "field-walk"}
            assert session["audio"]["output"]["voice"] == "marin"
            # the session went on through all of that
            await stream(conn, tone(440, 0.8))
            await rec.wait(lambda e: e["type"] == "response.output_audio.delta")
        return rec.events

    with serve(app) as base:
        events = run(scenario(base))
    errors = [e for e in events if e["type"] == "error"]
    assert sorted(e["error"]["param"] for e in errors) == sorted(REFUSED_GA)
    # every refusal was followed by session.updated showing the (unchanged) effective config
    assert len([e for e in events if e["type"] == "session.updated"]) == len(REFUSED_GA) + 1
    check_all(events, ga_validators())


def test_per_response_options_text_only_max_tokens_metadata_out_of_band():
    app, _ = delay_app(1)

    async def scenario(base):
        async with connected(base) as (conn, rec):
            # only requested responses: the model's own speech does not open one
            await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
            await rec.wait_type("session.updated")
            await conn.response.create(response={"output_modalities": ["text"], "max_output_tokens": 5,
                                                 "metadata": {"topic": "walk"}, "conversation": "none"})
            await stream(conn, tone(440, 1.0))
            done = await rec.wait_type("response.done")
            await conn.response.create(response={"tools": [{"type": "function", "name": "f"}]})
            refused = await rec.wait_type("error")
        return rec.events, done, refused

    with serve(app) as base:
        events, done, refused = run(scenario(base))
    response = done["response"]
    assert response["status"] == "incomplete" and response["status_details"]["reason"] == "max_output_tokens"
    assert response["metadata"] == {"topic": "walk"} and response["conversation_id"] is None
    assert response["usage"]["output_tokens"] == 5
    assert len([e for e in events if e["type"] == "response.output_text.delta"]) == 5
    assert not [e for e in events if e["type"] == "response.output_audio.delta"]  # text only
    assert not [e for e in events if e["type"].startswith("conversation.item")]  # out of band
    assert len([e for e in events if e["type"] == "response.created"]) == 1  # no auto responses
    assert refused["error"]["param"] == "response.tools"
    check_all(events, ga_validators())


def test_g711_mulaw_8khz_round_trip_beta():
    app, _ = delay_app(1)
    sent = tone(440, 1.6, sr=8000)
    ulaw = g711_encode((sent * 32767).astype(np.int16), "pcmu")

    async def scenario(base):
        async with connected(base, beta=True) as (conn, rec):
            await conn.session.update(session={"input_audio_format": "g711_ulaw", "output_audio_format": "g711_ulaw"})
            updated = await rec.wait_type("session.updated")
            assert updated["session"]["input_audio_format"] == "g711_ulaw"
            chunk = 160  # 20 ms at 8 kHz, as Twilio sends
            for i in range(0, len(ulaw), chunk):
                await conn.input_audio_buffer.append(audio=base64.b64encode(ulaw[i:i + chunk]).decode())
                await asyncio.sleep(0.02 if i > 3 * chunk else 0)
            await rec.wait(lambda e: len(rec.of("response.audio.delta")) >= 12)
        return rec.events

    with serve(app) as base:
        events = run(scenario(base))
    deltas = [base64.b64decode(e["delta"]) for e in events if e["type"] == "response.audio.delta"]
    assert all(len(d) == 640 for d in deltas)  # 80 ms at 8 kHz, one byte a sample
    back = g711_decode(b"".join(deltas), "pcmu").astype(np.float32) / 32768
    mid = back[800:-800]
    peak_hz = np.argmax(np.abs(np.fft.rfft(mid * np.hanning(mid.size)))) * 8000 / mid.size
    assert abs(peak_hz - 440) < 10, peak_hz
    assert 0.2 < np.sqrt(2 * np.mean(mid ** 2)) < 0.4
    check_all(events, beta_validators())


def test_audio_item_reaches_the_model_at_real_time_pace():
    app, _ = delay_app(1)
    recorded = tone(660, 3.0)  # longer than the 2 s input buffer: fed all at once, it would overrun

    async def scenario(base):
        async with connected(base) as (conn, rec):
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": pcm16_b64(recorded)}]})
            await rec.wait_type("conversation.item.added")
            await rec.wait(lambda e: len(rec.of("response.output_audio.delta")) >= 30, timeout=20)
            overruns = app.state.sessions.engine.counters()["overruns"]
        return rec.events, overruns

    with serve(app) as base:
        events, overruns = run(scenario(base))
    assert overruns == 0  # the item went in one frame per tick: nothing dropped
    pcm = np.concatenate([np.frombuffer(base64.b64decode(e["delta"]), "<i2") for e in events
                          if e["type"] == "response.output_audio.delta"]).astype(np.float32) / 32768
    spectrum = np.abs(np.fft.rfft(pcm[:FRAME * 8]))
    assert abs(np.argmax(spectrum) * SR / (FRAME * 8) - 660) < 10  # the item's tone, echoed back
    check_all(events, ga_validators())


def run(coro):
    return asyncio.run(coro)


def test_moshi_checkpoint_refuses_persona_and_voice_prompts_beta():
    from parley.realtime.sessions.session import ServerDefaults
    app, backend = delay_app(1, defaults=ServerDefaults(prompts=False))

    async def scenario(base):
        async with connected(base, beta=True) as (conn, rec):
            await conn.session.update(session={"instructions": "You are Ada.", "voice": "NATF2.pt",
                                               "temperature": 0.5, "input_audio_transcription": {"model": "x"}})
            updated = await rec.wait_type("session.updated")
        return rec.events, updated

    with serve(app) as base:
        events, updated = run(scenario(base))
    params = sorted(e["error"]["param"] for e in events if e["type"] == "error")
    assert params == ["session.input_audio_transcription", "session.instructions", "session.voice"]
    assert updated["session"]["temperature"] == 0.5 and updated["session"]["instructions"] == ""
    assert backend.sampling[-1].audio_temperature == 0.5  # the honoured field re-prefilled the session
    check_all(events, beta_validators())


REFUSED_BETA = {
    "session.input_audio_transcription": {"input_audio_transcription": {"model": "whisper-1"}},
    "session.input_audio_noise_reduction": {"input_audio_noise_reduction": {"type": "near_field"}},
    "session.speed": {"speed": 0.8},
    "session.temperature": {"temperature": 1e39},
    "session.turn_detection.threshold": {"turn_detection": {"type": "server_vad", "threshold": "high"}},
    "session.turn_detection.type": {"turn_detection": {"type": "semantic_vad"}},  # no paired STT here
    "session.tools": {"tools": [{"type": "function", "name": "f"}]},
    "session.output_audio_format": {"output_audio_format": "mp3"},
}
REFUSED_RESPONSE = {
    "response.instructions": {"instructions": "Another persona for one answer."},
    "response.voice": {"voice": "NATM9.pt"},
    "response.input": {"input": [{"type": "message", "role": "user",
                                  "content": [{"type": "input_text", "text": "hi"}]}]},
    "response.conversation": {"conversation": "conv_123"},
    "response.modalities": {"modalities": ["video"]},
}


def test_beta_session_and_response_fields_refused_by_name():
    app, _ = delay_app(1)

    async def scenario(base):
        async with connected(base, beta=True) as (conn, rec):
            await conn.session.update(session={"turn_detection": None})  # responses only on request
            await rec.wait_type("session.updated")
            for param, session in REFUSED_BETA.items():
                await conn.session.update(session=session)
                await rec.wait(lambda e: e["type"] == "error" and e["error"]["param"] == param)
            for param, response in REFUSED_RESPONSE.items():
                await conn.response.create(response=response)
                await rec.wait(lambda e: e["type"] == "error" and e["error"]["param"] == param)
            await conn.transcription_session.update(session={"input_audio_format": "pcm16"})
            await rec.wait(lambda e: e["type"] == "error" and e["error"]["code"] == "unsupported_parameter"
                           and e["error"]["param"] == "type")
            await conn.response.create(response={"modalities": ["text", "audio"], "metadata": {"k": "v"}})
            created = await rec.wait_type("response.created")
        return rec.events, created

    with serve(app) as base:
        events, created = run(scenario(base))
    params = [e["error"]["param"] for e in events if e["type"] == "error"]
    assert params == [*REFUSED_BETA, *REFUSED_RESPONSE, "type"]
    assert len([e for e in events if e["type"] == "response.created"]) == 1  # refused ones never started
    assert created["response"]["metadata"] == {"k": "v"}
    check_all(events, beta_validators())
