"""services.build_services: a TTS-only server serves the STT and image models it was given
(NoDuplexBackend under the slack sources); the TTS voices are read at start (a broken file
stops the start, naming it; no request reads a voice file); a request that fails on the
server's side is still an OpenAI-shaped error."""

from __future__ import annotations

import httpx2 as httpx  # what the pinned openai SDK ships on
import openai
import pytest
import torch

import parley.models.tts_checkpoint as tts_checkpoint
from parley.engine import Engine, EngineConfig
from delay_backend import DelayBackend
from parley.models.checkpoint import CheckpointError
from parley.models.synthetic import TINY_TTS_SUFFIX, TINY_TTS_VOICES, write_tiny_stt_checkpoint
from parley.models.tiny_diffusion import write_tiny_pipeline
from parley.realtime.server.app import create_app
from parley.realtime.server.serve import ServeConfig, ServeError, build_app
from parley.realtime.server.services import ServerInfo, Services, build_services
from parley.realtime.server.speech_setup import load_speech_service

from server_harness import serve
from test_server_transcriptions import wav_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tts_only(tiny_tts_dir, **config) -> ServeConfig:
    return ServeConfig(model=None, tts_model=str(tiny_tts_dir), tts_voices=str(tiny_tts_dir / "voices"),
                       codec_workers=0, torch_threads=1, tts_slots=1, stt_slots=1, **config)


def test_a_tts_only_server_serves_its_stt_and_image_models(tiny_tts_dir, tmp_path):
    """They were dropped without a word: the TTS-only branch built the engine and app from the
    TTS alone, so /v1/audio/transcriptions and /v1/images/generations were 404."""
    stt_dir = write_tiny_stt_checkpoint(tmp_path / "stt")
    image_dir = write_tiny_pipeline(tmp_path / "image")
    app = build_app(tts_only(tiny_tts_dir, stt_model=str(stt_dir), image_model=str(image_dir), image_queue=2))
    with serve(app) as url:
        c = openai.OpenAI(base_url=f"http://{url}/v1", api_key="x", max_retries=0)
        assert {(m.id, m.modality) for m in c.models.list().data} == {
            (tiny_tts_dir.name, "tts"), ("stt", "stt"), ("image", "image")}
        clip = torch.zeros(24_000).numpy()
        assert c.audio.transcriptions.create(model="stt", file=("a.wav", wav_bytes(clip))).text is not None
        image = c.images.generate(prompt="a cat", size="auto", extra_body={"num_inference_steps": 1})
        assert image.data[0].b64_json
        r = httpx.post(f"http://{url}/v1/audio/speech", timeout=120,
                       json={"input": "Hi.", "voice": TINY_TTS_VOICES[0], "response_format": "wav"})
        assert r.status_code == 200 and r.content[:4] == b"RIFF"


def test_a_tts_only_server_refuses_a_duplex_setting(tiny_tts_dir):
    from parley.engine import SessionOptions

    with pytest.raises(ServeError, match="--persona / --voice"):
        build_services(tts_only(tiny_tts_dir, defaults=SessionOptions(persona="a pirate")))


def broken_voice_set(tiny_tts_dir, tmp_path):
    """The tiny voice set with its last voice file (not the first: the old code read that one) broken."""
    voices = tmp_path / "voices"
    for name in TINY_TTS_VOICES:
        target = voices / f"{name}{TINY_TTS_SUFFIX}"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((tiny_tts_dir / "voices" / f"{name}{TINY_TTS_SUFFIX}").read_bytes())
    broken = voices / f"{TINY_TTS_VOICES[-1]}{TINY_TTS_SUFFIX}"
    broken.write_bytes(b"not a safetensors file")
    return voices, broken


def test_a_broken_voice_file_stops_the_start_naming_it(tiny_tts_dir, tmp_path):
    """It passed the start and every request for that voice was a bare 500 (CheckpointError is a
    RuntimeError; speech_api caught ValueError only)."""
    voices, broken = broken_voice_set(tiny_tts_dir, tmp_path)
    with pytest.raises(CheckpointError, match=str(broken)):
        load_speech_service(tiny_tts_dir, slots=1, voices=voices, voice_map=None, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def speech_server(tiny_tts_dir):
    service = load_speech_service(tiny_tts_dir, slots=1, voices=tiny_tts_dir / "voices", voice_map=None,
                                  device="cpu", dtype=torch.float32)
    engine = Engine(DelayBackend(1), EngineConfig(tick_seconds=0.5))
    engine.add_slack_source(service.pool)
    with serve(create_app(Services(engine, info=ServerInfo(model="delay"), codec_workers=0, speech=service))) as url:
        yield f"http://{url}", service


def test_no_request_reads_a_voice_file(speech_server, monkeypatch):
    """Every voice was read at start: a request for any of them touches no file (the web layer read
    each voice lazily, on the event loop, at its first request)."""
    url, _ = speech_server

    def no_file(*args, **kwargs):
        raise AssertionError("a voice file was read at request time")

    monkeypatch.setattr(tts_checkpoint, "safe_open", no_file)
    monkeypatch.setattr(tts_checkpoint, "read_voice", no_file)
    for voice in TINY_TTS_VOICES:
        r = httpx.post(f"{url}/v1/audio/speech", timeout=120,
                       json={"input": "Hi.", "voice": voice, "response_format": "pcm"})
        assert r.status_code == 200 and r.content, (voice, r.text)


def test_a_server_fault_before_synthesis_is_an_openai_shaped_500(speech_server, monkeypatch):
    url, service = speech_server

    def broken_submit(*args, **kwargs):
        raise RuntimeError("the pool broke")

    monkeypatch.setattr(service.pool, "submit", broken_submit)
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        c.audio.speech.create(model=service.model, input="Hi.", voice=TINY_TTS_VOICES[0])
    assert err.value.body["type"] == "server_error" and "RuntimeError" in err.value.body["message"]
