"""What the server says it serves, and how it answers what it does not serve.

- The startup banner lists exactly the routes the app mounted (server/doors.py's table, less the doors
  whose service is not loaded); `parley --help` and `parley serve --help` describe the same table.
- An unknown WebSocket path is refused 404 before the upgrade (not the framework's 403).
- Under /v1/ every error is OpenAI-shaped JSON that the openai SDK parses: an unknown path, a door
  this server was started without (naming its flag), a wrong method.
"""

from __future__ import annotations

import asyncio
import logging
import re

import httpx2 as httpx  # what the pinned openai SDK ships on
import openai
import pytest

from parley.engine import Engine
from delay_backend import DelayBackend
from parley.realtime.server import doors
from parley.realtime.server import serve as server
from parley.realtime.server.app import ServerInfo, create_app
from parley.realtime.server.services import Services
from parley.realtime.cli import main as cli_main
from parley.realtime.sessions.session import ServerDefaults
from parley.realtime.server.serve import ServeConfig
from server_harness import serve

pytestmark = pytest.mark.timeout(120)


def delay_app(**kwargs):
    return create_app(Services(Engine(DelayBackend(1)), info=ServerInfo(model="delay"), codec_workers=0, **kwargs))


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(api_key="sk-test", base_url=f"http://{base}/v1", max_retries=0, timeout=30)


def banner_paths(app, caplog) -> list[str]:
    """The paths `parley serve`'s "serving on" line lists for `app`."""
    with caplog.at_level(logging.INFO, logger="parley.server"):
        server.log_serving(app, ServeConfig(model=None, port=8123))
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving on")]
    assert line.startswith("serving on http://127.0.0.1:8123 (8 sessions): ")
    return line.split(": ", 1)[1].split(", ")


def mounted(app) -> list[str]:
    paths = [route.path or "/" for route in app.routes]  # the page's Mount("/") keeps "" as its path
    return list(dict.fromkeys(paths))  # /v1/live/sessions: a WebSocket door and a POST door, listed once


def test_the_banner_lists_the_mounted_routes_of_a_server_without_images_or_speech(caplog):
    app = delay_app()
    paths = banner_paths(app, caplog)
    assert paths == mounted(app)
    assert {"/api/chat", "/v1/realtime", "/livez", "/metrics", "/"} <= set(paths)
    assert not {"/v1/images/generations", "/v1/audio/speech", "/v1/audio/transcriptions"} & set(paths)


def test_the_banner_of_the_demo_lists_speech_transcription_and_images(caplog):
    app = server.build_app(ServeConfig(model=None))
    paths = banner_paths(app, caplog)
    assert paths == mounted(app)
    assert paths == list(dict.fromkeys(door.path for door in doors.DOORS))  # the demo serves every door
    assert {"/v1/audio/speech", "/v1/audio/transcriptions", "/v1/images/generations"} <= set(paths)


def test_help_describes_every_door_of_the_table(capsys):
    with pytest.raises(SystemExit):
        cli_main(["--help"])
    top = re.sub(r"\s+", " ", capsys.readouterr().out)
    for path in ("/api/chat", "/v1/realtime", "/v1/audio/speech", "/v1/audio/transcriptions",
                 "/v1/images/generations"):
        assert path in top
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    text = capsys.readouterr().out
    for door in doors.DOORS:  # one line each: method, path, what, and the flag that serves it
        needs = f" [{doors.NEEDS[door.needs][1]}]" if door.needs else ""
        assert re.search(rf"^  {door.method} +{re.escape(door.path)} +{re.escape(door.what + needs)}$", text, re.M), door


async def upgrade_status(base: str, path: str) -> int:
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    try:
        async with connect(f"ws://{base}{path}", open_timeout=10):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


@pytest.mark.parametrize("page", [True, False], ids=["with-page", "no-page"])
def test_a_websocket_to_an_unknown_path_is_404_before_the_upgrade(page):
    app = delay_app() if page else delay_app(web_dir=None)
    with serve(app) as base:
        for path in ("/nowhere", "/v1/nowhere", "/livez", "/"):  # unknown, and HTTP-only doors
            assert asyncio.run(upgrade_status(base, path)) == 404, path
        assert asyncio.run(upgrade_status(base, "/v1/realtime")) == 101


def test_unknown_v1_paths_are_openai_shaped_404s():
    with serve(delay_app()) as base:
        c = client(base)
        with pytest.raises(openai.NotFoundError) as err:
            c.files.list()  # GET /v1/files
        assert err.value.body["message"].startswith("Invalid URL (GET /v1/files)")
        assert err.value.body["type"] == "invalid_request_error" and err.value.body["code"] == "unknown_url"
        with pytest.raises(openai.NotFoundError, match=r"Invalid URL \(POST /v1/completions\)"):
            c.completions.create(model="x", prompt="hello")
        # doors this server was started without: 404 naming the flag that serves them
        with pytest.raises(openai.NotFoundError) as err:
            c.audio.speech.create(model="tts", input="hello", voice="alloy")
        assert "--tts-model" in err.value.body["message"] and err.value.body["code"] == "model_not_found"
        with pytest.raises(openai.NotFoundError, match="--image-model"):
            c.images.generate(prompt="a cat")
        response = httpx.get(f"http://{base}/v1/realtime")  # a WebSocket door asked over plain HTTP
        assert response.status_code == 405
        assert response.json()["error"]["message"] == "/v1/realtime takes WS, not GET."
        # outside /v1 the answer stays plain
        response = httpx.get(f"http://{base}/nowhere")
        assert (response.status_code, response.text) == (404, "Not Found")


def test_speech_takes_every_key_the_middleware_takes(tiny_tts_dir):
    """The speech doors are keyed by security.AccessMiddleware like every door: any configured key
    (--api-key-file: several), by header or query. Their own check compared against the first
    key's text only, so with a key file every speech request was 401."""
    import torch

    from parley.engine import EngineConfig
    from parley.realtime.server.speech_setup import load_speech_service

    service = load_speech_service(tiny_tts_dir, slots=1, voices=tiny_tts_dir / "voices", voice_map=None,
                                  device="cpu", dtype=torch.float32)
    engine = Engine(DelayBackend(1), EngineConfig(tick_seconds=0.5))
    engine.add_slack_source(service.pool)
    app = create_app(Services(engine, ServerDefaults(api_key=("sk-one", "sk-two")), ServerInfo(model="delay"),
                     codec_workers=0, speech=service))
    voice = service.voices.names()[0]
    with serve(app) as base:
        url = f"http://{base}/v1/audio/speech"
        body = {"input": "Hi.", "voice": voice, "response_format": "pcm"}  # model left out: the served one
        assert httpx.post(url, json=body, timeout=60).status_code == 401
        for headers, query in (({"Authorization": "Bearer sk-two"}, ""), ({}, "?api_key=sk-one")):
            response = httpx.post(url + query, json=body, headers=headers, timeout=60)
            assert response.status_code == 200 and response.content, response.text
        voices = httpx.get(f"http://{base}/v1/audio/voices", headers={"Authorization": "Bearer sk-two"})
        assert voice in [v["id"] for v in voices.json()["data"]]
