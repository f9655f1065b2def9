"""Server-side control of live calls (sidebands), driven by the unmodified openai SDK.

- GPT-Live: a WebRTC call (aiortc as the caller) holds a session on a tiny Moshi whose text stream
  pauses often; `client.live.sideband.connect(session_id=...)` attaches, receives that session's
  transcript events, answers a delegation the call's client left unanswered with
  `session.commentary.append`, and the call hears the commentary in its output transcript.
- Realtime: `client.realtime.connect(call_id=...)` joins a WebRTC call on the echo backend, sees its
  response transcript and takes over its responses (`session.update`, `response.cancel`, `response.create`).
- Refusals before the upgrade (an unknown or ended session 404, another key's call 404, a wrong
  key 401, a cross-site Origin 403, past `max_sidebands` 429), audio from a sideband refused by
  name, and the call's end closing its sidebands (`session.closed`; Realtime: a normal close).

No assertion reads the wall clock: each wait is for a condition, bounded so a broken server fails.
"""

from __future__ import annotations

import asyncio
import fractions
import json

import httpx2 as httpx
import numpy as np
import openai
import pytest
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame
from openai.types.live import ConnectServerEvent
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from parley.realtime.server.serve import ServeConfig, build_app
from parley.realtime.sessions.limits import EdgeLimits
from parley.realtime.sessions.session import ServerDefaults

from live_checkpoints import write_pausing_checkpoint
from parley.models.synthetic import write_tiny_stt_checkpoint
from server_harness import OPENAI_ALIASES, delay_app, serve
from test_webrtc import ECHO_SETTINGS, OPUS_RATE, PACKET, WAIT_S, Client, run, wait_live

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIDEBAND_EVENT = TypeAdapter(ConnectServerEvent)
REALTIME_EVENT = TypeAdapter(RealtimeServerEvent)


class TurnTrack(MediaStreamTrack):
    """A microphone that says one thing (a 300 Hz tone for `speech_s`), then stays quiet: one user
    turn, paced 20 ms a packet as a browser's capture is."""

    kind = "audio"

    def __init__(self, speech_s: float = 1.2) -> None:
        super().__init__()
        self._speech = int(speech_s * OPUS_RATE)
        self._pts = 0
        self._start: float | None = None

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
        delay = self._start + self._pts / OPUS_RATE - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t = (self._pts + np.arange(PACKET)) / OPUS_RATE
        loud = (self._pts + np.arange(PACKET)) < self._speech
        samples = (loud * 0.3 * 32767 * np.sin(2 * np.pi * 300.0 * t)).astype(np.int16)
        frame = AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = OPUS_RATE, self._pts, fractions.Fraction(1, OPUS_RATE)
        self._pts += PACKET
        return frame


class TurnClient(Client):
    """The WebRTC caller of tests/test_webrtc.py, with one spoken turn for a microphone."""

    def __init__(self) -> None:
        super().__init__()
        self.pc.getSenders()[0].replaceTrack(TurnTrack())


