"""One rule for `model` (server/served_models.py): each modality answers to its checkpoint's name and
the operator's aliases (--served-model-name), another name is OpenAI's 404 model_not_found,
and leaving it out picks the served one; GET /v1/models lists them. Before, speech took any
string, transcription any non-empty one, images answered 400, and /v1/models was a 404."""

from __future__ import annotations

import asyncio
import json
import time

import httpx2 as httpx  # what the pinned openai SDK ships on
import openai
import pydantic
import pytest
import torch

from parley.engine import Engine, EngineConfig
from parley.engine.stt_pool import SttPool
from delay_backend import DelayBackend
from parley.models.checkpoint import load_stt_checkpoint
from parley.models.synthetic import TINY_TTS_VOICES, write_tiny_stt_checkpoint
from parley.realtime.server.app import create_app
from parley.realtime.cli import main as cli_main
from parley.realtime.server.served_models import ModelNotFound, ServedModels, parse_served_names
from parley.realtime.server.serve import ServeConfig, ServeError
from parley.realtime.server.services import ServerInfo, Services, build_images, build_services, register_slack_source
from parley.realtime.server.speech_setup import load_speech_service

from server_harness import serve
from test_server_transcriptions import wav_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_flag_parses_and_refuses_what_it_cannot_serve():
    assert parse_served_names(["tts=tts-1, kyutai-tts", "stt=whisper-1", "tts=gpt-4o-mini-tts"]) == {
        "tts": ("tts-1", "kyutai-tts", "gpt-4o-mini-tts"), "stt": ("whisper-1",)}
    for bad in ("tts", "voice=x", "tts=", "tts=a,,b"):
        with pytest.raises(ValueError, match="--served-model-name"):
            parse_served_names([bad])
    with pytest.raises(ValueError, match="serves no image model"):
        ServedModels.build({"duplex": "m", "image": None}, {"image": ("dall-e-3",)})
    with pytest.raises(ValueError, match="'x' is served for both"):
        ServedModels.build({"duplex": "m", "tts": "t"}, {"duplex": ("x",), "tts": ("x",)})
    models = ServedModels.build({"duplex": "m", "tts": "t"}, {"tts": ("tts-1",)})
    assert models.resolve("tts", None) == "t" and models.resolve("tts", "tts-1") == "tts-1"
    with pytest.raises(ModelNotFound, match="served as 't', 'tts-1'"):
        models.resolve("tts", "m")  # the duplex model's name is not the TTS's


def test_the_cli_refuses_a_bad_flag_before_binding(capsys, monkeypatch):
    assert cli_main(["serve", "--port", "0", "--served-model-name", "speech=tts-1"]) == 2
    assert "MODALITY=NAME" in capsys.readouterr().err
    monkeypatch.setenv("PARLEY_SERVED_MODEL_NAME", "tts")  # the environment gives one string, parsed alike
    assert cli_main(["serve", "--port", "0"]) == 2
    assert "--served-model-name 'tts'" in capsys.readouterr().err


def test_aliases_of_a_modality_the_server_lacks_stop_the_start(tiny_tts_dir):
    config = ServeConfig(model=None, tts_model=str(tiny_tts_dir), tts_voices=str(tiny_tts_dir / "voices"),
                         codec_workers=0, tts_slots=1, served_model_names={"image": ("dall-e-3",)})
    with pytest.raises(ServeError, match="serves no image model"):
        build_services(config)


@pytest.fixture(scope="module")
def server(tiny_tts_dir, tmp_path_factory):
    """Speech, transcription and images around a fabricated duplex backend, with aliases."""
    speech = load_speech_service(tiny_tts_dir, slots=1, voices=tiny_tts_dir / "voices", voice_map=None,
                                 device="cpu", dtype=torch.float32)
    stt = load_stt_checkpoint(write_tiny_stt_checkpoint(tmp_path_factory.mktemp("stt") / "kyutai-stt"),
                              dtype=torch.float32)
    engine = Engine(DelayBackend(1), EngineConfig(tick_seconds=0.5))
    engine.add_slack_source(speech.pool)
    images = build_images(ServeConfig(model=None, image_queue=2), engine, torch.device("cpu"), torch.float32,
                          demo=True)
    pool = SttPool(stt, 1)
    register_slack_source(engine, pool)
    models = ServedModels.build({"duplex": "delay", "tts": speech.model, "stt": pool.name, "image": images.model},
                                parse_served_names(["tts=tts-1,gpt-4o-mini-tts", "stt=whisper-1"]), created=1234)
    app = create_app(Services(engine, info=ServerInfo(model="delay"), codec_workers=0, speech=speech,
                              stt_pool=pool, images=images, models=models))
    with serve(app) as url:
        yield f"http://{url}", speech


