"""/v1/realtime with real clients nobody here wrote: the `openai` SDK (GA and beta), strict
validation of every emitted event (openai-agents' GA adapter, pipecat's parser, the SDK's
beta models), and an openai-agents RealtimeRunner session. Over a real uvicorn server on
127.0.0.1, on the fabricated echo backend (output frame t == input frame t - 1)."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest
from pydantic import TypeAdapter

from delay_backend import DelayBackend
from server_harness import FRAME, OPENAI_ALIASES, SR, delay_app, serve, tone

pytestmark = pytest.mark.timeout(60)

openai = pytest.importorskip("openai")


def run(coro):
    return asyncio.run(coro)


def pcm16_b64(pcm: np.ndarray) -> str:
    return base64.b64encode((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()).decode()


# ---- strict validators -----------------------------------------------------------------------


def ga_validators():
    out = []
    try:
        from agents.realtime.openai_realtime import get_server_event_type_adapter
        adapter = get_server_event_type_adapter()
        out.append(("openai-agents", lambda e: adapter.validate_python(e)))
    except ImportError:
        pass
    try:
        from pipecat.services.openai.realtime.events import parse_server_event
        out.append(("pipecat", lambda e: parse_server_event(json.dumps(e))))
    except ImportError:
        pass
    from openai.types.realtime import RealtimeServerEvent
    sdk = TypeAdapter(RealtimeServerEvent)
    out.append(("openai GA models", lambda e: sdk.validate_python(e)))
    return out


def beta_validators():
    from openai.types.beta.realtime import RealtimeServerEvent
    sdk = TypeAdapter(RealtimeServerEvent)
    return [("openai beta models", lambda e: sdk.validate_python(e))]


def check_all(events: list[dict], validators) -> None:
    ids = [e["event_id"] for e in events]
    assert len(ids) == len(set(ids)), "event ids must be unique"
    for event in events:
        for name, validate in validators:
            try:
                validate(event)
            except Exception as exc:  # noqa: BLE001 - report which validator and which event
                raise AssertionError(f"{name} rejected {event['type']}: {exc}\n{json.dumps(event)[:600]}") from exc


class Recorder:
    """Reads raw events off an SDK connection into a list, in the background."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.events: list[dict] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed
        try:
            while True:
                self.events.append(json.loads(await self.conn.recv_bytes()))
        except ConnectionClosed:
            pass

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    async def wait(self, predicate, timeout: float = 8.0) -> dict:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for e in self.events[seen:]:
                if predicate(e):
                    return e
            seen = len(self.events)
            await asyncio.sleep(0.01)
        raise AssertionError(f"no matching event in {timeout} s; got {[e['type'] for e in self.events][-30:]}")

    async def wait_type(self, kind: str, timeout: float = 8.0, after: int = 0) -> dict:
        start = after
        return await self.wait(lambda e: e["type"] == kind and self.events.index(e) >= start, timeout)


