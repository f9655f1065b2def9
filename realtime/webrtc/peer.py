"""One call's aiortc peer, held by webrtc/worker.py's Worker (in a WebRTC worker process, or in an
edge worker: webrtc/local.py): RTCPeerConnection, DTLS/SRTP, the `oai-events` data channel and the
audio tracks, resampled between Opus's 48 kHz and the model's 24 kHz with soxr. It hands what it
gets to its `CallSink` (the worker frames it for the call) and takes model audio and events from
the worker.

Rules (webrtc/transport.py keeps the server's half):
1. The offer must hold an audio m-line; anything aiortc cannot parse or answer is an `OfferError`,
   raised before any media flows.
2. Events are the data channel's messages, exactly the JSON of the WebSocket door. A channel the
   client opened with another label is ignored; a message over the transport cap ends the call
   (`overflowed`).
3. Audio in: aiortc decodes Opus on its receiver's thread; each 20 ms frame (48 kHz, stereo s16)
   is mixed to mono, resampled to 24 kHz and handed on at once.
4. Audio out: `ModelAudioTrack` hands aiortc one 20 ms packet per 20 ms on a fixed grid of the
   monotonic clock, the clock the engine's ticks keep (one clock for every process on the host;
   each 80 ms tick gives four packets), so it never drifts from the ticks and never bursts. A
   packet with no model audio ready is silence, not a wait. Queued audio is bounded by the lag
   limit: past it the oldest is dropped, counted. aiortc encodes Opus on its executor's threads.
5. The call ends when the peer hangs up, when ICE or DTLS fails (a vanished peer fails ICE's
   consent checks), when it has not connected within CONNECT_TIMEOUT_S, or when the server closes it.
"""

from __future__ import annotations

import asyncio
import collections
import fractions
import logging
import time
from typing import Protocol

