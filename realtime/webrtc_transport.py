"""A WebRTC call as a Transport (transport.py): aiortc's peer, the `oai-events` data channel and
the audio tracks, resampled between Opus's 48 kHz and the model's 24 kHz with soxr.

Rules this module keeps:
1. The peer's offer must hold an audio m-line; anything aiortc cannot parse or answer is an
   `OfferError` (the door's 400), raised before any media flows.
2. Events are the data channel's messages, exactly the JSON of the WebSocket door. A channel the
   client opened with another label is ignored; a message over the transport cap ends the call.
   Messages wait in a bounded queue (MAX_QUEUED_MESSAGES) until the connection reads them; a peer
   that outruns it is over any rate limit, and its call ends (`overflowed`).
3. Audio in: aiortc decodes Opus on its receiver's thread; each 20 ms frame (48 kHz, stereo
   s16) is mixed to mono and resampled to 24 kHz, and waits for the connection in a bounded
   queue (MAX_INPUT_CHUNKS; past it the oldest is dropped: a stalled reader never grows memory).
4. Audio out: `ModelAudioTrack` hands aiortc one 20 ms packet per 20 ms on a fixed grid of the
   monotonic clock, the clock the engine's ticks keep (each 80 ms tick gives four packets), so
   it never drifts from the ticks and never bursts. A packet with no model audio ready is
   silence, not a wait: a late frame delays nothing. Queued audio is bounded by the lag limit:
   past it the oldest is dropped, counted. aiortc encodes Opus on its executor's threads.
5. The call ends when the peer hangs up, when ICE or DTLS fails (a vanished peer fails ICE's
   consent checks), or when the server closes it; `receive()` then returns None, and the
   connection ends exactly as when a WebSocket client leaves.
"""

from __future__ import annotations

import asyncio
import collections
import fractions
import logging
import time
from typing import Mapping

