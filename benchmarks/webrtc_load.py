"""load.py's `webrtc` door: one GPT-Live session over WebRTC (`POST /v1/live/sessions` with transport
webrtc), aiortc as the client, as a browser calls: a microphone track paced 20 ms a packet, the
`oai-events` data channel, and the server's audio track read packet by packet.

The microphone carries load.py's probe signal (its tone blocks, its 80 ms frames, four 20 ms
packets each, at 48 kHz) from the start gate on, and silence before and after, as a live
microphone does. An output frame "arrives" every fourth packet of the server's track (its packets
are paced on a 20 ms grid, so the gaps say what the track and the network did to them); text
comes as `session.output_transcript.delta` on the channel, for the echo probe.
"""

from __future__ import annotations

import asyncio
import fractions
import json
import time
import urllib.error
import urllib.request

import numpy as np
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame

from load import BLOCK_FRAMES, FRAME_S, ClientStats

OPUS_RATE = 48_000
PACKET = 960  # 20 ms at 48 kHz
PACKETS_PER_FRAME = 4


class ProbeTrack(MediaStreamTrack):
    """Client `index`'s microphone: silence until the gate, then `frames` probe frames, then silence."""

    kind = "audio"

    def __init__(self, index: int, frames: int, gate: asyncio.Event, stats: ClientStats) -> None:
        super().__init__()
        self.hz = 200 + 37 * index  # load.probe_frame's tone
        self.frames = frames
        self.gate = gate
        self.stats = stats
        self.done = asyncio.Event()
        self._pts = 0
        self._sent = 0  # probe packets sent
        self._start: float | None = None

    def _probe(self) -> np.ndarray:
        frame = self._sent // PACKETS_PER_FRAME
        if self._sent % PACKETS_PER_FRAME == 0:
            self.stats.sent_at.append(time.monotonic())
        t = (self._sent * PACKET + np.arange(PACKET)) / OPUS_RATE
        on = (frame // BLOCK_FRAMES) % 2 == 1
        self._sent += 1
        if self._sent == self.frames * PACKETS_PER_FRAME:
            self.done.set()
        return 0.3 * np.sin(2 * np.pi * self.hz * t) * on

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._start is None:
            self._start = time.monotonic()
        delay = self._start + self._pts / OPUS_RATE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        streaming = self.gate.is_set() and self._sent < self.frames * PACKETS_PER_FRAME
        pcm = self._probe() if streaming else np.zeros(PACKET)
        frame = AudioFrame.from_ndarray((pcm * 32767).astype(np.int16).reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = OPUS_RATE, self._pts, fractions.Fraction(1, OPUS_RATE)
        self._pts += PACKET
        return frame


def _post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


async def _read_track(track: MediaStreamTrack, stats: ClientStats, listening: list[bool]) -> None:
    packets = 0
    try:
        while True:
            await track.recv()
            packets += 1
            if listening[0] and packets % PACKETS_PER_FRAME == 0:
                stats.arrivals.append(time.monotonic())
    except MediaStreamError:
        pass


async def webrtc_client(url: str, index: int, duration: float, start_gate: asyncio.Event,
                        query: str = "") -> ClientStats:
    """`query`: the served duplex model's name (session.model)."""
    stats = ClientStats()
    mic = ProbeTrack(index, int(duration / FRAME_S), start_gate, stats)
    pc = RTCPeerConnection()
    pc.addTrack(mic)
    channel = pc.createDataChannel("oai-events")
    started, closed, listening = asyncio.Event(), asyncio.Event(), [True]
    readers: list[asyncio.Task] = []

    def on_message(raw: str | bytes) -> None:
        event = json.loads(raw)
        if event["type"] == "session.started":
            started.set()
        elif event["type"] == "session.output_transcript.delta":
            stats.texts.append((time.monotonic(), event["delta"]))
        elif event["type"] == "session.closed":
            closed.set()

    channel.on("message", on_message)
    pc.on("track", lambda track: readers.append(asyncio.create_task(_read_track(track, stats, listening))))
    opened = time.monotonic()
    try:
        await pc.setLocalDescription(await pc.createOffer())
        status, body = await asyncio.to_thread(_post, f"{url.replace('ws://', 'http://')}/v1/live/sessions", {
            "session": {"model": query}, "transport": {"type": "webrtc", "sdp": pc.localDescription.sdp}})
        if status != 200:
            stats.refused, stats.close_code, stats.close_reason = True, status, body[:200]
            return stats
        await pc.setRemoteDescription(RTCSessionDescription(json.loads(body)["transport"]["sdp"], "answer"))
        try:
            await asyncio.wait_for(started.wait(), 60)
        except TimeoutError:
            stats.timed_out = True
            return stats
        stats.ready_s = time.monotonic() - opened
        await mic.done.wait()
        await asyncio.sleep(0.6)
        listening[0] = False
        channel.send(json.dumps({"type": "session.close"}))
        try:
            await asyncio.wait_for(closed.wait(), 30)
        except TimeoutError:
            pass
        stats.close_code = 1000
        return stats
    finally:
        await pc.close()
        for reader in readers:
            reader.cancel()