def sdk(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def test_models_list_and_retrieve(server, tiny_tts_dir):
    url, _ = server
    listed = sdk(url).models.list().data
    assert [(m.id, m.modality) for m in listed] == [
        ("delay", "duplex"), (tiny_tts_dir.name, "tts"), ("tts-1", "tts"), ("gpt-4o-mini-tts", "tts"),
        ("kyutai-stt", "stt"), ("whisper-1", "stt"), ("parley-demo-image", "image")]
    assert all(m.object == "model" and m.owned_by == "parley" and m.created == 1234 for m in listed)
    one = sdk(url).models.retrieve("whisper-1")
    assert (one.id, one.modality, one.object) == ("whisper-1", "stt", "model")
    with pytest.raises(openai.NotFoundError) as err:
        sdk(url).models.retrieve("gpt-5")
    assert err.value.code == "model_not_found"


def test_a_wrong_model_is_404_model_not_found_on_every_http_door(server):
    url, _ = server
    c = sdk(url)
    wav = wav_bytes(torch.zeros(24_000).numpy())
    calls = {
        "speech": lambda: c.audio.speech.create(model="whisper-1", input="Hi.", voice=TINY_TTS_VOICES[0]),
        "transcription": lambda: c.audio.transcriptions.create(model="tts-1", file=("a.wav", wav)),
        "images": lambda: c.images.generate(model="dall-e-3", prompt="a cat", size="auto"),
    }
    for door, call in calls.items():
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.code == "model_not_found" and err.value.param == "model", door
        assert "GET /v1/models" in err.value.body["message"], door


def test_an_alias_or_no_model_is_served(server):
    url, _ = server
    c = sdk(url)
    wav = wav_bytes(torch.zeros(24_000).numpy())
    assert c.audio.speech.create(model="gpt-4o-mini-tts", input="Hi.", voice=TINY_TTS_VOICES[0],
                                 response_format="pcm").content
    assert c.audio.transcriptions.create(model="whisper-1", file=("a.wav", wav)).text is not None
    assert c.images.generate(model="parley-demo-image", prompt="a cat", size="auto",
                             extra_body={"num_inference_steps": 1}).data[0].b64_json
    # model left out (the SDK requires it on speech and transcription; plain HTTP does not)
    r = httpx.post(f"{url}/v1/audio/speech", json={"input": "Hi.", "voice": TINY_TTS_VOICES[0],
                                                   "response_format": "pcm"}, timeout=120)
    assert r.status_code == 200 and r.content
    r = httpx.post(f"{url}/v1/audio/transcriptions", files={"file": ("a.wav", wav)}, timeout=120)
    assert r.status_code == 200 and "text" in r.json()
    assert c.images.generate(prompt="a cat", size="auto", extra_body={"num_inference_steps": 1}).data[0].b64_json


def upgrade(url: str, path: str) -> tuple[int, bytes]:
    """The status a WebSocket upgrade gets (101: accepted, then closed) and the refusal's body."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    async def attempt() -> tuple[int, bytes]:
        try:
            async with connect(f"{url.replace('http', 'ws')}{path}", open_timeout=10):
                return 101, b""
        except InvalidStatus as exc:
            return exc.response.status_code, exc.response.body

    return asyncio.run(attempt())


def test_api_chat_with_a_wrong_model_in_its_url_is_404_before_the_upgrade(server):
    """/api/chat ignored a `model` query parameter it does not serve (any name was a session)."""
    status, body = upgrade(server[0], "/api/chat?model=gpt-5")
    assert status == 404 and json.loads(body)["error"]["code"] == "model_not_found"
    assert upgrade(server[0], "/api/chat?model=delay")[0] == 101  # the served name (left out: every other chat test)


def test_realtime_and_live_with_a_wrong_model_in_the_url_are_404_before_the_upgrade(server):
    """/v1/realtime took any `?model=` as the session's label. A transcription session
    (?intent=transcription) is the STT's: its names, not the duplex model's."""
    url, _ = server
    for path in ("/v1/realtime?model=gpt-realtime", "/v1/realtime?model=whisper-1",
                 "/v1/realtime?intent=transcription&model=delay", "/v1/live/sessions?model=gpt-live-1"):
        status, body = upgrade(url, path)
        error = json.loads(body)["error"]
        assert (status, error["code"], error["param"]) == (404, "model_not_found", "model"), path
        assert "GET /v1/models" in error["message"], path
    for path in ("/v1/realtime?model=delay", "/v1/realtime", "/v1/realtime?intent=transcription&model=whisper-1",
                 "/v1/realtime?intent=transcription&model=kyutai-stt"):
        assert accepted(url, path), path


def slot_free(url: str, wait_s: float = 10.0) -> None:
    """Wait until the one duplex slot is free again (/readyz is 503 while the last session releases it)."""
    deadline = time.monotonic() + wait_s
    while httpx.get(f"{url}/readyz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the previous session kept its slot"
        time.sleep(0.1)


def accepted(url: str, path: str, wait_s: float = 10.0) -> bool:
    """The upgrade is accepted, once the one slot the previous session held is free again (503 until then)."""
    deadline = time.monotonic() + wait_s
    while (status := upgrade(url, path)[0]) == 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    return status == 101


def test_realtime_session_update_with_a_wrong_model_is_an_error_and_the_session_goes_on(server):
    """session.model was taken as the session's label, whatever it named."""
    from openai.types.realtime import RealtimeServerEvent

    from test_server_realtime import Recorder, client

    events = pydantic.TypeAdapter(RealtimeServerEvent)

    async def scenario(base):
        async with client(base).realtime.connect(model="delay") as conn:
            rec = Recorder(conn)
            assert (await rec.wait_type("session.created", timeout=20))["session"]["model"] == "delay"
            await conn.session.update(session={"type": "realtime", "model": "gpt-realtime",
                                               "instructions": "Be brief."}, event_id="evt_model")
            error = await rec.wait_type("error")
            updated = await rec.wait_type("session.updated")
            await conn.close()
            await rec.task
            return error, updated

    slot_free(server[0])
    error, updated = asyncio.run(scenario(server[0].removeprefix("http://")))
    events.validate_python(error)
    assert (error["error"]["code"], error["error"]["param"], error["error"]["event_id"]) == (
        "model_not_found", "session.model", "evt_model")
    assert "served as 'delay'" in error["error"]["message"]
    assert updated["session"]["model"] == "delay" and updated["session"]["instructions"] == "Be brief."


def test_live_session_start_with_a_wrong_model_is_an_error_and_a_served_one_starts(server):
    """GPT-Live's session.start took any `session.model` as the session's label."""
    from openai.types.live import ServerEvent

    from test_server_realtime import Recorder, client

    events = pydantic.TypeAdapter(ServerEvent)

    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            await conn.session.start(session={"model": "gpt-live-1"}, event_id="wrong")
            error = await rec.wait(lambda e: e.get("client_event_id") == "wrong", timeout=20)
            await conn.session.start(session={"model": "delay"}, event_id="served")
            started = await rec.wait(lambda e: e.get("client_event_id") == "served", timeout=20)
            await conn.session.close()
            await rec.wait_type("session.closed", timeout=10)
            await rec.task
            return error, started

    slot_free(server[0])
    error, started = asyncio.run(scenario(server[0].removeprefix("http://")))
    events.validate_python(error)
    events.validate_python(started)
    assert (error["type"], error["error"]["code"], error["error"]["param"]) == (
        "error", "model_not_found", "session.model")
    assert started["type"] == "session.started" and started["session"]["model"] == "delay"