import numpy as np
import soxr
from aiortc import (
    MediaStreamTrack, RTCConfiguration, RTCDataChannel, RTCIceServer, RTCPeerConnection, RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError
from aiortc.sdp import SessionDescription
from av import AudioFrame

from parley.models import FRAME_SAMPLES, SAMPLE_RATE

from .transport import IceServer

log = logging.getLogger("parley.webrtc")

EVENTS_LABEL = "oai-events"  # the data channel OpenAI's WebRTC clients open for JSON events
OPUS_RATE = 48000  # WebRTC's Opus clock rate
PACKET_SAMPLES = OPUS_RATE * 20 // 1000  # 960: one 20 ms packet at 48 kHz
PACKET_SECONDS = PACKET_SAMPLES / OPUS_RATE
PACKETS_PER_FRAME = FRAME_SAMPLES * OPUS_RATE // SAMPLE_RATE // PACKET_SAMPLES  # 4 per 80 ms model frame
MAX_QUEUED_MESSAGES = 1024  # events received and not yet read
MAX_INPUT_CHUNKS = 100  # 20 ms chunks of peer audio not yet read: 2 s
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the WebSocket doors' transport cap (limits.WS_MAX_SIZE)
CONNECT_TIMEOUT_S = 20.0  # a call whose peer has not connected by then is ended


class OfferError(ValueError):
    """An SDP offer this server cannot answer; the message says why (it becomes the 400's)."""


class ModelAudioTrack(MediaStreamTrack):
    """The model's voice as an outgoing WebRTC track: 20 ms packets of 48 kHz mono s16 (rule 4)."""

    kind = "audio"

    def __init__(self, max_lag_s: float, clock=time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._resampler = soxr.ResampleStream(SAMPLE_RATE, OPUS_RATE, 1, dtype="float32")
        self._carry = np.zeros(0, np.float32)  # resampled audio short of a whole packet
        self._packets: collections.deque[np.ndarray] = collections.deque()
        self._max_packets = max(PACKETS_PER_FRAME, int(max_lag_s / PACKET_SECONDS))
        self._start: float | None = None  # the grid's origin: the first packet's time
        self._pts = 0  # samples sent (the RTP timestamp's clock)
        self.dropped_packets = 0
        self.silent_packets = 0

    def play(self, pcm: np.ndarray) -> int:
        """Queue 24 kHz model audio; returns the 80 ms frames' worth of oldest audio dropped."""
        audio = np.concatenate([self._carry, self._resampler.resample_chunk(np.asarray(pcm, np.float32))])
        whole = audio.size // PACKET_SAMPLES * PACKET_SAMPLES
        for start in range(0, whole, PACKET_SAMPLES):
            packet = np.clip(audio[start:start + PACKET_SAMPLES], -1.0, 1.0)
            self._packets.append((packet * 32767).astype(np.int16))
        self._carry = audio[whole:]
        dropped = 0
        while len(self._packets) > self._max_packets:
            self._packets.popleft()
            dropped += 1
        self.dropped_packets += dropped
        return -(-dropped // PACKETS_PER_FRAME)

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = self._clock()
        if self._start is None:
            self._start = now
        due = self._start + self._pts / OPUS_RATE
        if due > now:
            await asyncio.sleep(due - now)
        elif now - due > 0.5:  # the loop stalled: start a new grid rather than burst to catch up
            self._start = now - self._pts / OPUS_RATE
        if self._packets:
            data = self._packets.popleft()
        else:
            data = np.zeros(PACKET_SAMPLES, np.int16)
            self.silent_packets += 1
        frame = AudioFrame.from_ndarray(data.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = OPUS_RATE
        frame.pts = self._pts
        frame.time_base = fractions.Fraction(1, OPUS_RATE)
        self._pts += PACKET_SAMPLES
        return frame


class TrackMedia:
    """The call's Media (transport.py): the peer's track in, the model's track out."""

    def __init__(self, outgoing: ModelAudioTrack) -> None:
        self.outgoing = outgoing
        self._chunks: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        self._resampler = soxr.ResampleStream(OPUS_RATE, SAMPLE_RATE, 1, dtype="float32")
        self._reader: asyncio.Task | None = None
        self.dropped_chunks = 0

    def listen(self, track: MediaStreamTrack) -> None:
        """Start reading the peer's audio track (the first one; another is ignored)."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_track(track), name="webrtc-audio-in")

    async def _read_track(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                frame = await track.recv()
                self._put(self._to_model_rate(frame))
        except MediaStreamError:
            pass  # the track ended: the peer hung up or the call closed
        finally:
            self._chunks.put_nowait(None)

    def _to_model_rate(self, frame: AudioFrame) -> np.ndarray:
        samples = frame.to_ndarray()  # packed s16: (1, samples * channels)
        channels = len(frame.layout.channels)
        mono = samples.reshape(-1, channels).astype(np.float32).mean(axis=1) / 32768.0
        if frame.sample_rate != OPUS_RATE:  # aiortc's Opus decoder gives 48 kHz; be safe
            return soxr.resample(mono, frame.sample_rate, SAMPLE_RATE).astype(np.float32)
        return self._resampler.resample_chunk(mono)

    def _put(self, chunk: np.ndarray) -> None:
        if self._chunks.qsize() >= MAX_INPUT_CHUNKS:
            self._chunks.get_nowait()
            self.dropped_chunks += 1
        self._chunks.put_nowait(chunk)

    async def read(self) -> np.ndarray | None:
        return await self._chunks.get()

    def play(self, pcm: np.ndarray) -> int:
        return self.outgoing.play(pcm)

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.outgoing.stop()


class WebRTCCall:
    """One WebRTC call: a Transport whose events ride the `oai-events` channel and whose audio rides
    the tracks. `answer(offer)` first; then the door runs a connection over it."""

    def __init__(self, scope: Mapping, ice_servers: tuple[IceServer, ...] = (), max_lag_s: float = 1.0) -> None:
        self.scope = scope
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[
            RTCIceServer(urls=s.urls, username=s.username, credential=s.credential) for s in ice_servers]))
        self.media = TrackMedia(ModelAudioTrack(max_lag_s))
        self.channel: RTCDataChannel | None = None
        self.overflowed = False  # the peer sent more than the queue holds, or a message over the cap
        self._messages: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self._wants_channel = False  # the offer has an application m-line (a data channel)
        self._ready = asyncio.Event()  # the channel is open (or, without one, the peer connected)
        self._ended = asyncio.Event()
        self.pc.on("track", self._on_track)
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)

    # ---- setup ----

    async def answer(self, offer: str) -> str:
        """The SDP answer to the peer's offer (OfferError: malformed, or without audio)."""
        if not isinstance(offer, str) or not offer.strip().startswith("v="):
            raise OfferError("the body is not an SDP offer (it must start with v=0)")
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
        except Exception as exc:  # aiortc's parser raises several kinds; every one is the client's SDP
            raise OfferError(f"the SDP offer cannot be used: {exc or type(exc).__name__}"[:300]) from None
        if not any(t.kind == "audio" for t in self.pc.getTransceivers()):
            raise OfferError("the SDP offer has no audio m-line: a call needs an audio track")
        self._wants_channel = any(m.kind == "application" for m in SessionDescription.parse(offer).media)
        self.pc.addTrack(self.media.outgoing)
        try:
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except Exception as exc:
            raise OfferError(f"the SDP offer cannot be answered: {exc or type(exc).__name__}"[:300]) from None
        return self.pc.localDescription.sdp

    async def wait_ready(self, timeout: float = CONNECT_TIMEOUT_S) -> bool:
        """True once the peer can be talked to: its `oai-events` channel is open (or, with no data
        channel in the offer, the call connected); False if it ended or timed out first."""
        ready = asyncio.create_task(self._ready.wait())
        ended = asyncio.create_task(self._ended.wait())
        try:
            await asyncio.wait((ready, ended), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            ended.cancel()
        return self._ready.is_set() and not self._ended.is_set()

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self.media.listen(track)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_LABEL or self.channel is not None:
            log.info("webrtc call: ignoring data channel %r", channel.label[:40])
            return
        self.channel = channel
        channel.on("message", self._on_message)
        channel.on("close", self._end)
        if channel.readyState == "open":
            self._ready.set()
        else:
            channel.on("open", self._ready.set)

    def _on_message(self, message: str | bytes) -> None:
        if self._ended.is_set():
            return
        if len(message) > MAX_MESSAGE_BYTES or self._messages.qsize() >= MAX_QUEUED_MESSAGES:
            self.overflowed = True
            self._end()
            return
        self._messages.put_nowait(message)

    async def _on_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected" and not self._wants_channel:
            self._ready.set()
        elif state in ("failed", "closed"):
            self._end()

    def _end(self) -> None:
        if not self._ended.is_set():
            self._ended.set()
            self._messages.put_nowait(None)

    # ---- Transport ----

    @property
    def open(self) -> bool:
        return not self._ended.is_set()

    def backlog(self) -> int | None:
        return self.channel.bufferedAmount if self.channel is not None else None

    async def receive(self) -> str | bytes | None:
        if self._ended.is_set() and self._messages.empty():
            return None
        return await self._messages.get()

    async def send_text(self, text: str) -> None:
        self._send(text)

    async def send_bytes(self, data: bytes) -> None:
        self._send(data)

    def _send(self, message: str | bytes) -> None:
        if self._ended.is_set():
            raise ConnectionError("the call has ended")
        if self.channel is None or self.channel.readyState != "open":
            return  # a call without an events channel gets its audio only
        try:
            self.channel.send(message)
        except Exception as exc:  # the channel's transport closed under it
            raise ConnectionError(f"the events channel is closed: {exc}") from None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Hang up (the code and reason have no wire form in WebRTC; they are logged)."""
        if code != 1000:
            log.info("webrtc call ended by the server: %d %s", code, reason[:100])
        self._end()
        self.media.stop()
        try:
            await self.pc.close()
        except Exception:  # a half-set-up peer: nothing more to release
            log.debug("closing a webrtc peer failed", exc_info=True)