async def stream(conn, pcm: np.ndarray, prebuffer: int = 3) -> None:
    t0 = time.monotonic()
    for i in range(pcm.size // FRAME):
        await conn.input_audio_buffer.append(audio=pcm16_b64(pcm[i * FRAME:(i + 1) * FRAME]))
        due = t0 + max(0, i + 1 - prebuffer) * FRAME / SR
        await asyncio.sleep(max(0.0, due - time.monotonic()))


def client(base: str):
    return openai.AsyncOpenAI(api_key="sk-test", base_url=f"http://{base}/v1", websocket_base_url=f"ws://{base}/v1")


# ---- GA ---------------------------------------------------------------------------------------


def test_ga_sdk_session_audio_transcript_cancel_and_errors():
    app, backend = delay_app(2)

    async def scenario(base):
        async with client(base).realtime.connect(model="gpt-realtime") as conn:
            rec = Recorder(conn)
            created = await rec.wait_type("session.created")
            assert rec.events[0] is created
            assert created["session"]["type"] == "realtime" and created["session"]["id"].startswith("sess_")

            await conn.session.update(session={"type": "realtime", "instructions": "You are Ada.",
                                               "audio": {"output": {"voice": "NATF2.pt"}}})
            updated = await rec.wait_type("session.updated")
            assert updated["session"]["instructions"] == "You are Ada."
            assert updated["session"]["audio"]["output"]["voice"] == "NATF2.pt"

            sent = tone(440, 1.6)
            await stream(conn, sent)
            await rec.wait(lambda e: e["type"] == "input_audio_buffer.speech_started")
            await rec.wait(lambda e: len(rec.of("response.output_audio.delta")) >= 8)
            assert rec.of("response.output_audio_transcript.delta")
            response_id = rec.of("response.created")[-1]["response"]["id"]

            await conn.response.cancel()
            done = await rec.wait(lambda e: e["type"] == "response.done")
            assert done["response"]["id"] == response_id and done["response"]["status"] == "cancelled"
            n_after_cancel = len(rec.of("response.output_audio.delta"))
            await stream(conn, tone(440, 0.5))  # the agent keeps "talking": it stays muted
            await asyncio.sleep(0.3)
            assert len(rec.of("response.output_audio.delta")) == n_after_cancel

            # Bad events: each gets an OpenAI-shaped error, the session goes on.
            errors_before = len(rec.of("error"))
            await conn.send_raw("{this is not json")
            await conn.send_raw(json.dumps({"type": "no.such.event", "event_id": "evt_client_1"}))
            await conn.send_raw(json.dumps({"type": "input_audio_buffer.append", "audio": "@@not base64@@"}))
            await conn.send_raw(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (9 * 1024 * 1024)}))
            await conn.send_raw(json.dumps({"type": "response.cancel"}))
            await conn.send_raw(json.dumps([1, 2, 3]))
            await rec.wait(lambda e: len(rec.of("error")) >= errors_before + 6)
            errors = rec.of("error")[errors_before:]
            codes = [e["error"]["code"] for e in errors]
            assert codes == ["invalid_json", "invalid_value", "invalid_value", "message_too_large",
                             "response_cancel_not_active", "invalid_json"], codes
            assert errors[1]["error"]["event_id"] == "evt_client_1"
            assert errors[2]["error"]["param"] == "audio"
            assert all(e["error"]["type"] == "invalid_request_error" for e in errors)

            await conn.session.update(session={"type": "realtime", "instructions": "Still here."})
            await rec.wait(lambda e: e["type"] == "session.updated" and e["session"]["instructions"] == "Still here.")
            await conn.close()
            await rec.task
            return rec.events

    with serve(app) as base:
        events = run(scenario(base))
    assert backend.prefills[1][1].persona == "You are Ada." and backend.prefills[1][1].voice == "NATF2.pt"
    check_all(events, ga_validators())
    # Response events come in OpenAI's order.
    order = [e["type"] for e in events if e["type"].startswith(("response.", "conversation.item"))]
    first = order.index("response.created")
    assert order[first:first + 4] == ["response.created", "response.output_item.added",
                                      "conversation.item.added", "response.content_part.added"]
    done_at = order.index("response.done")
    tail = [t for t in order[first:done_at + 1] if not t.endswith(".delta")]
    assert tail[-6:] == ["response.output_audio.done", "response.output_audio_transcript.done",
                         "response.content_part.done", "response.output_item.done", "conversation.item.done",
                         "response.done"], tail


class SilentTextBackend(DelayBackend):
    """The echo backend without transcript text: activity is the audio alone."""

    def text_piece(self, token: int) -> str:
        return ""


