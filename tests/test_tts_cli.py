"""`parley tts` offline, and `parley serve` wiring: the demo's TTS answers to OpenAI's 13 voice
names, a TTS-only server refuses duplex sessions with a reason, bad TTS flags exit 2."""

from __future__ import annotations

import json

import httpx2 as httpx  # what the pinned openai SDK ships on
import numpy as np
import pytest
import soundfile as sf

from parley.realtime import cli
from parley.realtime.server.demo_model import OPENAI_VOICE_NAMES
from parley.realtime.server.serve import ServeConfig, build_app
from server_harness import serve

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_parley_tts_writes_a_wav_and_word_timings(tiny_tts_dir, tmp_path):
    out, words = tmp_path / "out.wav", tmp_path / "words.json"
    rc = cli.main(["tts", "--model", str(tiny_tts_dir), "--voices", str(tiny_tts_dir / "voices"),
                   "--voice", "tiny/alpha",
                   "--text", "Hello there, my friend.", "--output", str(out), "--words-json", str(words), "--greedy"])
    assert rc == 0
    pcm, sr = sf.read(out)
    assert sr == 24000 and pcm.size > 0 and pcm.size % 1920 == 0 and np.abs(pcm).max() > 0
    timings = json.loads(words.read_text())
    assert [w["text"] for w in timings] == ["Hello", "there,", "my", "friend."]
    assert all(a["stop_s"] == b["start_s"] for a, b in zip(timings, timings[1:]))
    assert timings[-1]["stop_s"] <= pcm.size / 24000


def test_parley_tts_honours_mimi_dtype(tiny_tts_dir, tmp_path):
    """--mimi-dtype reaches the codec of `parley tts` (as of `offline` and `transcribe`, one flag):
    auto is float32 on the CPU, so its greedy WAV equals float32's bit for bit; bfloat16 decodes
    the same tokens near it but not equal."""
    def say(*flags):
        out = tmp_path / f"out{len(flags)}{'-'.join(flags)}.wav"
        assert cli.main(["tts", "--model", str(tiny_tts_dir), "--voices", str(tiny_tts_dir / "voices"),
                         "--voice", "tiny/alpha", "--text", "Hello there.", "--output", str(out), "--greedy",
                         *flags]) == 0
        return sf.read(out)[0]

    auto, fp32, bf16 = say(), say("--mimi-dtype", "float32"), say("--mimi-dtype", "bfloat16")
    assert np.array_equal(auto, fp32)
    assert bf16.shape == fp32.shape and not np.array_equal(bf16, fp32)
    assert np.corrcoef(bf16, fp32)[0, 1] > 0.999  # 0.99996 on the tiny TTS


def test_parley_tts_refuses_an_unknown_voice(tiny_tts_dir, tmp_path, capsys):
    rc = cli.main(["tts", "--model", str(tiny_tts_dir), "--voices", str(tiny_tts_dir / "voices"), "--voice", "nobody",
                   "--text", "Hi.", "--output", str(tmp_path / "x.wav")])
    assert rc == 2 and "unknown voice 'nobody'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--tts-slots", "0"], "--tts-slots must be at least 1"),
    (["--tts-voices", "somewhere"], "--tts-voices and --tts-voice-map need --tts-model"),
])
def test_bad_tts_flags_exit_2(argv, message, capsys):
    assert cli.main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_demo_serves_tts_with_all_openai_voice_names(tmp_path, monkeypatch):
    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path))
    app = build_app(ServeConfig(model=None, codec_workers=0, torch_threads=1, tts_slots=2))
    with serve(app) as url:
        names = {v["id"] for v in httpx.get(f"http://{url}/v1/audio/voices").json()["data"]}
        assert set(OPENAI_VOICE_NAMES) <= names
        for voice in OPENAI_VOICE_NAMES:
            r = httpx.post(f"http://{url}/v1/audio/speech", timeout=120,
                           json={"model": "tts-1", "input": "Hi.", "voice": voice, "response_format": "pcm"})
            assert r.status_code == 200 and len(r.content) > 0, voice


def test_tts_only_server_refuses_duplex_sessions_with_a_reason(tiny_tts_dir):
    import websockets.sync.client as ws_client

    app = build_app(ServeConfig(model=None, tts_model=str(tiny_tts_dir), tts_voices=str(tiny_tts_dir / "voices"),
                                codec_workers=0, torch_threads=1, tts_slots=1))
    with serve(app) as url:
        r = httpx.post(f"http://{url}/v1/audio/speech", timeout=120,
                       json={"input": "Hi.", "voice": "tiny/bravo", "response_format": "wav"})
        assert r.status_code == 200 and r.content[:4] == b"RIFF"
        with ws_client.connect(f"ws://{url}/api/chat") as ws:
            try:
                while True:
                    ws.recv(timeout=20)
            except Exception as exc:  # the server closes the session, saying why
                reason = getattr(getattr(exc, "rcvd", None), "reason", "")
        assert "no duplex model" in reason
