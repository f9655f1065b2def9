"""The built-in demo (`parley serve` with no --model) is a tiny PersonaPlex: it lists PersonaPlex's
18 voice names, takes an ordinary persona, and an unmodified PersonaPlex client (LiveKit's
plugin, which always sends voice NATF2 and a persona) holds a session with audio both ways.
`--demo moshi` still serves the Moshi kind; `--demo` with --model is refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from parley.realtime.server.demo_model import (DEMO_KINDS, PERSONAPLEX_VOICES, cache_dir, ensure_demo_checkpoint,
                                        write_demo_checkpoint)
from parley.realtime.server.serve import ServeConfig, ServeError, build_app
from server_harness import chat_session, free_port, serve, tone

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 60 words: with the tiny tokenizer about 230 persona frames, past the old 40-frame context.
PERSONA_60_WORDS = ("You are a friendly support agent for a small bakery called Rosa Breads. Greet the caller "
                    "warmly, answer questions about opening hours, prices and orders, and keep every answer "
                    "short. If the caller asks for a cake, take their name, the date they need it, the flavour "
                    "and the number of guests, then read the order back and thank them for calling the bakery.")

PUBLISHED_VOICES = sorted(f"{name}.pt" for name in (
    "NATF0", "NATF1", "NATF2", "NATF3", "NATM0", "NATM1", "NATM2", "NATM3",
    "VARF0", "VARF1", "VARF2", "VARF3", "VARF4", "VARM0", "VARM1", "VARM2", "VARM3", "VARM4"))


@pytest.fixture(scope="module")
def demo_url(tmp_path_factory):
    """The default demo server (ServeConfig with no model), its cache in a temporary folder."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PARLEY_CACHE", str(tmp_path_factory.mktemp("parley-cache")))
    try:
        app = build_app(ServeConfig(model=None, max_sessions=2, device="cpu", codec_workers=0))
        with serve(app) as url:
            yield url
    finally:
        mp.undo()


def _get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