def test_responses_follow_the_models_activity():
    from parley.engine import Engine
    from parley.realtime.server.app import ServerInfo, create_app
    from parley.realtime.server.services import Services
    from parley.realtime.sessions.session import ServerDefaults

    from parley.realtime.server.served_models import ServedModels

    engine = Engine(SilentTextBackend(1))
    app = create_app(Services(engine, ServerDefaults(), ServerInfo(), codec_workers=1,
                              models=ServedModels.build({"duplex": "parley"}, OPENAI_ALIASES)))

    async def scenario(base):
        async with client(base).realtime.connect(model="gpt-realtime") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            # speech, a pause long enough to end the response, speech again
            audio = np.concatenate([tone(300, 0.8), np.zeros(int(1.6 * SR), np.float32), tone(500, 0.8)])
            await stream(conn, audio)
            await asyncio.sleep(1.5)
            await conn.close()
            await rec.task
            return rec.events

    with serve(app) as base:
        events = run(scenario(base))
    done = [e for e in events if e["type"] == "response.done"]
    assert len(done) == 2, [e["type"] for e in events if not e["type"].endswith("delta")]
    assert all(d["response"]["status"] == "completed" for d in done)
    assert all(d["response"]["usage"]["output_token_details"]["audio_tokens"] >= 8 for d in done)
    stopped = [e for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    assert len(stopped) >= 1 and len(committed) >= 1
    check_all(events, ga_validators())


def test_response_create_and_item_events():
    app, _ = delay_app(1)

    async def scenario(base):
        async with client(base).realtime.connect(model="gpt-realtime") as conn:
            rec = Recorder(conn)
            await rec.wait_type("session.created")
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "hello"}]})
            refused = await rec.wait_type("error")  # the model cannot read text
            assert refused["error"]["param"] == "item.content[0].type"
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": pcm16_b64(tone(440, 0.2))}]})
            added = await rec.wait_type("conversation.item.added")
            item_id = added["item"]["id"]
            await conn.conversation.item.retrieve(item_id=item_id)
            await rec.wait_type("conversation.item.retrieved")
            await conn.conversation.item.delete(item_id=item_id)
            await rec.wait_type("conversation.item.deleted")
            await conn.conversation.item.retrieve(item_id=item_id)
            err = await rec.wait(lambda e: e["type"] == "error" and e is not refused)
            assert err["error"]["code"] == "item_not_found"
            await conn.input_audio_buffer.commit()
            await rec.wait(lambda e: e["type"] == "error" and e["error"]["code"] == "input_audio_buffer_commit_empty")
            await conn.input_audio_buffer.append(audio=pcm16_b64(np.zeros(4800, np.float32)))
            await conn.input_audio_buffer.commit()
            await rec.wait_type("input_audio_buffer.committed")
            await conn.input_audio_buffer.clear()
            await rec.wait_type("input_audio_buffer.cleared")
            await conn.response.create()
            await rec.wait_type("response.created")
            await conn.response.create()
            err = await rec.wait(lambda e: e["type"] == "error"
                                 and e["error"]["code"] == "conversation_already_has_active_response")
            await conn.close()
            await rec.task
            return rec.events

    with serve(app) as base:
        events = run(scenario(base))
    check_all(events, ga_validators())


# ---- beta -------------------------------------------------------------------------------------


def test_beta_sdk_session_audio_transcript_cancel_and_errors():
    app, backend = delay_app(1)

    async def scenario(base):
        async with client(base).beta.realtime.connect(model="gpt-4o-realtime-preview") as conn:
            rec = Recorder(conn)
            created = await rec.wait_type("session.created")
            assert created["session"]["input_audio_format"] == "pcm16"
            assert created["session"]["model"] == "gpt-4o-realtime-preview"
            await conn.session.update(session={"instructions": "You are Bo.", "voice": "NATM1.pt",
                                               "modalities": ["text", "audio"], "temperature": 0.7})
            updated = await rec.wait_type("session.updated")
            assert updated["session"]["voice"] == "NATM1.pt" and updated["session"]["temperature"] == 0.7
            await stream(conn, tone(440, 1.2))
            await rec.wait(lambda e: len(rec.of("response.audio.delta")) >= 5)
            assert rec.of("response.audio_transcript.delta")
            assert rec.of("conversation.item.created")
            await conn.response.cancel()
            done = await rec.wait_type("response.done")
            assert done["response"]["status"] == "cancelled"
            await conn._connection.send("nope")  # the beta connection has no send_raw: its websocket
            err = await rec.wait_type("error")
            assert err["error"]["code"] == "invalid_json"
            await conn.close()
            await rec.task
            return rec.events

    with serve(app) as base:
        events = run(scenario(base))
    assert backend.prefills[-1][1].persona == "You are Bo."
    assert backend.sampling[0].audio_temperature == 0.7
    check_all(events, beta_validators())


