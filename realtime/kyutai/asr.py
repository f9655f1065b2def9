"""`/api/asr-streaming`: Kyutai moshi-server's streaming speech-to-text, on the STT pool's rows.

Messages (messages.py): in `Init`, `Audio{pcm}` (24 kHz mono float32), `OggOpus{data}`, `Marker{id}`;
out `Ready`, `Word{text, start_time}`, `EndWord{stop_time}`, `Step{step_idx, prs, buffered_pcm}`,
`Marker{id}`, `Error{message}`. The rules, moshi-server's (`batched_asr.rs`) unless said:
1. A connection takes a live row of the STT pool (the engine client's `submit_transcription(live=True)`:
   never queued; its partials carry the words and extra heads). None free:
   `Error{"no free channels"}`, then close 1013 (moshi-server closes without a code).
2. `Ready` is the first message. `Init` before any audio is answered with `Ready` again; after
   audio it is refused with an `Error` (moshi-server resets the row; here open a new connection).
3. Every model step that reads the client's audio sends one `Step`: `step_idx` counts those steps
   (this stream's, as `asr.rs` counts; `batched_asr.rs` sends its batch loop's counter), `prs` is
   every extra head's probability of its entry 0 (head 2 is Parley's end-of-turn head; a model
   without extra heads sends no `Step`), `buffered_pcm` the samples received and not yet stepped.
   The pool's silence prefix (stt_config) is stepped first and sends no `Step`.
4. A word's text goes out as `Word` once the model closes it (the first pad after its pieces), with
   `start_time` the end of the word before; its end follows as `EndWord` (the next end-of-padding).
   Times are seconds of the client's audio.
5. `Marker{id}` comes back once the audio sent before it has been stepped and the model's text
   delay after it: the client must keep sending audio (silence flushes), as with moshi-server.
6. The query takes only a key (`auth_id`, `api_key`: server/security.py); anything else is a 400
   naming it, before the upgrade. Input the door cannot take gets an `Error{message}` on its own
   connection: a frame that is not a message (then close 1007), audio with NaN or too far ahead of
   real time (the chunk is dropped, the stream goes on). Text frames are ignored, as moshi-server
   does. A frame over `MAX_MESSAGE_BYTES` closes 1009; the rate limits, Origin check, keys and drain
   are every door's.
7. The client ends the stream by closing; its row is freed at the pool's next offer. Nothing is
   flushed (moshi-server neither): send the marker and silence first to get the last words.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
from starlette.responses import PlainTextResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from parley.models import FRAME_RATE, FRAME_SAMPLES

from ..engine_client import (EngineClient, Status, SttBusy, SttInputError, SttPartial, Terminal, TranscriptionJob,
                             WordHeard)
from ..media.opus import CodecUnavailable, OpusError
from ..server.security import choose_subprotocol
from ..server.state import app_state
from ..sessions.capacity import deny_upgrade
from ..sessions.session import (CLOSE_INTERNAL, CLOSE_INVALID_PAYLOAD, CLOSE_TOO_BIG, CLOSE_TRY_AGAIN_LATER,
                                EdgeSession, SessionManager)
from . import messages as msg

log = logging.getLogger("parley.kyutai")

PROTOCOL = "kyutai_asr"
MAX_MESSAGE_BYTES = 2 * 1024 * 1024  # ~20 s of float32 samples in one frame; honest clients send 80 ms
NO_FREE_CHANNELS = "no free channels"  # moshi-server's words for a full pool
QUERY = {"auth_id", "api_key"}  # keys, read by server/security.py


class AsrStream:
    """One connection's bookkeeping, apart from the socket: samples fed, client frames stepped,
    markers waiting. `on_partial` turns the pool's partial into moshi-server's messages."""

    def __init__(self, text_delay: int) -> None:
        self.text_delay = text_delay  # frames between an audio frame and its text
        self.fed = 0  # samples of the client's audio fed to the row
        self.stepped = 0  # frames of the client's audio the row has read
        self._markers: deque[tuple[int, int]] = deque()  # (frames that must be read, id), in order

    def add_marker(self, marker_id: int) -> None:
        """Due once the frame holding the last sample fed so far, and `text_delay` frames after it, are read."""
        self._markers.append((-(-self.fed // FRAME_SAMPLES) + self.text_delay, marker_id))

    def on_partial(self, partial: SttPartial) -> list[bytes]:
        out = []
        frames = round(partial.audio_s * FRAME_RATE)
        if frames > self.stepped:  # this step read the client's audio (not the prefix's silence)
            self.stepped = frames
            if partial.heads:
                out.append(msg.step(frames, partial.heads, max(0, self.fed - frames * FRAME_SAMPLES)))
        for event in partial.heard:
            out.append(msg.word(event.text, event.start) if isinstance(event, WordHeard) else msg.end_word(event.end))
        while self._markers and self._markers[0][0] <= self.stepped:
            out.append(msg.marker(self._markers.popleft()[1]))
        return out


async def asr_endpoint(websocket: WebSocket) -> None:
    """Keys and Origins are checked before this runs (server/security.py); mounted only with an
    STT model (server/doors.py)."""
    state = app_state(websocket)
    manager: SessionManager = state.sessions
    unknown = sorted(set(websocket.query_params) - QUERY)
    if unknown:
        why = f"unknown query parameter {unknown[0][:40]!r}; this door takes only a key (auth_id)"
        state.refusals.record(websocket.scope, "options", why)
        await deny_upgrade(websocket, PlainTextResponse(why, status_code=400), why)
        return
    reservation = await manager.admission.reserve_or_deny(websocket, needs_slot=False)  # draining: 503
    if reservation is None:
        return
    edge = manager.attach(websocket, PROTOCOL, reservation)
    edge.notice = lambda reason: edge.outbox.send_bytes(msg.error(reason))
    try:
        await websocket.accept(subprotocol=choose_subprotocol(websocket.scope.get("subprotocols", [])))
        await _serve(edge, state.client, manager)
    except (WebSocketDisconnect, OSError):
        log.info("kyutai asr session %d: the client left", edge.number)
    finally:
        edge.close()


async def _serve(edge: EdgeSession, client: EngineClient, manager: SessionManager) -> None:
    try:
        request = await client.submit_transcription(live=True)
    except SttBusy as exc:
        await edge.outbox.send_bytes(msg.error(NO_FREE_CHANNELS))
        await edge.outbox.refuse(CLOSE_TRY_AGAIN_LATER, "full", f"{NO_FREE_CHANNELS}: {exc}")
        return
    stream = AsrStream(client.stt_facts().text_delay)
    try:
        await edge.outbox.send_bytes(msg.ready())
        await edge.run_duplex(_follow(edge, request, stream), _receive(edge, manager, request, stream))
    finally:
        request.cancel()  # frees the row at the pool's next offer


async def _follow(edge: EdgeSession, request: TranscriptionJob, stream: AsrStream) -> None:
    """Pool -> client: each step's messages, in moshi-server's order (Step, words, markers)."""
    async for event in request.events:
        if isinstance(event, Terminal):
            if event.status is Status.FAILED:
                await edge.outbox.send_bytes(msg.error(event.reason))
                await edge.outbox.close_socket(CLOSE_INTERNAL, event.reason)
            return
        sent = False
        try:
            for message in stream.on_partial(event):
                await edge.outbox.send_bytes(message)
                sent = True
        except (WebSocketDisconnect, RuntimeError, OSError):
            return  # the client left; the receive side sees the disconnect
        if sent and event.heard:
            edge.counters.transcript_sent("standalone", event.input_at)


async def _receive(edge: EdgeSession, manager: SessionManager, request: TranscriptionJob, stream: AsrStream) -> None:
    """Client -> pool. Returns when the client leaves or after closing the socket for bad input."""
    websocket = edge.websocket
    while True:
        frame = await websocket.receive()
        received = time.monotonic()
        if frame["type"] == "websocket.disconnect":
            return
        data = frame.get("bytes")
        if not await edge.outbox.admit_message(len(data) if data is not None else len(frame.get("text") or "")):
            return
        if data is None:
            continue  # a text frame: moshi-server ignores them too
        if len(data) > MAX_MESSAGE_BYTES:
            await edge.outbox.send_bytes(msg.error(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}"))
            await edge.outbox.refuse(CLOSE_TOO_BIG, "too_large", f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
            return
        try:
            message = msg.parse(data, msg.ASR_IN)
        except msg.ProtocolError as exc:
            await _invalid(edge, str(exc))
            return
        if not await _handle(edge, manager, request, stream, message, received):
            return


async def _handle(edge: EdgeSession, manager: SessionManager, request: TranscriptionJob, stream: AsrStream, message,
                  received: float) -> bool:
    """One input message; False once the connection is closed."""
    if isinstance(message, msg.Marker):
        stream.add_marker(message.id)
    elif isinstance(message, msg.Init):
        await edge.outbox.send_bytes(msg.ready() if stream.fed == 0 else msg.error(
            "Init after audio is not supported (moshi-server resets the stream): open a new connection"))
    elif isinstance(message, msg.OggOpus):
        pcm = await _decode(edge, manager, message.data)
        if pcm is None:
            return False
        await _feed(edge, request, stream, pcm, received)
    else:
        await _feed(edge, request, stream, message.pcm, received)
    return True


async def _feed(edge: EdgeSession, request: TranscriptionJob, stream: AsrStream, pcm: np.ndarray, received: float) -> None:
    if not pcm.size:
        return
    try:
        request.feed(pcm, received)
    except SttInputError as exc:  # this chunk only: the stream goes on
        await edge.outbox.send_bytes(msg.error(str(exc)))
        return
    stream.fed += pcm.size


async def _decode(edge: EdgeSession, manager: SessionManager, data: bytes) -> np.ndarray | None:
    """Ogg-Opus bytes -> 24 kHz PCM on this connection's codec stream (opened at its first use);
    None once the connection is closed for bytes that are not Ogg-Opus or a lost codec."""
    try:
        if edge.codec is None:
            edge.codec = manager.codec.open()
        return await edge.codec.decode(data)
    except OpusError as exc:
        await _invalid(edge, f"OggOpus.data is not an Ogg-Opus stream: {exc}")
    except CodecUnavailable as exc:
        edge.counters.codec_failure()
        await edge.outbox.send_bytes(msg.error(f"audio codec unavailable: {exc}"))
        await edge.outbox.close_socket(CLOSE_INTERNAL, f"audio codec unavailable: {exc}")
    return None


async def _invalid(edge: EdgeSession, reason: str) -> None:
    edge.counters.protocol_error()
    await edge.outbox.send_bytes(msg.error(reason))
    await edge.outbox.close_socket(CLOSE_INVALID_PAYLOAD, reason)