def _metric(base: str, name: str, protocol: str = "moshi") -> float:
    text = urllib.request.urlopen(f"http://{base}/metrics", timeout=10).read().decode()
    found = re.search(rf'^{name}{{protocol="{protocol}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_the_demo_lists_the_18_published_voices_and_takes_personas(demo_url):
    assert sorted(f"{v}.pt" for v in PERSONAPLEX_VOICES) == PUBLISHED_VOICES
    info = _get(f"http://{demo_url}/api/info")
    assert info["demo"] is True and info["prompts"] is True  # the page enables its persona box
    assert info["mimi_dtypes"] == {"duplex": "float32", "tts": "float32", "stt": "float32"}  # auto on the CPU
    assert sorted(_get(f"http://{demo_url}/api/voices")["voices"]) == PUBLISHED_VOICES


def test_the_demo_answers_to_openai_clients_default_model_names(demo_url):
    """A fresh demo takes the names OpenAI's clients send unchanged (as it takes tts-1 and
    whisper-1); any other name is still model_not_found."""
    from websockets.sync.client import connect

    listed = {m["id"]: m["modality"] for m in _get(f"http://{demo_url}/v1/models")["data"]}
    for name in ("gpt-realtime", "gpt-4o-realtime-preview", "gpt-realtime-2.1", "gpt-live-1"):
        assert listed[name] == "duplex", name
    with connect(f"ws://{demo_url}/v1/live/sessions") as ws:
        ws.send(json.dumps({"type": "session.start", "session": {"model": "gpt-live-1"}}))
        while (event := json.loads(ws.recv(timeout=60)))["type"] != "session.started":
            assert event["type"] != "error", event
        assert event["session"]["model"] == "gpt-live-1"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://{demo_url}/v1/models/gpt-5", timeout=10)
    assert err.value.code == 404


def default_transcription_names() -> dict[str, str]:
    """The input-transcription model each installed OpenAI client sends by default, read from the
    client itself (so a changed default fails here, not in a user's first session)."""
    names = {}
    with contextlib.suppress(ImportError):
        from agents.realtime.openai_realtime import DEFAULT_MODEL_SETTINGS
        names["openai-agents"] = DEFAULT_MODEL_SETTINGS["input_audio_transcription"]["model"]
    with contextlib.suppress(ImportError):
        from livekit.plugins.openai.realtime.utils import DEFAULT_INPUT_AUDIO_TRANSCRIPTION
        names["livekit-agents"] = DEFAULT_INPUT_AUDIO_TRANSCRIPTION.model
    with contextlib.suppress(ImportError):
        from pipecat.services.openai.realtime.events import InputAudioTranscription
        names["pipecat"] = InputAudioTranscription().model
    return names


def test_the_demo_transcribes_under_openai_clients_default_transcription_names(demo_url):
    """audio.input.transcription.model takes the STT model's served names, as `model` does on every
    door; the demo's include what OpenAI's clients send by default. An unserved name gets an error
    carrying the client's event id, and the session keeps its transcription setting."""
    from websockets.sync.client import connect

    defaults = default_transcription_names()
    assert defaults, "no OpenAI client installed (tests/run.sh installs them)"
    listed = {m["id"]: m["modality"] for m in _get(f"http://{demo_url}/v1/models")["data"]}
    names = sorted({*defaults.values(), "whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe"})
    assert all(listed.get(name) == "stt" for name in names), (names, listed)

    def update(ws, transcription, event_id):
        ws.send(json.dumps({"type": "session.update", "event_id": event_id, "session": {
            "type": "realtime", "audio": {"input": {"transcription": transcription}}}}))
        errors = []
        while (event := json.loads(ws.recv(timeout=60)))["type"] != "session.updated":
            if event["type"] == "error":
                errors.append(event)
        return errors, event["session"]["audio"]["input"]["transcription"]

    with connect(f"ws://{demo_url}/v1/realtime?model=gpt-realtime") as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "session.created"
        for name in names:
            assert update(ws, {"model": name}, f"evt_{name}") == ([], {"model": name})
        errors, kept = update(ws, {"model": "gpt-5-transcribe"}, "evt_unserved")
        assert kept == {"model": names[-1]}  # unchanged
        assert [(e["error"]["event_id"], e["error"]["code"], e["error"]["param"]) for e in errors] == [
            ("evt_unserved", "model_not_found", "session.audio.input.transcription.model")]
        assert "gpt-4o-mini-transcribe" in errors[0]["error"]["message"]  # it names what is served


def test_openai_agents_realtime_defaults_run_unmodified_against_the_demo(demo_url):
    """openai-agents' RealtimeRunner with its defaults (input transcription by gpt-4o-mini-transcribe,
    semantic_vad): the demo's paired STT takes both, so the session gets no error."""
    agents = pytest.importorskip("agents.realtime")
    import time

    async def scenario():
        runner = agents.RealtimeRunner(agents.RealtimeAgent(name="assistant", instructions="You are a test agent."))
        session = await runner.run(model_config={"url": f"ws://{demo_url}/v1/realtime?model=gpt-realtime-2.1",
                                                 "api_key": "sk-test"})
        seen, errors = [], []
        async with session:
            audio = tone(440, 1.2)
            for i in range(0, audio.size - 1920 + 1, 1920):
                await session.send_audio((audio[i:i + 1920] * 32767).astype("<i2").tobytes())
            deadline = time.monotonic() + 30
            async for event in session:
                seen.append(event.type)
                if event.type == "error":
                    errors.append(event.error)
                if seen.count("audio") >= 3 or time.monotonic() > deadline:
                    break
        return seen, errors

    seen, errors = asyncio.run(scenario())
    assert errors == [] and seen.count("audio") >= 3, (errors, seen)


def test_the_demo_takes_a_60_word_persona(demo_url):
    from urllib.parse import quote
    query = f"voice_prompt=VARM4.pt&text_prompt={quote(PERSONA_60_WORDS)}"
    res = asyncio.run(chat_session(demo_url, tone(300, 0.5), query=query, tail_seconds=0.2))
    assert res.handshake_at is not None, (res.close_code, res.close_reason)
    assert res.audio_messages > 0 and res.close_code != 1008


def test_livekit_personaplex_plugin_unmodified_against_the_demo(demo_url):
    """LiveKit's PersonaPlex RealtimeSession (a websocket client of /api/chat, driven without a
    room) with its defaults: voice NATF2, persona "You are a helpful assistant.". It stays on one
    connection (no 1008, no reconnect), the server receives its audio, and it receives audio."""
    import aiohttp
    from livekit import rtc
    from livekit.plugins.nvidia.experimental import realtime  # tests/run.sh installs it

    connections = _metric(demo_url, "parley_connections_total")
    bytes_in = _metric(demo_url, "parley_bytes_in_total")

    async def run() -> tuple[list, list, list]:
        errors, reconnects, received = [], [], []
        async with aiohttp.ClientSession() as http:
            model = realtime.RealtimeModel(base_url=f"ws://{demo_url}", http_session=http)
            session = model.session()
            session.on("error", errors.append)
            session.on("session_reconnected", reconnects.append)

            async def drain(ev) -> None:
                async for message in ev.message_stream:
                    async for frame in message.audio_stream:
                        received.append(np.frombuffer(frame.data, np.int16))

            tasks = []
            session.on("generation_created", lambda ev: tasks.append(asyncio.ensure_future(drain(ev))))
            pcm = (tone(440, 2.0) * 32767).astype(np.int16)
            for start in range(0, pcm.size, 480):  # 20 ms frames at 24 kHz, paced in real time
                session.push_audio(rtc.AudioFrame(pcm[start:start + 480].tobytes(), 24_000, 1, 480))
                await asyncio.sleep(0.02)
            await asyncio.sleep(1.0)
            await session.aclose()
            await asyncio.gather(*tasks, return_exceptions=True)
        return errors, reconnects, received

    errors, reconnects, received = asyncio.run(run())
    assert not errors, [str(e.error) for e in errors]
    assert not reconnects
    assert _metric(demo_url, "parley_connections_total") == connections + 1  # one connection, kept
    assert _metric(demo_url, "parley_bytes_in_total") - bytes_in > 2000  # ~2 s of its Opus arrived
    audio = np.concatenate(received) if received else np.zeros(0, np.int16)
    assert audio.size >= 24_000 and np.abs(audio).max() > 0  # over a second of the agent's audio


def test_the_moshi_demo_is_reachable_by_the_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path))
    app = build_app(ServeConfig(model=None, demo="moshi", max_sessions=1, device="cpu", codec_workers=0))
    with serve(app) as url:
        assert _get(f"http://{url}/api/info")["prompts"] is False
        assert _get(f"http://{url}/api/voices")["voices"] == []
        res = asyncio.run(chat_session(url, tone(300, 0.5), tail_seconds=0.2))
        assert res.handshake_at is not None and res.audio_messages > 0
        refused = asyncio.run(chat_session(url, None, query="voice_prompt=NATF2.pt"))
        assert refused.close_code == 1008
    assert (cache_dir("moshi") / "model.safetensors").is_file()


