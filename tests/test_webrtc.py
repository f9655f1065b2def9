"""The WebRTC doors, driven as OpenAI's clients drive them, over loopback host candidates only.

- Realtime: aiortc as the client does the flow of OpenAI's WebRTC guide against
  `POST /v1/realtime/calls` (an `oai-events` data channel, a microphone track, the SDP offer as
  `application/sdp`, the answer applied), and the SDK's `client.realtime.calls.create` (multipart,
  with session settings).
- GPT-Live: the openai SDK's `client.live.create(session=..., transport={"type": "webrtc", "sdp"})`.
- Bad input: a malformed SDP, an offer with no audio, and a peer that vanishes mid-call each end only
  that call.
- The first Realtime flow and the hang-up run twice: with the peers in a WebRTC worker process,
  and on the app's own loop as an edge worker runs them (webrtc/local.py).

The server is the fabricated echo backend (output frame t = input frame t - 1), so the audio the
client hears back is the tone it sent. No assertion reads the wall clock: each wait is for a
condition, bounded only so that a broken server fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import re
import sys
from pathlib import Path

import httpx2 as httpx  # what the pinned openai SDK ships on
import numpy as np
import openai
import pytest
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame
from openai.types.live import ServerEvent
from openai.types.realtime import RealtimeServerEvent
from pydantic import TypeAdapter

from server_harness import delay_app, serve

OPUS_RATE = 48000
PACKET = 960  # 20 ms at 48 kHz
TONE_HZ = 440.0
LIVE_SERVER_EVENT = TypeAdapter(ServerEvent)
REALTIME_SERVER_EVENT = TypeAdapter(RealtimeServerEvent)
FAST_CONSENT_WORKER = Path(__file__).with_name("webrtc_fast_consent_worker.py")
WAIT_S = 30.0
# The echo backend "speaks" while the user does: keep the user's speech from cutting its responses off.
ECHO_SETTINGS = {"type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                            "interrupt_response": False}}}}  # the bound on each wait (a loaded 2-core CI box); never asserted on


class ToneTrack(MediaStreamTrack):
    """A microphone: a 440 Hz tone, paced 20 ms a packet as a browser's capture is."""

    kind = "audio"

    def __init__(self, amplitude: float = 0.3) -> None:
        super().__init__()
        self.amplitude = amplitude
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
        samples = (self.amplitude * 32767 * np.sin(2 * np.pi * TONE_HZ * t)).astype(np.int16)
        frame = AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = OPUS_RATE, self._pts, fractions.Fraction(1, OPUS_RATE)
        self._pts += PACKET
        return frame