import numpy as np
import soxr
from aiortc import (
    MediaStreamTrack, RTCConfiguration, RTCDataChannel, RTCIceServer, RTCPeerConnection, RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError
from aiortc.sdp import SessionDescription
from av import AudioFrame

from parley.models import FRAME_SAMPLES, SAMPLE_RATE

from .wire import CONNECT_TIMEOUT_S, EVENTS_LABEL, MAX_MESSAGE_BYTES, OfferError

log = logging.getLogger("parley.webrtc.worker")  # (in a worker process, or an edge worker's calls)

OPUS_RATE = 48000  # WebRTC's Opus clock rate
PACKET_SAMPLES = OPUS_RATE * 20 // 1000  # 960: one 20 ms packet at 48 kHz
PACKET_SECONDS = PACKET_SAMPLES / OPUS_RATE
PACKETS_PER_FRAME = FRAME_SAMPLES * OPUS_RATE // SAMPLE_RATE // PACKET_SAMPLES  # 4 per 80 ms model frame


class CallSink(Protocol):
    """Where a peer's news goes (the worker frames each for the server)."""

    def ready(self) -> None: ...

    def audio(self, pcm: np.ndarray) -> None: ...

    def message(self, message: str | bytes) -> None: ...

    def ended(self, overflowed: bool) -> None: ...


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

    def due(self) -> float:
        """When the next packet is due on the grid (starting the grid at the first ask)."""
        now = self._clock()
        if self._start is None:
            self._start = now
        due = self._start + self._pts / OPUS_RATE
        if now - due > 0.5:  # the loop stalled: start a new grid rather than burst to catch up
            self._start = now - self._pts / OPUS_RATE
            due = now
        return due

    def next_packet(self) -> AudioFrame:
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

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        wait = self.due() - self._clock()
        if wait > 0:
            await asyncio.sleep(wait)
        return self.next_packet()


class PeerAudio:
    """The peer's microphone track in, at the model's rate, to the sink (rule 3)."""

    def __init__(self, sink: CallSink) -> None:
        self._sink = sink
        self._resampler = soxr.ResampleStream(OPUS_RATE, SAMPLE_RATE, 1, dtype="float32")
        self._reader: asyncio.Task | None = None

    def listen(self, track: MediaStreamTrack) -> None:
        """Start reading the peer's audio track (the first one; another is ignored)."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_track(track), name="webrtc-audio-in")

    async def _read_track(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                frame = await track.recv()
                self._sink.audio(self._to_model_rate(frame))
        except MediaStreamError:
            pass  # the track ended: the peer hung up or the call closed

    def _to_model_rate(self, frame: AudioFrame) -> np.ndarray:
        samples = frame.to_ndarray()  # packed s16: (1, samples * channels)
        channels = len(frame.layout.channels)
        mono = samples.reshape(-1, channels).astype(np.float32).mean(axis=1) / 32768.0
        if frame.sample_rate != OPUS_RATE:  # aiortc's Opus decoder gives 48 kHz; be safe
            return soxr.resample(mono, frame.sample_rate, SAMPLE_RATE).astype(np.float32)
        return self._resampler.resample_chunk(mono)

    def stop(self) -> None:
        if self._reader is not None:
            self._reader.cancel()


class Peer:
    """One call's aiortc peer. `answer(offer)` first; news goes to the sink, `ended` exactly once."""

    def __init__(self, sink: CallSink, ice_servers: list[dict], max_lag_s: float) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[RTCIceServer(**s) for s in ice_servers]))
        self.sink = sink
        self.outgoing = ModelAudioTrack(max_lag_s)
        self.incoming = PeerAudio(sink)
        self.channel: RTCDataChannel | None = None
        self._wants_channel = False  # the offer has an application m-line (a data channel)
        self._ready = False
        self._ended = False
        self._timeout: asyncio.TimerHandle | None = None
        self.pc.on("track", self._on_track)
        self.pc.on("datachannel", self._on_datachannel)
        self.pc.on("connectionstatechange", self._on_state)

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
        self.pc.addTrack(self.outgoing)
        try:
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except Exception as exc:
            raise OfferError(f"the SDP offer cannot be answered: {exc or type(exc).__name__}"[:300]) from None
        self._timeout = asyncio.get_running_loop().call_later(CONNECT_TIMEOUT_S + 5.0, self._connect_timeout)
        return self.pc.localDescription.sdp

    def _connect_timeout(self) -> None:
        if not self._ready:  # the server ends it at CONNECT_TIMEOUT_S; this is the worker's own bound
            log.info("webrtc call: the peer did not connect")
            self.end()

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self.incoming.listen(track)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_LABEL or self.channel is not None:
            log.info("webrtc call: ignoring data channel %r", channel.label[:40])
            return
        self.channel = channel
        channel.on("message", self._on_message)
        channel.on("close", self.end)
        if channel.readyState == "open":
            self._set_ready()
        else:
            channel.on("open", self._set_ready)

    def _set_ready(self) -> None:
        if not self._ready and not self._ended:
            self._ready = True
            self.sink.ready()

    def _on_message(self, message: str | bytes) -> None:
        if self._ended:
            return
        if len(message) > MAX_MESSAGE_BYTES:
            self.end(overflowed=True)
            return
        self.sink.message(message)

    async def _on_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected" and not self._wants_channel:
            self._set_ready()
        elif state in ("failed", "closed"):
            self.end()

    @property
    def ended(self) -> bool:
        return self._ended

    def backlog(self) -> int:
        return self.channel.bufferedAmount if self.channel is not None else 0

    def send(self, message: str | bytes) -> None:
        """Onto the events channel; a call without one gets its audio only."""
        if self._ended or self.channel is None or self.channel.readyState != "open":
            return
        try:
            self.channel.send(message)
        except Exception:  # the channel's transport closed under it: the call is over
            self.end()

    def end(self, overflowed: bool = False) -> None:
        """Tell the sink once; the worker then closes the peer (`close`)."""
        if not self._ended:
            self._ended = True
            self.sink.ended(overflowed)

    async def close(self) -> None:
        self.end()
        if self._timeout is not None:
            self._timeout.cancel()
        self.incoming.stop()
        self.outgoing.stop()
        try:
            await self.pc.close()
        except Exception:  # a half-set-up peer: nothing more to release
            log.debug("closing a webrtc peer failed", exc_info=True)
