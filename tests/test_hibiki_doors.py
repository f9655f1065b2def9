"""`parley serve --demo hibiki` (a tiny random Hibiki-Zero) behind its doors, over a real uvicorn
server on 127.0.0.1:
- /v1/realtime/translations driven by the openai SDK's `client.realtime.translations.connect()`,
  unmodified: ten seconds of speech in, translated audio and the model's transcript out (and the
  source's, from the demo's paired STT); French
  output refused naming `session.audio.output.language`; `session.close` ends the source (Hibiki's
  input end code), the translation runs to the model's end of text, then `session.closed`;
- /api/chat as the Hibiki-Zero web client (kyutai-labs/hibiki-zero frontend/app/page.tsx) speaks
  it: no query, 0x01 + Ogg-Opus pages of 20 ms frames in, 0x01 pages and 0x02 text pieces out, the
  0x00 handshake first; the client ends the session by closing its socket;
- the model listed in /v1/models as a translation model; the conversation doors refuse by name."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from parley.engine import SessionOptions
from parley.realtime.server.demo_model import DEMO_TRANSLATION_MODEL
from parley.realtime.server.serve import ServeConfig, ServeError, build_app
from server_harness import SR, chat_session, serve
from test_server_realtime import Recorder, client, run
from test_server_translation import audio_of, sdk_events, send_paced, speech_like

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def hibiki_url(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PARLEY_CACHE", str(tmp_path_factory.mktemp("parley-cache")))
    try:
        app = build_app(ServeConfig(model=None, demo="hibiki", max_sessions=2, device="cpu", codec_workers=0))
        with serve(app) as url:
            yield url
    finally:
        mp.undo()


def _get(url: str) -> dict:
    return json.loads(urllib.request.urlopen(url, timeout=10).read())


def test_the_model_is_listed_as_a_translation_model(hibiki_url):
    listed = {m["id"]: m["modality"] for m in _get(f"http://{hibiki_url}/v1/models")["data"]}
    assert listed[DEMO_TRANSLATION_MODEL] == "translation"
    assert listed["gpt-realtime-translate"] == "translation"
    assert "duplex" not in listed.values()  # it converses with no one
    assert _get(f"http://{hibiki_url}/api/info")["model"] == DEMO_TRANSLATION_MODEL


def test_ten_seconds_of_speech_come_out_translated_then_the_session_closes_cleanly(hibiki_url):
    source = speech_like(10.0)

    async def scenario(base):
        async with client(base).realtime.translations.connect(model="gpt-realtime-translate") as conn:
            rec = Recorder(conn)
            created = await rec.wait_type("session.created")
            assert created["session"]["audio"]["output"]["language"] == "en"
            await conn.session.update(session={"audio": {"output": {"language": "fr"}, "input": {
                "transcription": {"model": "gpt-4o-transcribe"}}}}, event_id="evt_fr")
            refused = await rec.wait_type("error")
            updated = await rec.wait_type("session.updated")
            assert updated["session"]["audio"]["input"]["transcription"] == {"model": "gpt-4o-transcribe"}
            assert updated["session"]["audio"]["output"]["language"] == "en"
            await send_paced(conn, source, chunk=SR // 5)
            await conn.session.close()
            closed = await rec.wait_type("session.closed", timeout=60)
            await asyncio.wait_for(rec.task, 10)  # the server closed the socket after session.closed
            return rec.events, refused, closed, conn._connection.close_code

    events, refused, closed, close_code = run(scenario(hibiki_url))
    sdk_events(events)
    assert refused["error"]["param"] == "session.audio.output.language"
    assert refused["error"]["event_id"] == "evt_fr" and "'fr'" in refused["error"]["message"]
    assert [e for e in events if e["type"] == "error"] == [refused]
    assert events[-1] is closed and close_code == 1000
    audio = audio_of(events)
    assert audio.size >= 10 * SR and np.abs(audio).max() > 0  # the translation's audio, as long as its source
    assert [e["delta"] for e in events if e["type"] == "session.output_transcript.delta"]
    assert [e["delta"] for e in events if e["type"] == "session.input_transcript.delta"]  # the paired STT's


def test_an_unserved_model_is_404_and_conversation_doors_refuse_by_name(hibiki_url):
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    async def denied(url):
        with pytest.raises(InvalidStatus) as exc:
            async with connect(url, open_timeout=10):
                pass
        return exc.value.response

    for path in ("/v1/realtime/translations?model=parley-demo", "/api/chat?model=parley-demo"):
        unserved = run(denied(f"ws://{hibiki_url}{path}"))
        assert unserved.status_code == 404 and json.loads(unserved.body)["error"]["code"] == "model_not_found"
    for path in ("/v1/realtime?model=gpt-realtime", "/v1/live/sessions"):
        response = run(denied(f"ws://{hibiki_url}{path}"))
        error = json.loads(response.body)["error"]
        assert response.status_code == 400 and error["code"] == "model_not_supported", path
        assert DEMO_TRANSLATION_MODEL in error["message"] and "/v1/realtime/translations" in error["message"]
    request = urllib.request.Request(f"http://{hibiki_url}/v1/realtime/calls", data=b"v=0", method="POST",
                                     headers={"Content-Type": "application/sdp"})
    with pytest.raises(urllib.error.HTTPError) as call:
        urllib.request.urlopen(request, timeout=10)
    assert call.value.code == 400 and "translation" in json.loads(call.value.read())["error"]["message"]

    async def transcription_session():  # the STT rows' sessions need no conversation
        async with connect(f"ws://{hibiki_url}/v1/realtime?intent=transcription", open_timeout=10) as ws:
            return json.loads(await asyncio.wait_for(ws.recv(), 10))

    assert run(transcription_session())["type"] in ("session.created", "transcription_session.created")


def test_persona_is_refused_naming_hibiki(tmp_path, monkeypatch):
    monkeypatch.setenv("PARLEY_CACHE", str(tmp_path))
    with pytest.raises(ServeError, match="Hibiki"):
        build_app(ServeConfig(model=None, demo="hibiki", defaults=SessionOptions(persona="be nice"), device="cpu"))


async def hibiki_zero_web_client(base: str, pcm: np.ndarray, tail_seconds: float = 1.0):
    """What the Hibiki-Zero web client does: opens /api/chat (no query), sends each Ogg page of its
    20 ms Opus frames as [1, ...page] while reading [1, ...pages] into its decoder and [2, ...utf8]
    as words (other kinds, the 0x00 handshake among them, it ignores), then closes the socket."""
    import sphn
    from websockets.asyncio.client import connect

    kinds, words, decoded = [], [], []
    async with connect(f"ws://{base}/api/chat", max_size=None, open_timeout=10) as ws:
        reader, writer = sphn.OpusStreamReader(SR), sphn.OpusStreamWriter(SR)

        async def receive() -> None:
            async for message in ws:
                kinds.append(message[0])
                if message[0] == 2:
                    words.append(bytes(message[1:]).decode("utf8"))
                elif message[0] == 1:
                    decoded.append(np.asarray(reader.append_bytes(message[1:]), np.float32).reshape(-1))

        receiver = asyncio.create_task(receive())
        frame = SR // 50  # the recorder's 20 ms
        for start in range(0, pcm.size, frame):
            page = writer.append_pcm(pcm[start:start + frame])
            if page:
                await ws.send(b"\x01" + page)
            await asyncio.sleep(0.02)
        await asyncio.sleep(tail_seconds)
        await ws.close()  # the client's "disconnect": the session ends with it
        await asyncio.wait_for(receiver, 10)
        close_code = ws.close_code
    return kinds, words, np.concatenate(decoded) if decoded else np.zeros(0, np.float32), close_code


def test_the_hibiki_zero_web_client_protocol_on_api_chat(hibiki_url):
    kinds, words, audio, close_code = run(hibiki_zero_web_client(hibiki_url, speech_like(3.0)))
    assert kinds[0] == 0 and kinds.count(0) == 1  # the handshake, once, first
    assert set(kinds) <= {0, 1, 2} and kinds.count(1) > 10
    assert audio.size >= SR and np.abs(audio).max() > 0
    assert words and all(isinstance(w, str) and w for w in words)
    assert close_code == 1000
    for query, named in (("voice_prompt=NATF2.pt", "voice prompt"), ("text_prompt=be%20nice", "persona")):
        refused = run(chat_session(hibiki_url, None, query=query))  # a conversation's options, refused by name
        assert refused.close_code == 1008 and named in refused.close_reason, refused.close_reason


def test_a_hibiki_checkpoint_given_as_model_serves_the_translation_door(tmp_path):
    from parley.models import write_tiny_hibiki_checkpoint

    directory = write_tiny_hibiki_checkpoint(tmp_path / "hibiki-zero-tiny", kind="hibiki-zero")
    app = build_app(ServeConfig(model=str(directory), max_sessions=1, device="cpu", codec_workers=0))

    async def scenario(base):
        async with client(base).realtime.translations.connect(model="hibiki-zero-tiny") as conn:
            rec = Recorder(conn)
            created = await rec.wait_type("session.created")
            await send_paced(conn, speech_like(1.0), chunk=SR // 5)
            await conn.session.close()
            await rec.wait_type("session.closed", timeout=60)
            return created

    with serve(app) as base:
        listed = {m["id"]: m["modality"] for m in _get(f"http://{base}/v1/models")["data"]}
        created = run(scenario(base))
    assert listed == {"hibiki-zero-tiny": "translation"}
    assert created["session"]["model"] == "hibiki-zero-tiny"
