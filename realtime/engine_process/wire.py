"""What crosses between an edge worker and the engine process, and how.

Two paths per worker (docs/architecture.md, "Processes"):
1. The control channel: one Unix socket. Messages are small tuples, pickled and length-prefixed:
   calls and their replies, one-way casts, the engine's status, and a ring's doorbell. Both ends are
   this program, of one version, on one host; nothing from a client crosses it unchecked.
2. Two shared-memory rings (engine_process/rings.py): audio in (worker -> engine) and events out
   (engine -> worker). A duplex frame and a speech frame are packed by hand, header then PCM, never
   pickled; the rarer events (transcript pieces, images, terminals) are pickled into the same ring,
   so each stream's events arrive in the order they were made.
3. Each side reads its incoming ring before it handles any control message, so audio written before
   a message (a transcription's last audio, then its end of input) is handled before it.
"""

from __future__ import annotations

import asyncio
import math
import pickle
import struct
from typing import Any, Callable

import numpy as np

from ..engine_client import FrameOut, TtsAudio

_LENGTH = struct.Struct("<I")
MAX_MESSAGE = 64 << 20  # a control message past this is a bug on the other side: the channel closes

# ring record heads: kind, stream id, then per kind
_FRAME = struct.Struct("<cQqdiIH")  # b"F", stream, tick, produced_at, text_token, input backlog, text bytes
_AUDIO = struct.Struct("<cQ")  # b"A" (a speech frame) or b"P" (a pickled event), stream
_INPUT = struct.Struct("<cQd")  # b"I", stream, received_at (NaN: None)


class ChannelClosed(Exception):
    """The other process has gone (or sent what this side cannot read)."""


class Channel:
    """The control channel's framing over an asyncio stream pair: `send` a picklable tuple, `receive` one."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    def send(self, message: tuple) -> None:
        if self._writer.is_closing():
            raise ChannelClosed("the control channel is closed")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer.write(_LENGTH.pack(len(data)) + data)

    async def receive(self) -> tuple:
        try:
            head = await self._reader.readexactly(_LENGTH.size)
            size = _LENGTH.unpack(head)[0]
            if size > MAX_MESSAGE:
                raise ChannelClosed(f"a control message of {size} bytes (over {MAX_MESSAGE})")
            return pickle.loads(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ChannelClosed("the other process closed the control channel") from exc

    async def drain(self) -> None:
        try:
            await self._writer.drain()
        except ConnectionError as exc:
            raise ChannelClosed("the other process closed the control channel") from exc

    def close(self) -> None:
        self._writer.close()


class Doorbell:
    """Tells the other side that its incoming ring has records: one `("bell",)` a loop turn, however
    many records were written in it. `channel` gives the channel, None while there is none."""

    def __init__(self, channel: Callable[[], Channel | None]) -> None:
        self._channel = channel
        self._pending = False

    def ring(self) -> None:
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        self._pending = False
        if (channel := self._channel()) is not None:
            try:
                channel.send(("bell",))
            except ChannelClosed:
                pass


def _pcm_bytes(pcm: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(pcm, dtype=np.float32)).cast("B")


def event_parts(stream: int, event: Any, backlog: int = 0) -> tuple[bytes | memoryview, ...]:
    """A stream's event as the parts of one ring record (rule 2 of the module docstring)."""
    if isinstance(event, FrameOut):
        text = event.text.encode()
        head = _FRAME.pack(b"F", stream, event.tick, event.produced_at, event.text_token, backlog, len(text))
        return head, text, _pcm_bytes(event.pcm)
    if isinstance(event, TtsAudio):
        return _AUDIO.pack(b"A", stream), _pcm_bytes(event.pcm)
    return _AUDIO.pack(b"P", stream), pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)


def read_event(record: bytes) -> tuple[int, Any, int | None]:
    """(stream, event, the input backlog a duplex frame reports or None) from a ring record."""
    kind = record[:1]
    if kind == b"F":
        _, stream, tick, produced_at, token, backlog, n_text = _FRAME.unpack_from(record)
        at = _FRAME.size
        text = record[at:at + n_text].decode()
        pcm = np.frombuffer(record, dtype=np.float32, offset=at + n_text)
        return stream, FrameOut(pcm=pcm, text=text, text_token=token, tick=tick, produced_at=produced_at), backlog
    _, stream = _AUDIO.unpack_from(record)
    if kind == b"A":
        return stream, TtsAudio(np.frombuffer(record, dtype=np.float32, offset=_AUDIO.size)), None
    if kind == b"P":
        return stream, pickle.loads(record[_AUDIO.size:]), None
    raise ChannelClosed(f"an events ring record of unknown kind {kind!r}")


def input_parts(stream: int, pcm: np.ndarray, received_at: float | None) -> tuple[bytes | memoryview, ...]:
    """Audio for a duplex session or a transcription request, as the parts of one ring record."""
    at = math.nan if received_at is None else received_at
    return _INPUT.pack(b"I", stream, at), _pcm_bytes(pcm)


def read_input(record: bytes) -> tuple[int, np.ndarray, float | None]:
    kind, stream, at = _INPUT.unpack_from(record)
    if kind != b"I":
        raise ChannelClosed(f"an audio ring record of unknown kind {kind!r}")
    return stream, np.frombuffer(record, dtype=np.float32, offset=_INPUT.size), None if math.isnan(at) else at