class Events:
    """A sideband's events, read off the SDK connection in the background (raw JSON, as sent)."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.items: list[dict] = []
        self.ended = asyncio.Event()
        self.closed_normally = False
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed, ConnectionClosedOK
        try:
            while True:
                self.items.append(json.loads(await self.conn.recv_bytes()))
        except ConnectionClosed as exc:
            self.closed_normally = isinstance(exc, ConnectionClosedOK)
        finally:
            self.ended.set()

    def types(self) -> list[str]:
        return [e["type"] for e in self.items]

    async def wait(self, predicate, what: str) -> dict:
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while True:
            found = next((e for e in self.items if predicate(e)), None)
            if found is not None:
                return found
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{what} did not reach the sideband; it got {self.types()[-30:]}")
            await asyncio.sleep(0.05)


def sdk(base: str, key: str = "x") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key=key, base_url=f"http://{base}/v1", websocket_base_url=f"ws://{base}/v1",
                              max_retries=0)


def said(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "session.output_transcript.delta")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sideband")
    model = write_pausing_checkpoint(root / "moshi")
    return model, write_tiny_stt_checkpoint(root / "stt", mimi_from=model)


def test_a_live_sideband_hears_the_call_and_its_commentary_answers_the_calls_delegation(checkpoints):
    model, stt = checkpoints
    app = build_app(ServeConfig(model=str(model), stt_model=str(stt), max_sessions=1, stt_slots=1,
                                served_model_names=OPENAI_ALIASES, webrtc_workers=1))
    commentary = "hello world"
    with serve(app) as base:
        async def scenario():
            caller, client = TurnClient(), sdk(base)
            created = await client.live.create(session={"model": "gpt-live-1"},
                                               transport={"type": "webrtc", "sdp": await caller.offer()})
            await caller.answer(created.transport.sdp)
            async with client.live.sideband.connect(session_id=created.session.id) as side:
                events = Events(side)
                delegation = await events.wait(lambda e: e["type"] == "session.delegation.created", "a delegation")
                await events.wait(lambda e: e["type"] == "session.output_transcript.delta", "the call's transcript")
                await events.wait(lambda e: e["type"] == "session.input_transcript.delta", "the caller's words")
                # The call's client leaves the delegation unanswered; the sideband answers it.
                await side.session.commentary.append(content=commentary, event_id="side-1",
                                                     delegation_id=delegation["delegation"]["id"])
                appended = await events.wait(lambda e: e.get("client_event_id") == "side-1", "the append's ack")
                assert appended["type"] == "session.commentary.appended"
                await caller.wait(lambda: commentary in said(e for e in caller.events
                                                             if e.get("start_ms", -1) >= appended["start_ms"]),
                                  "the commentary in the call's output transcript")
                # Audio stays with the call: refused by name, to the sideband alone.
                await side.send_raw(json.dumps({"type": "session.input_audio.append", "audio": "AAAA",
                                                "event_id": "side-audio"}))
                refused = await events.wait(lambda e: e["type"] == "error", "the audio's refusal")
                # The sideband saw the session's own events: the same delegation and transcript deltas
                # reach the call's client too (compared before the hangup: deltas made while the call
                # hangs up may reach the sideband after the caller has stopped reading its data channel)
                side_said = [e for e in events.items if e["type"] == "session.output_transcript.delta"]
                assert side_said
                await caller.wait(lambda: all(e in caller.events for e in [delegation, *side_said]),
                                  "the sideband's delegation and transcript deltas at the call's client")
                # The call hangs up: the sideband gets session.closed, then the SDK's iteration ends.
                await caller.close()
                await asyncio.wait_for(events.ended.wait(), WAIT_S)
                assert events.closed_normally
            await client.close()
            await wait_live(base, 0)
            return caller.events, events.items, refused

        call_events, side_events, refused = run(scenario())
    for event in side_events:  # what the sideband got parses with the SDK's sideband types
        SIDEBAND_EVENT.validate_python(event)
    assert refused["error"]["param"] == "type" and refused["error"]["client_event_id"] == "side-audio"
    assert "session.input_audio.append" in refused["error"]["message"] and "audio stays" in refused["error"]["message"]
    assert not any(e["type"] == "error" for e in call_events)  # the sideband's mistake is its own
    assert side_events[-1]["type"] == "session.closed" and side_events[-1]["reason"] == "remote_hangup"


def test_a_realtime_sideband_joins_a_call_by_call_id_and_takes_over_its_responses():
    app, _ = delay_app(2)
    with serve(app) as base:
        async def scenario():
            caller, client = Client(), sdk(base)
            answer = await client.realtime.calls.create(sdp=await caller.offer(), session=ECHO_SETTINGS)
            call_id = answer.response.headers["location"].rsplit("/", 1)[1]
            await caller.answer(answer.text)
            await caller.wait(lambda: "response.created" in caller.types(), "the call's first response")
            async with client.realtime.connect(call_id=call_id) as side:
                events = Events(side)
                first = await events.wait(lambda e: e["type"] == "response.output_audio_transcript.delta",
                                          "the call's response transcript")
                await side.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}},
                                          event_id="side-update")
                await events.wait(lambda e: e["type"] == "session.updated", "session.updated")
                await side.response.cancel()
                await caller.wait(lambda: any(e["type"] == "response.done" and e["response"]["status"] == "cancelled"
                                              for e in caller.events), "the cancel on the call")
                await side.response.create()
                await caller.wait(lambda: [e for e in caller.events if e["type"] == "response.created"][1:] != [],
                                  "the sideband's response on the call")
                second = [e for e in caller.events if e["type"] == "response.created"][-1]["response"]["id"]
                await caller.wait(lambda: any(e["type"] == "response.output_audio_transcript.delta"
                                              and e["response_id"] == second for e in caller.events),
                                  "the sideband's response's transcript on the call")
                await side.input_audio_buffer.append(audio="AAAA", event_id="side-audio")
                refused = await events.wait(lambda e: e["type"] == "error", "the audio's refusal")
                await client.realtime.calls.hangup(call_id)  # the call ends: its sideband is closed (1000)
                await asyncio.wait_for(events.ended.wait(), WAIT_S)
                assert events.closed_normally
            await caller.close()
            await client.close()
            await wait_live(base, 0)
            return caller.events, events.items, first, refused

        call_events, side_events, first, refused = run(scenario())
    for event in side_events:
        REALTIME_EVENT.validate_python(event)
    assert first in call_events  # the call's own event
    updated = [e for e in call_events if e["type"] == "session.updated"]
    assert updated and updated[-1]["session"]["audio"]["input"]["turn_detection"] is None
    assert refused["error"]["event_id"] == "side-audio" and "audio stays" in refused["error"]["message"]
    assert not any(e["type"] == "error" for e in call_events)


async def upgrade_status(url: str, **headers) -> tuple[int, dict | None]:
    """The HTTP status (and OpenAI-shaped JSON body, if any) of a refused WebSocket upgrade."""
    with pytest.raises(InvalidStatus) as refused:
        await connect(url, additional_headers=headers)
    response = refused.value.response
    try:
        return response.status_code, json.loads(response.body)
    except ValueError:
        return response.status_code, None


def test_attach_refusals_the_bound_and_the_calls_end_closing_its_sidebands():
    app, _ = delay_app(2, defaults=ServerDefaults(api_key=("k1", "k2"), limits=EdgeLimits(max_sidebands=1)))
    with serve(app) as base:
        async def scenario():
            caller, client = Client(), sdk(base, "k1")
            created = await client.live.create(session={"model": "gpt-live-1"},
                                               transport={"type": "webrtc", "sdp": await caller.offer()})
            await caller.answer(created.transport.sdp)
            await caller.wait(lambda: "session.started" in caller.types(), "session.started")
            url = f"ws://{base}/v1/live/sessions/{created.session.id}/attach"
            key = {"Authorization": "Bearer k1"}
            statuses = {
                "unknown": await upgrade_status(f"ws://{base}/v1/live/sessions/sess_nope/attach", **key),
                "no call": await upgrade_status(f"ws://{base}/v1/realtime?call_id=rtc_nope", **key),
                "wrong key": await upgrade_status(url, Authorization="Bearer nope"),
                "another key": await upgrade_status(url, Authorization="Bearer k2"),
                "origin": await upgrade_status(url, Origin="https://elsewhere.example", **key),
                "graceful": await upgrade_status(url + "?graceful_close=maybe", **key),
                "model": await upgrade_status(f"ws://{base}/v1/realtime?call_id=rtc_x&model=gpt-realtime", **key),
            }
            with pytest.raises(InvalidStatus):  # the SDK's attach to an unknown session fails on the 404
                async with client.live.sideband.connect(session_id="sess_nope"):
                    pass
            async with client.live.sideband.connect(session_id=created.session.id, graceful_close=True) as side:
                events = Events(side)
                await events.wait(lambda e: e["type"] == "session.output_transcript.delta", "the call's events")
                statuses["second"] = await upgrade_status(url, **key)  # max_sidebands=1
                await side.session.update(session={"delegation": {"type": "client"}}, event_id="side-update")
                await caller.wait(lambda: any(e.get("client_event_id") == "side-update" for e in caller.events),
                                  "the sideband's session.update reaching the call")
                caller.send({"type": "session.close", "event_id": "call-close"})  # the call's client ends it
                await asyncio.wait_for(events.ended.wait(), WAIT_S)
            await wait_live(base, 0, key="k1")
            statuses["ended"] = await upgrade_status(url, **key)  # an ended session is unknown
            await caller.close()
            await client.close()
            return statuses, events.items

        statuses, side_events = run(scenario())
    for name in ("unknown", "no call", "another key", "ended"):
        status, body = statuses[name]
        assert status == 404 and body["error"]["code"] == "session_not_found", (name, statuses[name])
    assert statuses["unknown"][1]["error"]["param"] == "session_id"
    assert statuses["no call"][1]["error"]["param"] == "call_id"
    assert statuses["wrong key"][0] == 401 and statuses["origin"][0] == 403
    assert statuses["graceful"][0] == 400 and statuses["graceful"][1]["error"]["param"] == "graceful_close"
    assert statuses["model"][0] == 400 and statuses["model"][1]["error"]["param"] == "model"
    assert statuses["second"][0] == 429 and statuses["second"][1]["error"]["code"] == "sideband_limit_reached"
    closed = side_events[-1]
    assert closed["type"] == "session.closed" and closed["reason"] == "close_requested"
    assert closed["client_event_id"] == "call-close"  # the session's own session.closed, once
    assert [e["type"] for e in side_events].count("session.closed") == 1


def test_the_registry_holds_a_call_until_it_is_released_and_ends_its_sidebands_once():
    from parley.realtime.calls.sideband import AttachedCall, LiveCalls

    class Channel:
        observer = None

    class Side:
        def __init__(self) -> None:
            self.got: list = []

        def post(self, event) -> None:
            self.got.append(event)

        def post_text(self, text) -> None:
            self.got.append(json.loads(text))

        def finish(self, code, reason) -> None:
            self.got.append(code)

    registry, channel, side = LiveCalls(), Channel(), Side()
    call = AttachedCall("sess_1", "live", channel, None, {}, lambda: {"type": "session.closed"})
    registry.hold(call)
    assert registry.find("sess_1") is call and channel.observer == call.observe
    call.sidebands.add(side)
    channel.observer({"type": "session.output_transcript.delta"}, '{"type": "x"}')
    registry.release(call)
    registry.release(call)  # idempotent: the sideband was ended once
    assert registry.find("sess_1") is None and len(registry) == 0 and channel.observer is None
    assert side.got == [{"type": "x"}, {"type": "session.closed"}, 1000]


def test_a_sideband_too_far_behind_is_closed_and_the_bound_is_a_flag():
    """Fan-out never waits: a sideband whose queue is full is closed (1008) once what it holds is
    sent; `--max-sidebands` sets the bound (0: none), a negative one is refused naming the flag."""
    from parley.realtime.calls.sideband import MAX_QUEUED_EVENTS, AttachedCall, Sideband
    from parley.realtime.cli import build_parser, reliability_settings

    class Socket:
        def __init__(self) -> None:
            self.sent: list[str] = []
            self.closed: tuple | None = None

        async def send_text(self, text: str) -> None:
            self.sent.append(text)

        async def receive(self) -> dict:
            await asyncio.Event().wait()  # a sideband that never speaks

        async def close(self, code: int, reason: str) -> None:
            self.closed = (code, reason)

    async def scenario():
        socket = Socket()
        call = AttachedCall("sess_1", "live", None, None, {}, lambda: None)
        sideband = Sideband(socket, call, EdgeLimits())
        call.sidebands.add(sideband)
        for i in range(MAX_QUEUED_EVENTS + 5):  # nothing is sent meanwhile: the writer has not run
            call.observe({"type": "x"}, json.dumps({"n": i}))
        await asyncio.wait_for(sideband.run(), WAIT_S)
        return socket, call

    socket, call = asyncio.run(scenario())
    assert [json.loads(t)["n"] for t in socket.sent] == list(range(MAX_QUEUED_EVENTS))
    assert socket.closed[0] == 1008 and "too slowly" in socket.closed[1]
    assert not call.sidebands
    for given, limit in (([], 4), (["--max-sidebands", "0"], 0), (["--max-sidebands", "2"], 2)):
        args = build_parser().parse_args(["serve", *given])
        assert reliability_settings(args)["limits"].max_sidebands == limit
    with pytest.raises(ValueError, match="--max-sidebands"):
        reliability_settings(build_parser().parse_args(["serve", "--max-sidebands", "-1"]))
