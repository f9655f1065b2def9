"""`/api/chat`: the Moshi / PersonaPlex binary WebSocket protocol.

Every message is binary; byte 0 is a tag:
    0x00 handshake  server -> client, once, after the session is prefilled
    0x01 audio      both ways: Ogg pages of Opus, 24 kHz mono (any page size in)
    0x02 text       server -> client: UTF-8 piece of the agent's inner monologue
    0x07 user text  server -> client, with `?transcript=1`: UTF-8 piece of what the *user* said,
                    as the paired STT row transcribes it (Parley's extension; clients ignore it)
    0x05 error      server -> client: UTF-8 message (sent before close 1001 when the server goes away)
    other tags      ignored (0x03 control .. 0x06 ping are not needed for full duplex)

Query parameters: `text_prompt` (persona), `voice_prompt` (voice file name), and the
Moshi web client's sampling parameters (`text_temperature`, `text_topk`,
`audio_temperature`, `audio_topk`; `pad_mult`, `text_seed`, `audio_seed`,
`repetition_penalty_context`, `repetition_penalty` are accepted and ignored).

Refusals before the upgrade (capacity.py): HTTP 503 + Retry-After when every slot is taken
or the server is draining. Closes: 1013 when the last slot went between upgrade and admission, 1008 for options the model cannot serve, 1007 for
bytes that are not Ogg-Opus, 1009 for a message over `MAX_MESSAGE_BYTES`, 1011 when the
engine fails the session or its codec worker is lost. Each affects only its own connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Mapping

from starlette.websockets import WebSocket, WebSocketDisconnect

from parley.engine import (
    EngineClosed, EngineFull, FrameOut, OptionsError, SamplingOptions, SessionOptions, SessionRejected, Status, Terminal,
)

from .opus import CodecUnavailable, OpusError
from .sessions import (
    CLOSE_INTERNAL, CLOSE_INVALID_PAYLOAD, CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG,
    CLOSE_TRY_AGAIN_LATER, EdgeSession, SessionManager, now,
)

log = logging.getLogger("parley.moshi")

PROTOCOL = "moshi"
TAG_HANDSHAKE = 0x00
TAG_AUDIO = 0x01
TAG_TEXT = 0x02
TAG_USER_TEXT = 0x07
TAG_ERROR = 0x05
HANDSHAKE = bytes([TAG_HANDSHAKE])  # what the Python reference servers send
# An Ogg page is at most ~64 KiB; a client may batch a few pages in one message.
MAX_MESSAGE_BYTES = 256 * 1024

# Query parameter -> SamplingOptions field, with the parser for its value.
SAMPLING_PARAMS = {
    "text_temperature": ("text_temperature", float),
    "text_topk": ("text_top_k", int),
    "audio_temperature": ("audio_temperature", float),
    "audio_topk": ("audio_top_k", int),
}
# Other parameters the Moshi web client sends (pad_mult, text_seed, audio_seed,
# repetition_penalty_context, repetition_penalty, worker_auth_id, email) are accepted and ignored.


def options_from_query(query: Mapping[str, str], defaults: SessionOptions) -> SessionOptions:
    """The session a client asks for; raises OptionsError with a sentence naming the parameter."""
    sampling_kwargs: dict[str, float | int] = {}
    for param, (field_name, parse) in SAMPLING_PARAMS.items():
        raw = query.get(param)
        if raw is None or raw == "":
            continue
        try:
            value = float(raw)
        except ValueError:
            raise OptionsError(f"query parameter {param} must be a number, got {raw!r}.") from None
        if parse is int:
            if not value.is_integer():
                raise OptionsError(f"query parameter {param} must be a whole number, got {raw!r}.")
            value = int(value)
        sampling_kwargs[field_name] = value
    sampling = defaults.sampling
    if sampling_kwargs:  # on top of the server's defaults (the engine's when it has none)
        sampling = dataclasses.replace(sampling or SamplingOptions(), **sampling_kwargs)  # validates again
    persona = query.get("text_prompt")
    voice = query.get("voice_prompt") or None
    return SessionOptions(persona=defaults.persona if persona is None else persona,
                          voice=voice if voice is not None else defaults.voice,
                          sampling=sampling)


async def chat_endpoint(websocket: WebSocket) -> None:
    manager: SessionManager = websocket.app.state.sessions
    reservation = await manager.admission.reserve_or_deny(websocket)
    if reservation is None:
        return
    edge = manager.attach(websocket, PROTOCOL, reservation)
    edge.notice = lambda reason: edge.send_bytes(bytes([TAG_ERROR]) + reason.encode())
    try:
        await websocket.accept()
        await _serve(edge, manager)
    finally:
        edge.close()


async def _serve(edge: EdgeSession, manager: SessionManager) -> None:
    websocket = edge.websocket
    try:
        options = options_from_query(websocket.query_params, manager.defaults.options)
        await edge.open_engine_session(options)
    except EngineFull as exc:
        await edge.close_socket(CLOSE_TRY_AGAIN_LATER, f"server full: {exc}")
        return
    except (OptionsError, SessionRejected) as exc:
        manager.metrics.protocol_errors.labels(PROTOCOL).inc()
        await edge.close_socket(CLOSE_POLICY, str(exc))
        return
    except EngineClosed as exc:
        await edge.close_socket(CLOSE_INTERNAL, f"engine unavailable: {exc}")
        return

    transcript = None
    if websocket.query_params.get("transcript", "0") not in ("0", "", "false"):
        try:
            transcript = manager.engine.enable_transcription(edge.engine_session)
        except OptionsError as exc:
            manager.metrics.protocol_errors.labels(PROTOCOL).inc()
            await edge.close_socket(CLOSE_POLICY, f"transcript=1: {exc}")
            return

    try:
        edge.codec = manager.codec.open()  # pinned to one codec worker for the connection's life
    except CodecUnavailable as exc:
        await edge.close_socket(CLOSE_INTERNAL, f"audio codec unavailable: {exc}")
        return
    log.info("chat session %d open (persona %d chars, voice %s)", edge.number, len(options.persona), options.voice)
    await edge.send_bytes(HANDSHAKE)
    user_text = asyncio.create_task(_send_user_text(edge, transcript)) if transcript is not None else None
    try:
        await edge.run_duplex(_send_frames(edge), _receive(edge))
    finally:
        if user_text is not None:
            user_text.cancel()
            await asyncio.gather(user_text, return_exceptions=True)
    log.info("chat session %d closed", edge.number)


async def _receive(edge: EdgeSession) -> None:
    """Client -> engine: tags, Ogg bytes -> PCM -> push_audio. Returns when the client leaves
    or after closing the socket for bad input."""
    websocket, manager = edge.websocket, edge.manager
    assert edge.codec is not None and edge.engine_session is not None
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
        data = message.get("bytes")
        if data is None:  # a text frame: not part of this protocol
            data = (message.get("text") or "").encode()
            if not data:
                continue
        edge.count_in(len(data))
        if len(data) > MAX_MESSAGE_BYTES:
            manager.metrics.protocol_errors.labels(PROTOCOL).inc()
            await edge.close_socket(CLOSE_TOO_BIG, f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
            return
        if not data or data[0] != TAG_AUDIO:
            continue  # unknown or server-only tags are ignored
        try:
            pcm = await edge.codec.decode(data[1:])
        except OpusError as exc:
            manager.metrics.protocol_errors.labels(PROTOCOL).inc()
            await edge.close_socket(CLOSE_INVALID_PAYLOAD, str(exc))
            return
        except CodecUnavailable as exc:
            await _codec_lost(edge, exc)
            return
        if pcm.size:
            edge.engine_session.push_audio(pcm)


async def _send_frames(edge: EdgeSession) -> None:
    """Engine -> client: every frame leaves as soon as it is encoded (one message per page,
    no batching), text right after its frame's audio."""
    manager = edge.manager
    session = edge.engine_session
    assert session is not None and edge.codec is not None
    async for event in session.events:
        if isinstance(event, Terminal):
            if event.status is Status.FAILED:
                await edge.close_socket(CLOSE_INTERNAL, f"session failed: {event.reason}")
            elif event.status is Status.COMPLETED:
                await edge.close_socket(CLOSE_NORMAL, event.reason)
            return
        assert isinstance(event, FrameOut)
        start = now()
        try:
            page = await edge.codec.encode(event.pcm)
        except CodecUnavailable as exc:
            await _codec_lost(edge, exc)
            return
        try:
            if page:
                await edge.send_bytes(bytes([TAG_AUDIO]) + page)
            if event.text:
                await edge.send_bytes(bytes([TAG_TEXT]) + event.text.encode())
        except (WebSocketDisconnect, RuntimeError, OSError):
            return  # the client left; the receive side sees the disconnect
        manager.metrics.frames_out.labels(PROTOCOL).inc()
        edge.observe_frame_delay(now() - start)
        edge.observe_frame_sent(event.produced_at)


async def _send_user_text(edge: EdgeSession, transcript) -> None:
    """Paired transcript -> client: each new piece of the user's words as a 0x07 message."""
    async for event in transcript:
        if isinstance(event, Terminal):
            return
        if event.text:
            try:
                await edge.send_bytes(bytes([TAG_USER_TEXT]) + event.text.encode())
            except (WebSocketDisconnect, RuntimeError, OSError):
                return


async def _codec_lost(edge: EdgeSession, exc: CodecUnavailable) -> None:
    """This connection's Ogg streams are gone (worker crash / hang / shutdown): end it clearly."""
    if edge.closed:
        return
    edge.manager.metrics.codec_failures.labels(PROTOCOL).inc()
    log.warning("chat session %d: %s", edge.number, exc)
    await edge.close_socket(CLOSE_INTERNAL, f"audio codec lost: {exc}")
