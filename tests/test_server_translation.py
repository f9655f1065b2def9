"""/v1/realtime/translations driven by the openai SDK's `client.realtime.translations.connect()`,
unmodified, over a real uvicorn server on 127.0.0.1: on the fabricated echo backend (output frame
t == input frame t - 1, so every source sample must come back, in order) and, for the source's
transcript, on the tiny random demo models with a paired STT. Every event Parley sends is parsed
by the SDK's own `RealtimeTranslationServerEvent` models, which must find no field they lack."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request

import numpy as np
import pytest
from pydantic import BaseModel, TypeAdapter

from server_harness import FRAME, SR, delay_app, serve, tone
from test_server_realtime import Recorder, client, pcm16_b64, run
from test_server_realtime_transcription import stt_app_factory  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(90)

openai = pytest.importorskip("openai")


def sdk_events(events: list[dict]) -> None:
    """Every event parses as the SDK's translation server event, with no field its model lacks."""
    from openai.types.realtime import RealtimeTranslationServerEvent
    adapter = TypeAdapter(RealtimeTranslationServerEvent)

    def extras(model: BaseModel, path: str) -> list[str]:
        found = [f"{path}.{key}" for key in (model.model_extra or {})]
        for name in type(model).model_fields:
            value = getattr(model, name)
            if isinstance(value, BaseModel):
                found += extras(value, f"{path}.{name}")
        return found

    ids = [e["event_id"] for e in events]
    assert len(ids) == len(set(ids)), "event ids must be unique"
    for event in events:
        parsed = adapter.validate_python(event)
        assert parsed.type == event["type"]
        assert extras(parsed, event["type"]) == [], json.dumps(event)[:400]


def speech_like(seconds: float) -> np.ndarray:
    """Syllable-shaped voiced sound (a gliding harmonic tone under a 4 Hz envelope): a source that is
    never silent for long and never repeats a frame, so a lost or reordered frame shows."""
    t = np.arange(int(seconds * SR)) / SR
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / SR
    voiced = sum(np.sin(k * phase) / k for k in (1, 2, 3, 4))
    envelope = 0.35 + 0.3 * np.abs(np.sin(2 * np.pi * 2 * t))
    return (0.25 * envelope * voiced).astype(np.float32)