# ---- connection-level behaviour ---------------------------------------------------------------


def test_full_server_refuses_the_upgrade_with_503():
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    app, _ = delay_app(1)

    async def scenario(base):
        async with connect(f"ws://{base}/v1/realtime?model=delay") as first:
            assert json.loads(await first.recv())["type"] == "session.created"
            with pytest.raises(InvalidStatus) as refused:
                await connect(f"ws://{base}/v1/realtime?model=delay")
            return refused.value.response

    with serve(app) as base:
        response = run(scenario(base))
    # (the post-accept race, error event then 1013, is in test_capacity.py)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert json.loads(response.body)["reason"] == "full"


def test_api_key_subprotocols_and_dialect_selection():
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    from parley.realtime.sessions.session import ServerDefaults
    app, _ = delay_app(1, defaults=ServerDefaults(api_key="secret"))

    async def scenario(base):
        with pytest.raises(InvalidStatus) as denied:
            async with connect(f"ws://{base}/v1/realtime"):
                pass
        assert denied.value.response.status_code == 401
        async with connect(f"ws://{base}/v1/realtime",
                           subprotocols=["realtime", "openai-insecure-api-key.secret", "openai-beta.realtime-v1"]) as ws:
            assert ws.subprotocol == "realtime"
            beta = json.loads(await ws.recv())
        async with connect(f"ws://{base}/v1/realtime", additional_headers={"Authorization": "Bearer secret"}) as ws:
            assert ws.subprotocol is None
            ga = json.loads(await ws.recv())
        return beta, ga

    with serve(app) as base:
        beta, ga = run(scenario(base))
    assert "input_audio_format" in beta["session"]  # beta shape
    assert ga["session"]["type"] == "realtime"  # GA shape


def test_openai_agents_realtime_runner_completes_without_validation_errors():
    agents = pytest.importorskip("agents.realtime")
    app, _ = delay_app(1)

    async def scenario(base):
        agent = agents.RealtimeAgent(name="assistant", instructions="You are a test agent.")
        runner = agents.RealtimeRunner(agent)
        session = await runner.run(model_config={"url": f"ws://{base}/v1/realtime?model=gpt-realtime",
                                                 "api_key": "sk-test"})
        seen: list[str] = []
        errors: list[object] = []
        async with session:
            async def feed():
                audio = tone(440, 1.2)
                for i in range(audio.size // FRAME):
                    pcm16 = (audio[i * FRAME:(i + 1) * FRAME] * 32767).astype("<i2").tobytes()
                    await session.send_audio(pcm16)
                    await asyncio.sleep(0.08)

            feeder = asyncio.create_task(feed())
            deadline = time.monotonic() + 10
            async for event in session:
                seen.append(event.type)
                if event.type == "error":
                    errors.append(event.error)
                if seen.count("audio") >= 5 or time.monotonic() > deadline:
                    break
            await feeder
        return seen, errors

    with serve(app) as base:
        seen, errors = run(scenario(base))
    # openai-agents asks for input transcription and semantic_vad by default; this server has no
    # STT model, so each gets an error naming it (never a silent drop) and the session goes on.
    assert [getattr(e, "param", None) for e in errors] == ["session.audio.input.transcription",
                                                          "session.audio.input.turn_detection.type"], errors
    assert "agent_start" in seen and seen.count("audio") >= 5, seen
