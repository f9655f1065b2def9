"""A WebRTC call as a Transport (calls/transport.py): the connection's side of the call, speaking
webrtc/wire.py's frames to the call's aiortc peer (webrtc/peer.py, held by webrtc/worker.py's
`Worker`) through its `PeerHost`, one of two:
- `WebRTCPool` (webrtc/pool.py): WebRTC worker processes, over a socket each: the one-process
  server's, whose event loop only frames and routes bytes (the engine thread shares its GIL, so
  Opus, SRTP, DTLS and SCTP never run there);
- `LocalPeers` (webrtc/local.py): the peers on this process's own loop: an edge worker's
  (server/edge_worker.py), which owns its calls end to end.

Rules this half keeps (webrtc/peer.py keeps the peer's):
1. `answer(offer)` returns the SDP answer, or raises `OfferError` (the door's 400) before any
   media flows; `CallUnavailable` (a 503) when no host can take the call, its peer ended or
   failed before answering, or its worker died meanwhile.
2. Events are the data channel's messages, exactly the JSON of the WebSocket door. They wait in a
   bounded queue (MAX_QUEUED_MESSAGES) until the connection reads them; a peer that outruns it is
   over any rate limit, and its call ends (`overflowed`), as does one over the message cap.
3. Audio in: 24 kHz chunks wait for the connection in a bounded queue (MAX_INPUT_CHUNKS; past it
   the oldest is dropped, counted: a stalled reader never grows memory).
4. Audio out: `play` frames the model's 24 kHz audio to the peer, whose track paces it; it never
   blocks. Past SOFT_OUTBOX_BYTES queued toward a worker process the audio is dropped (counted as
   the track's own lag drops are, which the peer reports back); past HARD_OUTBOX_BYTES the worker
   is stuck and the pool restarts it (an in-process link queues nothing: webrtc/local.py).
5. The call ends when the peer hangs up or fails, when the server closes it, or when its worker
   dies (each of its calls ends alone: `receive()` returns None, the track's reader gets None).
   `backlog()` is the channel's bufferedAmount as the peer last reported it (no round trip).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Mapping, Protocol

import numpy as np

from parley.models import FRAME_SAMPLES

from . import wire
from ..calls.transport import IceServer
from .wire import CONNECT_TIMEOUT_S, MAX_INPUT_CHUNKS, MAX_QUEUED_MESSAGES, Link, OfferError

__all__ = ["CONNECT_TIMEOUT_S", "CallUnavailable", "OfferError", "PeerHost", "WebRTCCall"]

log = logging.getLogger("parley.webrtc")

ANSWER_TIMEOUT_S = 10.0  # a peer that has not answered an offer by then is stuck


class CallUnavailable(RuntimeError):
    """No WebRTC peer host could take or keep this call (restarting, stuck, or the server is stopping)."""


class Lane(Protocol):
    """What a call is pinned to: the link its frames take (a WebRTC worker process, or this process)."""

    link: Link


class PeerHost(Protocol):
    """Where calls' aiortc peers run (module docstring): the app holds one, its lifespan closes it."""

    async def pin(self, call: "WebRTCCall") -> Lane:
        """Give the call an id (`call.id`) and the lane its frames take; CallUnavailable: none can take it."""
        ...

    def unpin(self, call: "WebRTCCall") -> None:
        """The call is over: frames for its id are dropped from now on."""
        ...

    def stuck(self, call: "WebRTCCall", what: str) -> None:
        """The call's peer `what` (did not answer, stopped reading): end what that takes down."""
        ...

    def count_silent(self, packets: int) -> None:
        """20 ms packets the call's track sent as silence (parley_webrtc_silent_packets_total)."""
        ...

    async def aclose(self) -> None:
        """At shutdown, after the calls hung up: hang up what is left, bounded."""
        ...


class CallAudio:
    """The call's Media (calls/transport.py): the peer's audio in (bounded), the model's out to its peer."""

    def __init__(self, call: "WebRTCCall") -> None:
        self._call = call
        self._chunks: asyncio.Queue[np.ndarray | None] = asyncio.Queue()
        self.dropped_chunks = 0  # here and at the peer

    def put(self, chunk: np.ndarray) -> None:
        if self._chunks.qsize() >= MAX_INPUT_CHUNKS:
            self._chunks.get_nowait()
            self.dropped_chunks += 1
        self._chunks.put_nowait(chunk)

    def end(self) -> None:
        self._chunks.put_nowait(None)

    async def read(self) -> np.ndarray | None:
        return await self._chunks.get()

    def play(self, pcm: np.ndarray) -> int:
        return self._call.play(pcm)


