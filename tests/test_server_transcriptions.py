"""POST /v1/audio/transcriptions against a real server, with the stock `openai` SDK; and
`parley transcribe`. The STT is the tiny random checkpoint: transcripts are nonsense, but
they must equal the model's own greedy transcript computed directly (tests/test_stt_pool.py)."""

from __future__ import annotations

import asyncio
import io
import json
import urllib.request

import numpy as np
import openai
import pytest
import soundfile
import torch

from parley.engine import Engine, EngineConfig
from parley.engine.stt_pool import SttPool
from delay_backend import DelayBackend
from parley.models.checkpoint import load_stt_checkpoint
from parley.models.synthetic import write_tiny_stt_checkpoint
from parley.realtime.server.app import ServerInfo, create_app
from parley.realtime.server.served_models import ServedModels
from parley.realtime.server.services import Services, register_slack_source
from parley.realtime.cli import main as cli_main
from parley.realtime.server.serve import ServeConfig, build_app

from server_harness import assert_transcript_delays, chat_session, serve, tone
from test_stt_pool import audio, expected_text


@pytest.fixture(scope="module")
def stt_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return write_tiny_stt_checkpoint(tmp_path_factory.mktemp("stt"))


@pytest.fixture(scope="module")
def stt(stt_dir):
    return load_stt_checkpoint(stt_dir, dtype=torch.float32)


def wav_bytes(pcm: np.ndarray) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, pcm, 24_000, subtype="FLOAT", format="WAV")  # exact samples
    return buf.getvalue()


def app_with(pool: SttPool | None):
    engine = Engine(DelayBackend(2), EngineConfig())
    if pool is not None:
        register_slack_source(engine, pool)
    # served as --served-model-name stt=stt,kyutai/stt-1b-en_fr would: the names the tests send
    models = ServedModels.build({"duplex": "delay", "stt": pool and pool.name},
                                {"stt": ("stt", "kyutai/stt-1b-en_fr")} if pool else {})
    return create_app(Services(engine, info=ServerInfo(model="delay"), codec_workers=0, stt_pool=pool, models=models))


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="x", base_url=f"http://{url}/v1", max_retries=0, timeout=60)


def test_sdk_json_verbose_text_and_stream(stt):
    clip = audio(1.2, 11)
    want = expected_text(stt, clip)
    assert want
    with serve(app_with(SttPool(stt, slots=2))) as url:
        c = client(url)
        result = c.audio.transcriptions.create(model="kyutai/stt-1b-en_fr", file=("a.wav", wav_bytes(clip)))
        assert result.text == want

        verbose = c.audio.transcriptions.create(model="stt", file=("a.wav", wav_bytes(clip)), language="en",
                                                response_format="verbose_json", timestamp_granularities=["word"])
        assert verbose.text == want and verbose.duration == pytest.approx(1.2)
        assert " ".join(w.word for w in verbose.words) == " ".join(want.split())
        assert all(0 <= w.start <= w.end for w in verbose.words)

        plain = c.audio.transcriptions.create(model="stt", file=("a.wav", wav_bytes(clip)), response_format="text")
        assert plain.strip() == want

        events = list(c.audio.transcriptions.create(model="stt", file=("a.wav", wav_bytes(clip)), stream=True))
        assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
        assert events[-1].type == "transcript.text.done" and events[-1].text == want
        assert "".join(e.delta for e in events[:-1]) == want


