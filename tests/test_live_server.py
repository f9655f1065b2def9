"""`/v1/live/sessions` (GPT-Live) driven by the unmodified openai SDK (`client.live.connect()`),
against tiny models on a real server; every server event is validated by the SDK's own
pydantic types (`openai.types.live.ServerEvent`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import base64
import time
import urllib.request

import numpy as np
import pydantic
import pytest
from openai.types.live import ServerEvent

from parley.models.synthetic import write_tiny_stt_checkpoint
from parley.realtime.media.audio_formats import g711_decode, g711_encode
from parley.realtime.live.policy import parse_policy
from parley.realtime.server.serve import ServeConfig, ServeError, build_app
from parley.realtime.sessions.session import ServerDefaults

from live_checkpoints import write_pausing_checkpoint
from server_harness import OPENAI_ALIASES, best_lag_correlation, delay_app, serve, tone
from test_server_realtime import Recorder, client, run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SR = 24_000
FRAME = 1920
SERVER_EVENT = pydantic.TypeAdapter(ServerEvent)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Moshi whose text stream pauses often (so commentary starts soon) and a tiny STT."""
    root = tmp_path_factory.mktemp("live")
    model = write_pausing_checkpoint(root / "moshi")
    stt = write_tiny_stt_checkpoint(root / "stt", mimi_from=model)
    return model, stt


def live_app(checkpoints, **config):
    model, stt = checkpoints
    config.setdefault("served_model_names", OPENAI_ALIASES)  # the clients' gpt-live-1
    return build_app(ServeConfig(model=str(model), stt_model=str(stt), max_sessions=1, stt_slots=1, **config))


def validate(events: list[dict]) -> None:
    """Every event parses as the SDK's discriminated ServerEvent union, and with pipecat's GPT-Live
    parser when it is installed (what its OpenAILiveLLMService reads)."""
    try:
        from pipecat.services.openai.live.events import parse_server_event
    except ImportError:
        parse_server_event = None
    for event in events:
        SERVER_EVENT.validate_python(event)
        if parse_server_event is not None:
            parse_server_event(json.dumps(event))


def encode(pcm: np.ndarray) -> str:
    return base64.b64encode((np.clip(pcm, -1, 1) * 32767).astype("<i2").tobytes()).decode()


async def speak(conn, wire: list[bytes], frame_s: float = FRAME / SR) -> None:
    """Send wire chunks (one 80 ms frame each) at real-time pace after three at once."""
    t0 = time.monotonic()
    for i, chunk in enumerate(wire):
        await conn.session.input_audio.append(audio=base64.b64encode(chunk).decode())
        await asyncio.sleep(max(0.0, t0 + max(0, i - 2) * frame_s - time.monotonic()))


def pcm_frames(pcm: np.ndarray) -> list[bytes]:
    return [base64.b64decode(encode(pcm[i:i + FRAME])) for i in range(0, pcm.size - FRAME + 1, FRAME)]


def speech_then_quiet(speech_s: float = 1.2, quiet_s: float = 3.0) -> np.ndarray:
    # quiet past semantic eagerness medium's 4 s timeout is not needed: 160 ms + the head, or 4 s
    return np.concatenate([tone(300, speech_s), np.zeros(int(quiet_s * SR), np.float32)])


async def start(conn, rec, session: dict) -> dict:
    await conn.session.start(session=session, event_id="start-1")
    return await rec.wait(lambda e: e.get("client_event_id") == "start-1", timeout=20)


def output_deltas(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "session.output_transcript.delta"]


async def close_live(conn, rec) -> None:
    """session.close, then wait for session.closed and the recorder's end of stream."""
    await conn.session.close()
    await rec.wait_type("session.closed", timeout=10)
    await rec.task