class Client:
    """A WebRTC client peer as OpenAI's guide builds one: a microphone track, the `oai-events`
    channel, and what comes back (events, and the audio of the server's track at 48 kHz mono)."""

    def __init__(self, microphone: bool = True, channel: bool = True) -> None:
        self.pc = RTCPeerConnection()
        self.events: list[dict] = []
        self.audio: list[np.ndarray] = []
        self.opened = asyncio.Event()
        self._reader: asyncio.Task | None = None
        if microphone:
            self.pc.addTrack(ToneTrack())
        else:
            self.pc.addTransceiver("audio", direction="recvonly")
        self.channel = self.pc.createDataChannel("oai-events") if channel else None
        if self.channel is not None:
            self.channel.on("open", self.opened.set)
            self.channel.on("message", lambda message: self.events.append(json.loads(message)))
        self.pc.on("track", self._on_track)

    def _on_track(self, track: MediaStreamTrack) -> None:
        async def read() -> None:
            try:
                while True:
                    frame = await track.recv()
                    samples = frame.to_ndarray().reshape(-1, len(frame.layout.channels)).mean(axis=1)
                    self.audio.append(samples.astype(np.float32) / 32768.0)
            except MediaStreamError:
                pass

        self._reader = asyncio.create_task(read())

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def answer(self, sdp: str) -> None:
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="answer"))

    def send(self, event: dict) -> None:
        self.channel.send(json.dumps(event))

    def types(self) -> list[str]:
        return [event["type"] for event in self.events]

    async def wait(self, predicate, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + WAIT_S
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{what} did not happen; events: {self.types()[:40]}")
            await asyncio.sleep(0.05)

    def heard_tone(self) -> bool:
        """The server's track carried the tone back: its strongest frequency is 440 Hz."""
        if not self.audio:
            return False
        pcm = np.concatenate(self.audio)[-OPUS_RATE:]
        if pcm.size < OPUS_RATE // 2 or np.sqrt(np.mean(pcm ** 2)) < 0.02:
            return False
        spectrum = np.abs(np.fft.rfft(pcm * np.hanning(pcm.size)))
        peak_hz = np.argmax(spectrum) * OPUS_RATE / pcm.size
        return abs(peak_hz - TONE_HZ) < 10

    async def close(self) -> None:
        await self.pc.close()
        if self._reader is not None:
            self._reader.cancel()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


# Where the calls' peers run: a WebRTC worker process (the one-process server), or the app's own loop
# (an edge worker's: webrtc/local.py). The same call logic either way, so the same tests.
HOSTS = pytest.mark.parametrize("webrtc_workers", [1, 0], ids=["worker-process", "edge-worker-loop"])


@HOSTS
def test_realtime_call_as_openais_guide_does_it_hears_the_echo_and_speaks_events_on_the_channel(webrtc_workers):
    app, _ = delay_app(2, webrtc_workers=webrtc_workers)
    with serve(app) as base:
        async def scenario():
            client = Client()
            async with httpx.AsyncClient() as http:
                reply = await http.post(f"http://{base}/v1/realtime/calls?model=gpt-realtime", content=await client.offer(),
                                        headers={"Content-Type": "application/sdp", "Authorization": "Bearer x"})
            assert reply.status_code == 201, reply.text
            assert reply.headers["content-type"].startswith("application/sdp")
            assert reply.headers["location"].startswith("/v1/realtime/calls/rtc_")
            await client.answer(reply.text)
            await client.wait(lambda: "session.created" in client.types(), "session.created")
            assert client.types()[0] == "session.created"
            session = client.events[0]["session"]
            assert session["type"] == "realtime" and session["audio"]["output"]["format"]["rate"] == 24000
            # The echo backend "speaks" while the user does: keep the user's speech from cutting it off.
            client.send({"type": "session.update", "event_id": "u1", "session": {"type": "realtime", "audio": {
                "input": {"turn_detection": {"type": "server_vad", "interrupt_response": False}}}}})
            await client.wait(lambda: "session.updated" in client.types(), "session.updated")
            # The echo of the tone makes the model "speak": a response opens and its audio is on the track.
            await client.wait(lambda: "response.created" in client.types(), "a response")
            await client.wait(client.heard_tone, "the tone coming back on the server's track")
            assert "input_audio_buffer.speech_started" in client.types()  # the track's audio is heard as input
            assert not any(t.endswith("audio.delta") for t in client.types()), "audio goes on the track"
            # OpenAI's WebRTC-only events: the response's audio started on the track; a clear cuts it.
            await client.wait(lambda: "output_audio_buffer.started" in client.types(), "output_audio_buffer.started")
            started = next(e for e in client.events if e["type"] == "output_audio_buffer.started")
            created = next(e for e in client.events if e["type"] == "response.created")
            assert started["response_id"] == created["response"]["id"]
            client.send({"type": "output_audio_buffer.clear", "event_id": "c1"})
            await client.wait(lambda: "output_audio_buffer.cleared" in client.types(), "output_audio_buffer.cleared")
            cleared = next(e for e in client.events if e["type"] == "output_audio_buffer.cleared")
            assert cleared["response_id"] == started["response_id"]
            for event in client.events:  # every event parses with the SDK's own types
                REALTIME_SERVER_EVENT.validate_python(event)
            client.send({"type": "no.such.event", "event_id": "bad1"})
            await client.wait(lambda: "error" in client.types(), "an error for a bad event")
            error = next(e for e in client.events if e["type"] == "error")["error"]
            assert error["event_id"] == "bad1" and error["param"] == "type"
            await client.close()
            await wait_live(base, 0)

        run(scenario())


def test_the_sdk_calls_create_sends_multipart_with_session_settings():
    app, _ = delay_app(2)
    with serve(app) as base:
        async def scenario():
            client = Client()
            sdk = openai.AsyncOpenAI(api_key="x", base_url=f"http://{base}/v1")
            answer = await sdk.realtime.calls.create(sdp=await client.offer(), session={
                "type": "realtime", "instructions": "a helpful echo", "audio": {
                    "input": {"turn_detection": {"type": "server_vad", "interrupt_response": False}},
                    "output": {"voice": "marin"}}})
            await client.answer(answer.text)
            await client.wait(lambda: "session.created" in client.types(), "session.created")
            assert client.events[0]["session"]["instructions"] == "a helpful echo"
            await client.wait(client.heard_tone, "the tone coming back")
            # A refused setting is a 400 naming it, before any media.
            with pytest.raises(openai.BadRequestError) as refused:
                await sdk.realtime.calls.create(sdp=await Client().offer(), session={"type": "realtime",
                                                                                     "temperature": "hot"})
            assert refused.value.body["param"].startswith("session.temperature")
            await client.close()
            await sdk.close()
            await wait_live(base, 0)

        run(scenario())


@HOSTS
def test_the_sdk_hangs_up_a_call_and_sip_actions_are_refused_by_name(webrtc_workers):
    app, _ = delay_app(2, webrtc_workers=webrtc_workers)
    with serve(app) as base:
        async def scenario():
            client = Client()
            sdk = openai.AsyncOpenAI(api_key="x", base_url=f"http://{base}/v1")
            answer = await sdk.realtime.calls.create(sdp=await client.offer())
            call_id = answer.response.headers["location"].rsplit("/", 1)[1]
            await client.answer(answer.text)
            await client.wait(lambda: "session.created" in client.types(), "session.created")
            await wait_live(base, 1)
            with pytest.raises(openai.BadRequestError) as refused:  # accept/reject/refer: SIP calls only
                await sdk.realtime.calls.reject(call_id)
            assert refused.value.code == "unsupported_call_action"
            await sdk.realtime.calls.hangup(call_id)
            await wait_live(base, 0)  # the session ended, its slot is free
            with pytest.raises(openai.NotFoundError) as gone:
                await sdk.realtime.calls.hangup(call_id)
            assert gone.value.code == "call_not_found"
            await client.close()
            await sdk.close()

        run(scenario())


def test_gpt_live_over_webrtc_with_the_sdks_live_create():
    app, _ = delay_app(2)
    with serve(app) as base:
        async def scenario():
            client = Client()
            sdk = openai.AsyncOpenAI(api_key="x", base_url=f"http://{base}/v1")
            created = await sdk.live.create(session={"model": "gpt-live-1", "instructions": "",
                                                     "audio": {"output": {"voice": "marin"}}},
                                            transport={"type": "webrtc", "sdp": await client.offer()})
            assert created.session.id.startswith("sess_") and created.transport.type == "webrtc"
            await client.answer(created.transport.sdp)
            await client.wait(lambda: "session.started" in client.types(), "session.started")
            assert client.types()[0] == "session.started"
            assert client.events[0]["session"]["id"] == created.session.id
            await client.wait(client.heard_tone, "the tone coming back")
            await client.wait(lambda: "session.output_transcript.delta" in client.types(), "the model's text")
            assert "session.output_audio.delta" not in client.types(), "audio goes on the track"
            for event in client.events:  # every event parses with the SDK's own types
                LIVE_SERVER_EVENT.validate_python(event)
            client.send({"type": "session.start", "event_id": "again", "session": {"model": "gpt-live-1"}})
            await client.wait(lambda: "error" in client.types(), "session_already_started")
            assert next(e for e in client.events if e["type"] == "error")["error"]["code"] == "session_already_started"
            client.send({"type": "session.close"})
            await client.wait(lambda: "session.closed" in client.types(), "session.closed")
            await client.close()
            await sdk.close()
            await wait_live(base, 0)
            # Each frame played on the track is counted with its delay, as on every other door.
            metrics = httpx.get(f"http://{base}/metrics").text
            sent = float(re.search(r'^parley_frames_out_total\{protocol="live"\} (\S+)$', metrics, re.M).group(1))
            delays = float(re.search(r"^parley_frame_delay_seconds_count (\S+)$", metrics, re.M).group(1))
            assert sent > 0 and delays == sent

        run(scenario())


def test_bad_calls_are_refused_before_media_and_only_that_call_ends():
    """A malformed SDP, an offer without audio, refused settings: 400s; a peer that vanishes
    mid-call ends its own call while another goes on hearing its echo."""
    app, _ = delay_app(2)
    app.state.webrtc.argv = [sys.executable, str(FAST_CONSENT_WORKER)]  # a vanished peer fails consent sooner
    with serve(app) as base:
        async def scenario():
            steady = Client()
            sdk = openai.AsyncOpenAI(api_key="x", base_url=f"http://{base}/v1")
            answer = await sdk.realtime.calls.create(sdp=await steady.offer(), session=ECHO_SETTINGS)
            await steady.answer(answer.text)
            await steady.wait(lambda: "session.created" in steady.types(), "session.created")
            async with httpx.AsyncClient() as http:
                url = f"http://{base}/v1/realtime/calls"
                sdp = {"Content-Type": "application/sdp"}
                unserved = await http.post(f"{url}?model=gpt-5", content="v=0", headers=sdp)
                assert unserved.status_code == 404 and unserved.json()["error"]["code"] == "model_not_found"
                garbage = await http.post(url, content="v=0\r\nthis is not sdp\r\n", headers=sdp)
                assert garbage.status_code == 400 and garbage.json()["error"]["code"] == "invalid_offer"
                not_sdp = await http.post(url, content="hello", headers=sdp)
                assert not_sdp.status_code == 400 and not_sdp.json()["error"]["param"] == "sdp"
                no_audio = RTCPeerConnection()  # an offer with a data channel and no audio
                no_audio.createDataChannel("oai-events")
                await no_audio.setLocalDescription(await no_audio.createOffer())
                refused = await http.post(url, content=no_audio.localDescription.sdp, headers=sdp)
                assert refused.status_code == 400 and "no audio" in refused.json()["error"]["message"]
                await no_audio.close()
                live = await http.post(f"http://{base}/v1/live/sessions", json={
                    "session": {"model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}},
                    "transport": {"type": "webrtc", "sdp": "v=0"}})
                assert live.status_code == 400 and live.json()["error"]["param"] == "session.audio.format"
                for door, body in ((url, {"files": {"sdp": (None, "v=0"), "session": (None, json.dumps(
                        {"type": "realtime", "model": "gpt-5"}))}}),
                                   (f"http://{base}/v1/live/sessions", {"json": {
                                       "session": {"model": "gpt-5"}, "transport": {"type": "webrtc", "sdp": "v=0"}}})):
                    unserved = await http.post(door, **body)  # an unserved model in the settings: 404, as ?model=
                    assert unserved.status_code == 404 and unserved.json()["error"]["code"] == "model_not_found"
                assert (await http.get(f"http://{base}/load")).json()["prefill"] == 0  # no slot kept by a refusal
            # The vanishing peer: its transports stop without a goodbye (no DTLS close, no SCTP abort).
            vanishing = Client()
            answer = await sdk.realtime.calls.create(sdp=await vanishing.offer())
            await vanishing.answer(answer.text)
            await vanishing.wait(lambda: "session.created" in vanishing.types(), "session.created")
            await wait_live(base, 2)
            for transceiver in vanishing.pc.getTransceivers():
                await transceiver.receiver.transport.transport.stop()  # the ICE transport, silently
            await wait_live(base, 1)
            steady.audio.clear()
            await steady.wait(steady.heard_tone, "the other call still hearing its echo")
            await steady.close()
            await vanishing.close()
            await sdk.close()
            await wait_live(base, 0)

        run(scenario())


def test_a_full_server_refuses_a_call_with_503_and_the_key_and_origin_are_checked():
    from parley.realtime.sessions.session import ServerDefaults

    app, _ = delay_app(1, defaults=ServerDefaults(api_key="k"))
    with serve(app) as base:
        async def scenario():
            sdk = openai.AsyncOpenAI(api_key="k", base_url=f"http://{base}/v1")
            with pytest.raises(openai.AuthenticationError):
                await openai.AsyncOpenAI(api_key="wrong", base_url=f"http://{base}/v1").realtime.calls.create(
                    sdp=await Client().offer())
            async with httpx.AsyncClient() as http:
                cross = await http.post(f"http://{base}/v1/live/sessions", headers={
                    "Authorization": "Bearer k", "Origin": "https://evil.example"}, json={})
                assert cross.status_code == 403 and cross.json()["error"]["code"] == "origin_not_allowed"
                hangup = await http.post(f"http://{base}/v1/realtime/calls/rtc_x/hangup", headers={
                    "Authorization": "Bearer k", "Origin": "https://evil.example"})
                assert hangup.status_code == 403  # a call's action is origin-checked as its door is
            first = Client()
            answer = await sdk.realtime.calls.create(sdp=await first.offer())
            await first.answer(answer.text)
            await first.wait(lambda: "session.created" in first.types(), "session.created")
            with pytest.raises(openai.InternalServerError) as full:
                await sdk.with_options(max_retries=0).live.create(
                    session={"model": "gpt-live-1"}, transport={"type": "webrtc", "sdp": await Client().offer()})
            assert full.value.status_code == 503 and full.value.response.headers["retry-after"] == "1"
            assert full.value.body["code"] == "session_limit_reached"
            await first.close()
            await wait_live(base, 0, key="k")

        run(scenario())


async def wait_live(base: str, n: int, key: str | None = None) -> None:
    """Until the server holds `n` sessions (its /load: live plus prefilling)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient() as http:
        for _ in range(int(WAIT_S / 0.1)):
            load = (await http.get(f"http://{base}/load", headers=headers)).json()
            if load["live"] + load["prefill"] == n:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"the server did not reach {n} sessions: {load}")


def test_ice_servers_come_from_the_flags_and_reach_the_page():
    from parley.realtime.cli import build_parser, reliability_settings
    from parley.realtime.calls.transport import IceServer, parse_ice_servers

    assert parse_ice_servers(None) == ()
    assert parse_ice_servers("stun:stun.example.com:3478, turn:t.example.com:3478?transport=udp", "u", "p") == (
        IceServer("stun:stun.example.com:3478"), IceServer("turn:t.example.com:3478?transport=udp", "u", "p"))
    for bad, words in (("http://x", "not a stun:"), ("turn:t.example.com", "--turn-username")):
        with pytest.raises(ValueError, match=words):
            parse_ice_servers(bad)
    with pytest.raises(ValueError, match="are for a turn: URL"):
        parse_ice_servers("stun:s.example.com", "u", "p")
    args = build_parser().parse_args(["serve", "--ice-servers", "stun:stun.example.com:3478"])
    assert reliability_settings(args)["ice_servers"] == (IceServer("stun:stun.example.com:3478"),)
    from parley.realtime.sessions.session import ServerDefaults

    app, _ = delay_app(1, defaults=ServerDefaults(ice_servers=(IceServer("turn:t.example.com:3478", "u", "p"),)))
    with serve(app) as base:
        info = httpx.get(f"http://{base}/api/info").json()
    assert info["webrtc"] is True
    assert info["ice_servers"] == [{"urls": "turn:t.example.com:3478", "username": "u", "credential": "p"}]


def test_output_audio_buffer_events_follow_the_response_on_the_track():
    """started before a response's first audio on the track, once; stopped after its response.done,
    cleared when it was cancelled; another response's done changes nothing."""
    from parley.realtime.calls.frame_output import PlayingResponse

    playing = PlayingResponse(lambda what, rid: (what, rid))
    assert playing.before_audio({"response_id": "r1"}) == [("started", "r1")]
    assert playing.before_audio({"response_id": "r1"}) == []
    assert playing.after({"type": "response.done", "response": {"id": "r0", "status": "completed"}}) == []
    assert playing.after({"type": "response.output_audio.done", "response_id": "r1"}) == []
    assert playing.after({"type": "response.done", "response": {"id": "r1", "status": "completed"}}) == \
        [("stopped", "r1")]
    assert playing.before_audio({"response_id": "r2"}) == [("started", "r2")]
    assert playing.after({"type": "response.done", "response": {"id": "r2", "status": "cancelled"}}) == \
        [("cleared", "r2")]
    assert playing.response_id is None