def test_demo_flag_is_refused_with_a_model(tiny_moshi_dir):
    with pytest.raises(ServeError, match="--demo"):
        build_app(ServeConfig(model=str(tiny_moshi_dir), demo="moshi"))
    with pytest.raises(ServeError, match="--demo"):
        build_app(ServeConfig(model=None, tts_model="x", demo="personaplex"))
    with pytest.raises(ServeError, match="--demo must be one of"):
        build_app(ServeConfig(model=None, demo="nope"))


def test_parley_serve_refuses_demo_with_model(tmp_path):
    """The command line: `--demo` with `--model` exits 2 with the reason, before loading anything."""
    out = subprocess.run([sys.executable, "-m", "parley.realtime.cli", "serve", "--demo", "moshi", "--model",
                          str(tmp_path / "missing"), "--port", str(free_port())], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PARLEY_CACHE": str(tmp_path)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "served only without --model and --tts-model: drop --demo" in out.stderr, out.stderr[-2000:]
    assert not any(tmp_path.iterdir())  # no demo was written


def test_an_old_moshi_cache_is_not_served_as_the_default(tmp_path, monkeypatch):
    """Earlier Parleys cached the Moshi-kind demo in `demo/`: the default now lives elsewhere."""
    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path))
    old = write_demo_checkpoint(tmp_path / "demo", "moshi")
    (old / ".parley-demo-complete").write_text("old\n")
    assert DEMO_KINDS[0] == "personaplex"
    default = ensure_demo_checkpoint()
    assert default != old and default == cache_dir("personaplex") != cache_dir("moshi")
    config = json.loads((default / "config.json").read_text())
    assert config["dep_q"] == 16 and config["context"] >= 1000