def test_sdk_conversation_with_transcripts_a_delegation_and_spoken_commentary(checkpoints):
    commentary = "hello world"

    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            started = await start(conn, rec, {"model": "gpt-live-1", "audio": {
                "format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "marin"}}})
            assert started["type"] == "session.started", started
            pcm = speech_then_quiet(1.2, 4.8)
            speaker = asyncio.create_task(speak(conn, pcm_frames(pcm)))
            created = await rec.wait_type("session.delegation.created", timeout=20)
            await conn.session.commentary.append(content=commentary, delegation_id=created["delegation"]["id"],
                                                 event_id="comment-1")
            appended = await rec.wait_type("session.commentary.appended", timeout=10)
            await speaker
            for _ in range(8):  # until the model pauses and the commentary is out (this model: within ~1 s)
                if commentary in "".join(d["delta"] for d in output_deltas(rec.events)):
                    break
                await speak(conn, pcm_frames(np.zeros(SR, np.float32)))
            await conn.session.close(event_id="close-1")
            await rec.wait_type("session.closed", timeout=10)
            await rec.task
            return rec.events, pcm.size / SR, started, created, appended

    with serve(live_app(checkpoints)) as base:
        events, sent_s, started, created, appended = run(scenario(base))
    validate(events)
    assert started["client_event_id"] == "start-1"
    resource = started["session"]
    assert resource["model"] == "gpt-live-1" and resource["delegation"] == {"type": "client"}
    assert resource["audio"] == {"format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "marin"}}
    # Audio both ways: at least 70 % of the seconds sent came back.
    received = sum(len(base64.b64decode(e["delta"])) for e in events if e["type"] == "session.output_audio.delta")
    assert received / (2 * SR) >= 0.7 * sent_s
    # The model's text stream, frame-aligned on the session's clock.
    deltas = output_deltas(events)
    assert deltas and all(d["end_ms"] - d["start_ms"] == 80 and d["start_ms"] % 80 == 0 for d in deltas)
    assert [d["start_ms"] for d in deltas] == sorted(d["start_ms"] for d in deltas)
    assert [e for e in events if e["type"] == "session.input_transcript.delta"]  # the paired STT
    # The delegation came at the end of the user's turn; the commentary was spoken into the transcript.
    # (on the output clock, which trails the input the client sent by its prebuffer and the engine's lag)
    assert created["delegation"]["target"] == "client" and created["offset_ms"] >= 600
    assert appended["client_event_id"] == "comment-1" and appended["end_ms"] > appended["start_ms"]
    spoken = "".join(d["delta"] for d in deltas if d["start_ms"] >= appended["start_ms"])
    assert commentary in spoken
    usage = [e["usage"]["seconds"] for e in events if e["type"] == "session.usage.updated"]
    assert usage and usage == sorted(usage)
    closed = events[-1]
    assert closed["type"] == "session.closed" and closed["reason"] == "close_requested"
    assert closed["client_event_id"] == "close-1" and closed["usage"]["seconds"] >= usage[-1]


def errors_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "error"]


def test_errors_carry_the_client_event_id_refused_fields_are_named_and_the_session_goes_on():
    app, _ = delay_app(2, defaults=ServerDefaults(prompts=False))

    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            await conn.session.input_audio.append(audio=encode(np.zeros(FRAME)), event_id="early")
            await conn.send_raw("{not json")
            await conn.session.start(event_id="bad", session={
                "model": "gpt-live-1", "instructions": "be kind", "store": True,
                "delegation": {"type": "responses", "responses": {"model": "gpt-5"}},
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
            started = await start(conn, rec, {"model": "gpt-live-1"})
            assert started["type"] == "session.started"
            await conn.send({"type": "response.create", "event_id": "resp"})
            await conn.session.update(session={"instructions": "x"}, event_id="upd-bad")
            await conn.session.update(session={"delegation": {"type": "client"}}, event_id="upd")
            await rec.wait_type("session.updated")
            await conn.session.commentary.append(content="hi", delegation_id="dlg_nope", event_id="c-bad")
            await conn.session.commentary.append(content="hi", delegation_id=None, event_id="c-none")
            await conn.session.thinking.append(content="hm", delegation_id=None, event_id="think")
            await conn.session.input_audio.mute(event_id="mute")
            await conn.session.input_audio.unmute(event_id="unmute")
            await conn.session.start(session={"model": "gpt-live-1"}, event_id="again")
            await conn.session.close(event_id="bye")
            await rec.wait_type("session.closed")
            await rec.task
            return rec.events

    with serve(app) as base:
        events = run(scenario(base))
    validate(events)
    errors = {(e["client_event_id"] if "client_event_id" in e else None, e["error"]["param"]): e["error"]
              for e in errors_of(events)}
    for error in errors.values():  # the SDK reads the id from the error too
        assert error.get("client_event_id") == next(k for k, v in errors.items() if v is error)[0]
    assert errors[("early", "type")]["code"] == "session_not_started"
    assert errors[(None, None)]["code"] == "invalid_json"
    assert {param for cid, param in errors if cid == "bad"} == {
        "session.instructions", "session.store", "session.delegation.type", "session.input"}
    assert "Responses" in errors[("resp", "type")]["message"]
    assert errors[("upd-bad", "session.instructions")]["code"] == "unsupported_parameter"
    assert errors[("c-bad", "delegation_id")]["code"] == "invalid_value"
    assert "cannot be given text" in errors[("c-none", "content")]["message"]  # this backend forces no text
    assert "no persona" in errors[("think", "type")]["message"]
    assert errors[("again", "type")]["code"] == "session_already_started"
    acks = {e["type"]: e.get("client_event_id") for e in events if "client_event_id" in e and e["type"] != "error"}
    assert acks == {"session.started": "start-1", "session.updated": "upd", "session.input_audio.muted": "mute",
                    "session.input_audio.unmuted": "unmute", "session.closed": "bye"}


@pytest.mark.parametrize("kind,rate", [("audio/pcmu", 8000), ("audio/pcma", 8000), ("audio/pcm", 16000)])
def test_wire_formats_come_back_in_kind_frame_by_frame(kind, rate):
    app, _ = delay_app(1)  # echo: output frame t is input frame t - 1
    width = 2 if kind == "audio/pcm" else 1
    frame_bytes = rate * width * 80 // 1000
    pcm16 = (tone(440, 2.0, sr=rate) * 32767).astype("<i2")
    wire = pcm16.tobytes() if width == 2 else g711_encode(pcm16, kind.removeprefix("audio/"))
    chunks = [wire[i:i + frame_bytes] for i in range(0, len(wire), frame_bytes)]

    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            started = await start(conn, rec, {"model": "gpt-live-1", "audio": {"format": {"type": kind, "rate": rate}}})
            assert started["session"]["audio"]["format"] == {"type": kind, "rate": rate}
            await speak(conn, chunks)
            await asyncio.sleep(0.5)
            await close_live(conn, rec)
            return rec.events

    with serve(app) as base:
        events = run(scenario(base))
    validate(events)
    out = [base64.b64decode(e["delta"]) for e in events if e["type"] == "session.output_audio.delta"]
    assert {len(chunk) for chunk in out} == {frame_bytes}
    assert len(out) * 0.08 >= 0.7 * 2.0
    got = b"".join(out)
    got16 = np.frombuffer(got, "<i2") if width == 2 else g711_decode(got, kind.removeprefix("audio/"))
    corr, _ = best_lag_correlation(pcm16.astype(np.float32), got16.astype(np.float32), rate // 2)
    assert corr > 0.9  # the echo came back through both resamplers and codecs


def test_decisions_delegation_and_its_events_are_refused_by_name_and_a_client_delegation_starts():
    """Decisions delegation, typed with the SDK's own params, is refused naming it; so is a kind
    the SDK does not know (it was refused by its extra field's name); the client may start again."""
    from openai.types.live import SessionConfigParam

    decisions: SessionConfigParam = {"model": "gpt-live-1", "delegation": {"type": "decisions", "decisions": {
        "model": "gpt-5-mini", "questions": [{"type": "predicate", "name": "weather",
                                              "instructions": "Does the user ask about the weather?"}]}}}
    app, _ = delay_app(1)

    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            await conn.session.start(session=decisions, event_id="decisions")
            await conn.send({"type": "session.start", "event_id": "planner", "session": {
                "model": "gpt-live-1", "delegation": {"type": "planner", "planner": {"depth": 2}}}})
            started = await start(conn, rec, {"model": "gpt-live-1", "delegation": {"type": "client"}})
            await conn.send({"type": "decision.create", "event_id": "decide"})
            await rec.wait(lambda e: e.get("client_event_id") == "decide")
            await close_live(conn, rec)
            return started, rec.events

    with serve(app) as base:
        started, events = run(scenario(base))
    validate(events)
    errors = {e["client_event_id"]: e["error"] for e in errors_of(events)}
    assert (errors["decisions"]["param"], errors["decisions"]["code"]) == ("session.delegation.type",
                                                                          "unsupported_parameter")
    assert "decisions delegation is not served" in errors["decisions"]["message"]
    assert errors["planner"]["param"] == "session.delegation.type" and "'planner'" in errors["planner"]["message"]
    assert "Decisions delegation is not served" in errors["decide"]["message"]
    assert started["type"] == "session.started" and started["session"]["delegation"] == {"type": "client"}


def test_a_full_server_refuses_the_upgrade_with_503_and_counts_live_sessions():
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    app, _ = delay_app(1)

    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            assert (await start(conn, rec, {"model": "gpt-live-1"}))["type"] == "session.started"
            with pytest.raises(InvalidStatus) as refused:
                await connect(f"ws://{base}/v1/live/sessions")
            with urllib.request.urlopen(f"http://{base}/metrics", timeout=10) as response:
                metrics = response.read().decode()
            await conn.session.close()
            await rec.task
            return refused.value.response, metrics

    with serve(app) as base:
        response, metrics = run(scenario(base))
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert 'parley_connections_total{protocol="live"} 1.0' in metrics
    assert 'parley_refusals_total{door="/v1/live/sessions",reason="full"} 1.0' in metrics


def test_personaplex_keeps_instructions_prior_messages_and_appends_in_its_persona(tmp_path):
    model = write_pausing_checkpoint(tmp_path / "personaplex", kind="personaplex", context=400, gain=8.0)
    # no STT: turns end after 500 ms of quiet
    app = build_app(ServeConfig(model=str(model), max_sessions=1, served_model_names=OPENAI_ALIASES))
    personas = []

    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            started = await start(conn, rec, {
                "model": "gpt-live-1", "instructions": "You are a helpful agent.",
                "audio": {"output": {"voice": "NATF0"}},
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "My name is Ada."}]},
                          {"role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]}]})
            assert started["type"] == "session.started", started
            await speak(conn, pcm_frames(speech_then_quiet(1.0, 1.0)))
            created = await rec.wait_type("session.delegation.created", timeout=10)
            task = created["delegation"]["id"]
            await conn.session.instructions.append(content="Answer in French.", delegation_id=task, event_id="i")
            await rec.wait_type("session.instructions.appended", timeout=15)
            await conn.session.thinking.append(content="The user likes tea.", delegation_id=None, event_id="t")
            await rec.wait_type("session.thinking.appended", timeout=15)
            personas.extend(edge.engine_session.options.persona for edge in app.state.sessions._live)
            await conn.session.instructions.append(content="word " * 700, delegation_id=None, event_id="long")
            await rec.wait(lambda e: e.get("client_event_id") == "long", timeout=15)
            await conn.session.commentary.append(content="hello world", delegation_id=task, event_id="c")
            await rec.wait_type("session.commentary.appended", timeout=10)
            for _ in range(10):  # until the model pauses and the commentary is out (random weights: ~1 s)
                await speak(conn, pcm_frames(np.zeros(SR, np.float32)))
                if "hello world" in "".join(d["delta"] for d in output_deltas(rec.events)):
                    break
            await close_live(conn, rec)
            return rec.events

    with serve(app) as base:
        events = run(scenario(base))
    validate(events)
    assert personas == ["You are a helpful agent.\nUser: My name is Ada.\nAssistant: Hello Ada.\n"
                        "Answer in French.\n(thinking) The user likes tea."]
    refused = [e["error"] for e in errors_of(events) if e.get("client_event_id") == "long"]
    assert refused and refused[0]["param"] == "content" and "context" in refused[0]["message"]
    resource = events[0]["session"] if events[0]["type"] == "session.started" else None
    assert resource and resource["instructions"] == "You are a helpful agent." and len(resource["input"]) == 2
    assert "hello world" in "".join(d["delta"] for d in output_deltas(events))  # spoken after the re-prefills


def test_the_delegation_policy_is_the_servers(checkpoints):
    model, _ = checkpoints
    with pytest.raises(ServeError, match="--stt-model"):  # a pattern needs the user's words
        build_app(ServeConfig(model=str(model), live_delegation=parse_policy("pattern:weather")))

    def delegations(policy: str) -> int:
        app, _ = delay_app(1, defaults=ServerDefaults(live_delegation=parse_policy(policy)))

        async def scenario(base):
            async with client(base).live.connect() as conn:
                rec = Recorder(conn)
                await start(conn, rec, {"model": "gpt-live-1"})
                await speak(conn, pcm_frames(speech_then_quiet(0.8, 0.8)))
                await close_live(conn, rec)
                return rec.events

        with serve(app) as base:
            events = run(scenario(base))
        validate(events)
        return len([e for e in events if e["type"] == "session.delegation.created"])

    assert delegations("every_turn") == 1
    assert delegations("never") == 0


def test_a_drain_refuses_new_live_sessions_then_notices_the_live_one_and_closes_1001():
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from test_capacity import http, serve_draining, upgrade

    app, _ = delay_app(2)
    app.state.drainer.timeout_s = 1.0

    async def scenario(base):
        async with connect(f"ws://{base}/v1/live/sessions") as ws:
            await ws.send(json.dumps({"type": "session.start", "session": {"model": "gpt-live-1"}}))
            assert json.loads(await ws.recv())["type"] == "session.started"
            status, _, _ = await asyncio.to_thread(http, base, "/admin/drain", "POST")
            refused = await upgrade(base, "/v1/live/sessions")
            events = []
            with contextlib.suppress(ConnectionClosed):
                async for message in ws:
                    events.append(json.loads(message))
            return status, refused, events, ws.close_code

    with serve_draining(app) as (base, thread):
        status, refused, events, code = run(scenario(base))
        thread.join(15)
    validate(events)
    assert status == 202 and refused[0] == "refused" and refused[1][0] == 503
    assert refused[1][2]["reason"] == "draining"
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "server_shutting_down"
    assert code == 1001


def test_a_refused_voice_names_it_and_the_session_may_start_again_and_silence_times_out(monkeypatch):
    from websockets.asyncio.client import connect

    from parley.realtime.live import session as live_session

    monkeypatch.setattr(live_session, "START_TIMEOUT_S", 0.5)  # the server runs in this process
    app, _ = delay_app(1)  # its backend rejects the voice "unknown"

    async def scenario(base):
        async with client(base).live.connect() as conn:
            rec = Recorder(conn)
            await conn.session.start(session={"model": "delay", "audio": {"output": {"voice": "unknown"}}},
                                     event_id="v")
            refused = await rec.wait(lambda e: e.get("client_event_id") == "v")
            started = await start(conn, rec, {"model": "delay", "audio": {"output": {"voice": "marin"}}})
            await conn.session.close()
            await rec.task
        async with connect(f"ws://{base}/v1/live/sessions") as ws:  # says nothing
            timed_out = json.loads(await ws.recv())
            await ws.wait_closed()
            return refused, started, timed_out, ws.close_code

    with serve(app) as base:
        refused, started, timed_out, code = run(scenario(base))
    validate([refused, started, timed_out])
    assert refused["type"] == "error" and refused["error"]["param"] == "session.audio.output.voice"
    assert started["type"] == "session.started"
    assert timed_out["error"]["code"] == "session_start_timeout" and code == 1008


def test_the_key_the_origin_and_the_event_size_are_checked_as_on_the_other_doors():
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    from parley.realtime.sessions.limits import EdgeLimits

    app, _ = delay_app(1, defaults=ServerDefaults(api_key="sk-test", limits=EdgeLimits(max_event_bytes=4096)))

    async def scenario(base):
        statuses = []
        for headers in ({}, {"Authorization": "Bearer sk-wrong"},
                        {"Authorization": "Bearer sk-test", "Origin": "https://elsewhere.example"}):
            with pytest.raises(InvalidStatus) as refused:
                await connect(f"ws://{base}/v1/live/sessions", additional_headers=headers)
            statuses.append(refused.value.response.status_code)
        async with client(base).live.connect() as conn:  # the SDK sends the key as a Bearer token
            rec = Recorder(conn)
            assert (await start(conn, rec, {"model": "delay"}))["type"] == "session.started"
            await conn.send_raw('{"type": "session.update", "event_id": "big", "pad": "' + "x" * 5000 + '"}')
            await conn.session.input_audio.mute(event_id="after")
            await rec.wait_type("session.input_audio.muted")
            await conn.session.close()
            await rec.task
        return statuses, rec.events

    with serve(app) as base:
        statuses, events = run(scenario(base))
    validate(events)
    assert statuses == [401, 401, 403]
    too_big = errors_of(events)
    assert len(too_big) == 1 and too_big[0]["error"]["code"] == "message_too_large"  # and the session went on