class WebRTCCall:
    """One WebRTC call: a Transport whose events ride the `oai-events` channel and whose audio rides
    the tracks, held by its PeerHost. `answer(offer)` first; then the door runs a connection over it."""

    def __init__(self, scope: Mapping, host: PeerHost, ice_servers: tuple[IceServer, ...] = (),
                 max_lag_s: float = 1.0) -> None:
        self.scope = scope
        self.media = CallAudio(self)
        self.overflowed = False  # the peer sent more than the queue holds, or a message over the cap
        self.id = 0  # the host's, once pinned
        self.lane: Lane | None = None
        self._host = host
        self._ice = [server.for_browser() for server in ice_servers]
        self._max_lag_s = max_lag_s
        self._messages: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        self._answer: asyncio.Future[str] | None = None
        self._ready = asyncio.Event()  # the channel is open (or, without one, the peer connected)
        self._ended = asyncio.Event()
        self._backlog = 0
        self._owed_drops = 0  # 80 ms frames dropped since `play` last said so

    # ---- setup ----

    async def answer(self, offer: str) -> str:
        """The SDP answer to the peer's offer (OfferError: malformed, or without audio)."""
        if not isinstance(offer, str) or not offer.strip().startswith("v="):
            raise OfferError("the body is not an SDP offer (it must start with v=0)")
        if self._ended.is_set():
            raise CallUnavailable("the call was closed before it was answered")
        self._answer = asyncio.get_running_loop().create_future()
        self._answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even if never awaited
        self.lane = await self._host.pin(self)
        request = {"sdp": offer, "ice_servers": self._ice, "max_lag_s": self._max_lag_s}
        self.lane.link.send(wire.OFFER, self.id, json.dumps(request).encode())
        try:
            return await asyncio.wait_for(asyncio.shield(self._answer), ANSWER_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._host.stuck(self, f"did not answer an offer within {ANSWER_TIMEOUT_S:g} s")
            raise CallUnavailable(f"the call's peer did not answer within {ANSWER_TIMEOUT_S:g} s") from None

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

    # ---- the peer's frames (webrtc/wire.py), routed here by the host ----

    def deliver(self, op: int, payload: bytes) -> None:
        if op == wire.AUDIO:
            self.media.put(np.frombuffer(payload, np.float32))
        elif op in (wire.TEXT, wire.BYTES):
            self._on_message(payload.decode(errors="replace") if op == wire.TEXT else payload)
        elif op == wire.BACKLOG_OP:
            self._backlog = wire.BACKLOG.unpack(payload)[0]
        elif op == wire.DROPPED_OP:
            chunks, frames, silent = wire.DROPPED.unpack(payload)
            self.media.dropped_chunks += chunks
            self._owed_drops += frames
            if silent:
                self._host.count_silent(silent)
        elif op == wire.READY:
            self._ready.set()
        elif op == wire.ANSWER:
            self._settle(payload.decode(errors="replace"))
        elif op == wire.REFUSED:
            self._settle(OfferError(payload.decode(errors="replace")))
        elif op == wire.ENDED:
            self.overflowed = self.overflowed or payload[:1] == b"\x01"
            self._settle(CallUnavailable("the call's peer ended before it answered"))
            self._end()

    def lost(self, reason: str) -> None:
        """Its worker died, its peer was stuck, or the server is stopping: this call is over."""
        self._settle(CallUnavailable(reason))
        self._end()

    def _settle(self, result: str | Exception) -> None:
        if self._answer is not None and not self._answer.done():
            if isinstance(result, Exception):
                self._answer.set_exception(result)
            else:
                self._answer.set_result(result)

    def _on_message(self, message: str | bytes) -> None:
        if self._ended.is_set():
            return
        if self._messages.qsize() >= MAX_QUEUED_MESSAGES:
            self.overflowed = True
            self._hang_up()
            return
        self._messages.put_nowait(message)

    def _end(self) -> None:
        if not self._ended.is_set():
            self._ended.set()
            self._messages.put_nowait(None)
            self.media.end()
            self._host.unpin(self)

    def _hang_up(self) -> None:
        if not self._ended.is_set() and self.lane is not None:
            self.lane.link.send(wire.CLOSE, self.id)
        self._end()

    # ---- Transport ----

    @property
    def open(self) -> bool:
        return not self._ended.is_set()

    def backlog(self) -> int | None:
        return self._backlog

    async def receive(self) -> str | bytes | None:
        if self._ended.is_set() and self._messages.empty():
            return None
        return await self._messages.get()

    async def send_text(self, text: str) -> None:
        self._send(wire.SEND_TEXT, text.encode())

    async def send_bytes(self, data: bytes) -> None:
        self._send(wire.SEND_BYTES, bytes(data))

    def _send(self, op: int, payload: bytes) -> None:
        if self._ended.is_set() or self.lane is None:
            raise ConnectionError("the call has ended")
        if self.lane.link.queued() + len(payload) > wire.HARD_OUTBOX_BYTES:
            self._host.stuck(self, "stopped reading its socket")
            raise ConnectionError("the call's peer is stuck")
        self.lane.link.send(op, self.id, payload)

    def play(self, pcm: np.ndarray) -> int:
        """Frame model audio to the peer's track; returns the 80 ms frames dropped since the last call."""
        dropped, self._owed_drops = self._owed_drops, 0
        if self._ended.is_set() or self.lane is None:
            return dropped
        if self.lane.link.queued() > wire.SOFT_OUTBOX_BYTES:
            return dropped + -(-np.size(pcm) // FRAME_SAMPLES)
        self.lane.link.send(wire.PLAY, self.id, np.ascontiguousarray(pcm, np.float32).tobytes())
        return dropped

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Hang up (the code and reason have no wire form in WebRTC; they are logged)."""
        if code != 1000:
            log.info("webrtc call ended by the server: %d %s", code, reason[:100])
        self._settle(CallUnavailable("the call was closed"))
        self._hang_up()