def test_sdk_errors_name_the_parameter(stt):
    with serve(app_with(SttPool(stt, slots=1))) as url:
        c = client(url)
        wav = wav_bytes(audio(0.3, 12))
        with pytest.raises(openai.BadRequestError) as err:
            c.audio.transcriptions.create(model="stt", file=("a.wav", wav), language="de")
        assert err.value.body["param"] == "language"
        with pytest.raises(openai.BadRequestError) as err:
            c.audio.transcriptions.create(model="stt", file=("a.wav", b"not audio"))
        assert err.value.body["param"] == "file"
        with pytest.raises(openai.BadRequestError) as err:
            c.audio.transcriptions.create(model="stt", file=("a.wav", wav), response_format="srt")
        assert err.value.body["param"] == "response_format"
        # the server goes on
        assert c.audio.transcriptions.create(model="stt", file=("a.wav", wav)).text is not None
        # /metrics: the pool's counters (engine/stt_pool.py slack_counters)
        metrics = urllib.request.urlopen(f"http://{url}/metrics", timeout=10).read().decode()
        assert "parley_engine_stt_completed_total 1.0" in metrics and "parley_engine_stt_slots 1.0" in metrics
        assert "parley_engine_stt_live 0.0" in metrics and "parley_engine_stt_steps_total" in metrics
    with serve(app_with(None)) as url:  # 404 like speech and images without their model
        with pytest.raises(openai.NotFoundError) as err:
            client(url).audio.transcriptions.create(model="stt", file=("a.wav", wav))
        assert err.value.body["param"] == "model" and "--stt-model" in err.value.body["message"]


def test_cli_transcribe(stt, stt_dir, tmp_path, capsys):
    clip = audio(0.9, 13)
    path = tmp_path / "in.wav"
    path.write_bytes(wav_bytes(clip))
    assert cli_main(["transcribe", "--model", str(stt_dir), str(path)]) == 0
    assert capsys.readouterr().out.strip() == expected_text(stt, clip)
    assert cli_main(["transcribe", "--model", str(stt_dir), "--format", "json", str(path)]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["text"] == expected_text(stt, clip) and body["words"]
    assert cli_main(["transcribe", "--model", str(tmp_path / "missing"), str(path)]) == 2


def test_chat_transcript_sends_the_users_words_as_0x07(tiny_moshi_dir, tmp_path):
    stt_dir = write_tiny_stt_checkpoint(tmp_path / "stt", mimi_from=tiny_moshi_dir)
    app = build_app(ServeConfig(model=str(tiny_moshi_dir), stt_model=str(stt_dir), max_sessions=1, stt_slots=1))
    with serve(app) as url:
        res = asyncio.run(chat_session(url, tone(300, 1.0), query="transcript=1", tail_seconds=0.4))
        assert res.handshake_at is not None and res.audio_messages > 0
        assert "".join(res.user_text).strip()  # the random tiny STT transcribes something (nonsense)
        # each 0x07 message was timed from its input frame's arrival (the tiny STT's delay: 2 frames)
        assert_transcript_delays(url, "paired", len(res.user_text), model_delay=0.16)
        plain = asyncio.run(chat_session(url, tone(300, 0.3), tail_seconds=0.2))
        assert plain.user_text == []


def test_bf16_mimi_is_shared_with_the_stt_model_and_serves(tiny_moshi_dir, tmp_path):
    """--mimi-dtype bfloat16 casts every Mimi after loading (/api/info says so): the duplex and STT
    codecs stay one (paired transcription needs that), and a session talks and is transcribed."""
    stt_dir = write_tiny_stt_checkpoint(tmp_path / "stt", mimi_from=tiny_moshi_dir)
    app = build_app(ServeConfig(model=str(tiny_moshi_dir), stt_model=str(stt_dir), max_sessions=1, stt_slots=1,
                                mimi_dtype="bfloat16"))
    with serve(app) as url:
        info = json.loads(urllib.request.urlopen(f"http://{url}/api/info", timeout=10).read())
        assert info["mimi_dtypes"] == {"duplex": "bfloat16", "stt": "bfloat16"}
        res = asyncio.run(chat_session(url, tone(300, 0.6), query="transcript=1", tail_seconds=0.3))
        assert res.handshake_at is not None and res.audio_messages > 0
        assert "".join(res.user_text).strip()


def test_chat_transcript_without_stt_model_is_refused_by_name(tiny_moshi_dir):
    with serve(build_app(ServeConfig(model=str(tiny_moshi_dir), max_sessions=1))) as url:
        res = asyncio.run(chat_session(url, tone(300, 0.3), query="transcript=1", tail_seconds=0.2))
        assert res.close_code == 1008 and "transcript" in res.close_reason and "speech-to-text" in res.close_reason