async def send_paced(conn, pcm: np.ndarray, chunk: int, prebuffer: int = 3) -> None:
    """`pcm` in `chunk`-sample appends paced in real time (after `prebuffer` chunks at once)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for i, start in enumerate(range(0, pcm.size, chunk)):
        await conn.session.input_audio_buffer.append(audio=pcm16_b64(pcm[start:start + chunk]))
        due = t0 + max(0, i + 1 - prebuffer) * chunk / SR
        await asyncio.sleep(max(0.0, due - loop.time()))


def audio_of(events: list[dict]) -> np.ndarray:
    deltas = [e["delta"] for e in events if e["type"] == "session.output_audio.delta"]
    return np.frombuffer(b"".join(base64.b64decode(d) for d in deltas), "<i2").astype(np.float32) / 32768


def test_ten_seconds_of_speech_come_out_translated_then_the_session_closes_cleanly():
    app, _ = delay_app(2)
    # 200 ms appends (the SDK's advice) with an odd-length tail: the flush pads its last frame.
    source = speech_like(10.0)[:10 * SR - 700]

    async def scenario(base):
        async with client(base).realtime.translations.connect(model="delay") as conn:
            rec = Recorder(conn)
            created = await rec.wait_type("session.created")
            assert rec.events[0] is created
            session = created["session"]
            assert session["type"] == "translation" and session["model"] == "delay"
            assert session["id"].startswith("sess_") and session["audio"]["output"]["language"] == "en"
            await conn.session.update(session={"audio": {"output": {"language": "en"},
                                                         "input": {"transcription": None, "noise_reduction": None}}})
            assert (await rec.wait_type("session.updated"))["session"]["audio"]["output"]["language"] == "en"
            await send_paced(conn, source, chunk=SR // 5)
            await conn.session.close()
            closed = await rec.wait_type("session.closed", timeout=20)
            await asyncio.wait_for(rec.task, 10)  # the server closed the socket after session.closed
            return rec.events, closed, conn._connection.close_code

    with serve(app) as base:
        events, closed, close_code = run(scenario(base))
    assert events[-1] is closed and close_code == 1000
    assert not [e for e in events if e["type"] == "error"]
    sdk_events(events)

    # The echo's frames are the source's, in order, with whole frames of silence where the model
    # heard none (before the source began, a late client, the flush's padding and tail).
    frames = audio_of(events).reshape(-1, FRAME)
    heard = frames[np.abs(frames).max(axis=1) > 0].reshape(-1)
    sent = np.frombuffer(base64.b64decode(pcm16_b64(source)), "<i2").astype(np.float32) / 32768
    assert heard.size == sent.size + (-sent.size % FRAME), "the flush did not bring out the source's end"
    np.testing.assert_allclose(heard[:sent.size], sent, atol=1.5 / 32768)  # every sample, in order
    assert not heard[sent.size:].any()  # the last frame's padding

    texts = [e for e in events if e["type"] == "session.output_transcript.delta"]
    assert len(texts) * FRAME >= sent.size and all(e["delta"] for e in texts)
    clocks = [e["elapsed_ms"] for e in events if e["type"] == "session.output_audio.delta"]
    assert clocks == list(range(80, 80 * len(clocks) + 1, 80))
    first = next(e for e in events if e["type"] == "session.output_audio.delta")
    assert (first["format"], first["sample_rate"], first["channels"]) == ("pcm16", 24_000, 1)


def test_refused_settings_and_events_get_an_error_naming_them():
    app, _ = delay_app(1)

    async def scenario(base):
        async with client(base).realtime.translations.connect(model="delay") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            await conn.session.update(session={"audio": {"output": {"language": "fr"}}}, event_id="evt_fr")
            language = await rec.wait_type("error")
            updated = await rec.wait_type("session.updated")
            await conn.session.update(session={"audio": {"input": {
                "transcription": {"model": "gpt-4o-transcribe"}, "noise_reduction": {"type": "near_field"}}},
                "model": "other", "voice": "alloy"})
            await rec.wait_type("session.updated", after=len(rec.events))
            await conn.send_raw(json.dumps({"type": "session.input_audio_buffer.commit"}))
            await conn.send_raw(json.dumps({"type": "session.input_audio_buffer.append", "audio": "%%%"}))
            await conn.send_raw(json.dumps({"type": "session.input_audio_buffer.append", "audio": "AAA=",
                                            "format": "pcm16"}))
            await rec.wait(lambda e: e["type"] == "error" and e["error"]["param"] == "format")
            await conn.session.close()
            await rec.wait_type("session.closed", timeout=20)
            await asyncio.wait_for(rec.task, 10)
            return rec.events, language, updated

    with serve(app) as base:
        events, language, updated = run(scenario(base))
    sdk_events(events)
    assert language["error"]["param"] == "session.audio.output.language"
    assert language["error"]["event_id"] == "evt_fr" and "'en'" in language["error"]["message"]
    assert updated["session"]["audio"]["output"]["language"] == "en"  # refused: unchanged
    errors = {e["error"]["param"]: e["error"] for e in events if e["type"] == "error"}
    assert "--stt-model" in errors["session.audio.input.transcription"]["message"]
    assert errors["session.audio.input.noise_reduction"]["code"] == "unsupported_parameter"
    assert errors["session.model"]["code"] == "unsupported_parameter"
    assert errors["session.voice"]["code"] == "unknown_parameter"
    assert "session.input_audio_buffer.commit" in errors["type"]["message"]
    assert errors["audio"]["message"] == "audio is not valid base64"
    assert errors["format"]["code"] == "unknown_parameter"
    assert events[-1]["type"] == "session.closed"


def test_events_after_session_close_are_refused_while_it_flushes():
    app, _ = delay_app(1)

    async def scenario(base):
        async with client(base).realtime.translations.connect(model="delay") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            await conn.session.input_audio_buffer.append(audio=pcm16_b64(tone(300, 0.5)))
            await conn.session.close()
            await conn.session.input_audio_buffer.append(audio=pcm16_b64(tone(300, 0.1)))
            refused = await rec.wait_type("error")
            await rec.wait_type("session.closed", timeout=20)
            return refused

    with serve(app) as base:
        refused = run(scenario(base))
    assert "closing" in refused["error"]["message"]


def test_an_unserved_model_is_404_model_not_found_before_the_upgrade():
    from websockets.exceptions import InvalidStatus

    app, _ = delay_app(1)

    async def scenario(base):
        with pytest.raises(InvalidStatus) as denied:
            async with client(base).realtime.translations.connect(model="gpt-realtime-translate"):
                pass
        return denied.value.response

    with serve(app) as base:
        response = run(scenario(base))
    assert response.status_code == 404
    assert json.loads(response.body)["error"]["code"] == "model_not_found"


def test_keys_and_capacity_are_the_other_doors():
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    from parley.realtime.sessions.session import ServerDefaults
    app, _ = delay_app(1, defaults=ServerDefaults(api_key="secret"))

    async def scenario(base):
        url = f"ws://{base}/v1/realtime/translations?model=delay"
        with pytest.raises(InvalidStatus) as denied:
            async with connect(url):
                pass
        keyed = openai.AsyncOpenAI(api_key="secret", base_url=f"http://{base}/v1", websocket_base_url=f"ws://{base}/v1")
        async with keyed.realtime.translations.connect(model="delay") as conn:
            assert (await conn.recv()).type == "session.created"
            with pytest.raises(InvalidStatus) as full:
                await connect(url, additional_headers={"Authorization": "Bearer secret"})
        return denied.value.response, full.value.response

    with serve(app) as base:
        denied, full = run(scenario(base))
    assert denied.status_code == 401
    assert full.status_code == 503 and json.loads(full.body)["reason"] == "full"


def test_a_draining_server_tells_the_session_then_closes_it_going_away():
    from websockets.exceptions import InvalidStatus

    app, _ = delay_app(1)
    app.state.drainer.timeout_s = 0  # close live sessions at once

    async def scenario(base):
        async with client(base).realtime.translations.connect(model="delay") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            request = urllib.request.Request(f"http://{base}/admin/drain", method="POST")
            await asyncio.to_thread(urllib.request.urlopen, request, timeout=5)
            await asyncio.wait_for(rec.task, 10)
            events, code = rec.events, conn._connection.close_code
        with pytest.raises(InvalidStatus) as refused:
            async with client(base).realtime.translations.connect(model="delay"):
                pass
        return events, code, refused.value.response

    with serve(app) as base:
        events, code, refused = run(scenario(base))
    sdk_events(events)
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "server_shutting_down"
    assert code == 1001
    assert refused.status_code == 503 and json.loads(refused.body)["reason"] == "draining"


def test_the_source_transcript_comes_from_the_paired_stt(tiny_moshi_dir, stt_app_factory):  # noqa: F811
    async def scenario(base):
        async with client(base).realtime.translations.connect(model="gpt-realtime") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            await conn.session.update(session={"audio": {"input": {"transcription": {"model": "whisper-2"}}}})
            refused = await rec.wait_type("error")
            await conn.session.update(session={"audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}})
            updated = await rec.wait(lambda e: e["type"] == "session.updated"
                                     and e["session"]["audio"]["input"]["transcription"] is not None)
            await send_paced(conn, np.concatenate([tone(300, 1.2), np.zeros(SR, np.float32)]), chunk=FRAME)
            await rec.wait_type("session.input_transcript.delta", timeout=20)
            await conn.session.close()
            await rec.wait_type("session.closed", timeout=20)
            return rec.events, refused, updated

    with serve(stt_app_factory(tiny_moshi_dir)) as base:
        events, refused, updated = run(scenario(base))
    sdk_events(events)
    assert (refused["error"]["code"], refused["error"]["param"]) == (
        "model_not_found", "session.audio.input.transcription.model")
    assert updated["session"]["audio"]["input"]["transcription"] == {"model": "gpt-4o-transcribe"}
    heard = [e for e in events if e["type"] == "session.input_transcript.delta"]
    assert heard and all(e["delta"] and e["elapsed_ms"] % 80 == 0 for e in heard)
    assert [e for e in events if e["type"] == "session.output_audio.delta"]


def test_the_example_client_translates_a_file(tmp_path, capsys):
    import soundfile

    from test_duplex_client import load_example

    wav, out, text_out = tmp_path / "in.wav", tmp_path / "reply.wav", tmp_path / "reply.txt"
    source = speech_like(2.0)
    soundfile.write(wav, source, SR)
    app, _ = delay_app(1)
    with serve(app) as base:
        assert load_example().main([str(wav), "--translate", "--language", "en", "--url", f"http://{base}",
                                    "--out", str(out), "--text-out", str(text_out)]) == 0  # no --model: the served one
    reply, rate = soundfile.read(out, dtype="float32")
    frames = reply.reshape(-1, FRAME)
    heard = frames[np.abs(frames).max(axis=1) > 0].reshape(-1)
    assert rate == SR and heard.size == source.size  # every frame of the file came back (2 s: whole frames)
    assert text_out.read_text() and "server error" not in capsys.readouterr().err
