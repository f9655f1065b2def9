"""The wire between the server and its WebRTC worker processes (webrtc/pool.py <-> webrtc/worker.py),
and the limits both ends keep. Imports no aiortc: the server process never loads it. An edge
worker speaks the same frames to the peers it runs itself, over an in-process link (webrtc/local.py).

One Unix socketpair per worker carries frames for many calls, multiplexed by call id:

    op u8, call u32, length u32, payload        (little endian)

server -> worker: OFFER (JSON: sdp, ice_servers, max_lag_s), PLAY (24 kHz float32 model audio),
  TEXT / BYTES (an event for the data channel), CLOSE (hang up; no reply but ENDED).
worker -> server: HELLO (call 0: the worker is up), ANSWER (the SDP answer), REFUSED (the offer
  cannot be answered: the text says why, the door's 400), READY (the events channel is open, or
  the call connected without one), AUDIO (24 kHz float32 peer audio, 20 ms a chunk), TEXT / BYTES
  (a data channel message), BACKLOG (u64: the channel's bufferedAmount, sent when it changes),
  DROPPED (u32 input chunks, u32 output 80 ms frames: dropped in the worker; u32 20 ms packets the
  track sent as silence, no model audio being ready: each since the last report),
  ENDED (u8 overflowed: the call is over; its id is free; before an ANSWER: the peer failed).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Callable, Protocol

HEADER = struct.Struct("<BII")
BACKLOG = struct.Struct("<Q")
DROPPED = struct.Struct("<III")

# server -> worker
OFFER, PLAY, SEND_TEXT, SEND_BYTES, CLOSE = 1, 2, 3, 4, 5
# worker -> server
HELLO, ANSWER, REFUSED, READY, AUDIO, TEXT, BYTES, BACKLOG_OP, DROPPED_OP, ENDED = range(10, 20)

EVENTS_LABEL = "oai-events"  # the data channel OpenAI's WebRTC clients open for JSON events
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the WebSocket doors' transport cap (limits.WS_MAX_SIZE)
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + 4096  # a frame past this is a broken peer process, not a message
MAX_QUEUED_MESSAGES = 1024  # events received and not yet read by the connection
MAX_INPUT_CHUNKS = 100  # 20 ms chunks of peer audio not yet read: 2 s
CONNECT_TIMEOUT_S = 20.0  # a call whose peer has not connected by then is ended
# Bytes queued on one socket toward the other process. Past SOFT, audio is dropped (counted);
# past HARD, the other side has stopped reading: the server restarts the worker, a worker ends the call.
SOFT_OUTBOX_BYTES = 8 * 1024 * 1024
HARD_OUTBOX_BYTES = 64 * 1024 * 1024


class OfferError(ValueError):
    """An SDP offer this server cannot answer; the message says why (it becomes the door's 400)."""


class Link(Protocol):
    """One end of the wire: a socket's (FrameProtocol), or an in-process one (webrtc/local.py)."""

    def send(self, op: int, call: int, payload: bytes = b"") -> None: ...

    def queued(self) -> int: ...  # bytes sent and not yet taken by the other end


def frame(op: int, call: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(op, call, len(payload)) + payload


class FrameProtocol(asyncio.Protocol):
    """One end of a worker's socket: frames in to `on_frame(op, call, payload)`, `on_lost(why)`
    once when the socket closes or carries a frame no sender would write."""

    def __init__(self, on_frame: Callable[[int, int, bytes], None], on_lost: Callable[[str], None]) -> None:
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        at = 0
        while len(buf) - at >= HEADER.size:
            op, call, n = HEADER.unpack_from(buf, at)
            if n > MAX_FRAME_BYTES:
                self._lose(f"a frame of {n} bytes (op {op}) is over the wire's limit")
                return
            if len(buf) - at - HEADER.size < n:
                break
            start = at + HEADER.size
            payload = bytes(buf[start:start + n])
            at = start + n
            self._on_frame(op, call, payload)
        del buf[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(f"the socket closed ({exc})" if exc else "the socket closed")

    def _lose(self, why: str) -> None:
        if not self.lost.done():
            self.lost.set_result(why)
            if self.transport is not None:
                self.transport.abort()
            self._on_lost(why)

    def send(self, op: int, call: int, payload: bytes = b"") -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame(op, call, payload))

    def queued(self) -> int:
        """Bytes written and not yet taken by the other process."""
        return self.transport.get_write_buffer_size() if self.transport is not None else 0
