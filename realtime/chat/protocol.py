"""`/api/chat`: the Moshi / PersonaPlex binary WebSocket protocol, which Hibiki's reference server
(`hibiki-zero serve`) and web client speak too: on a Hibiki server the same door translates.

Every message is binary; byte 0 is a tag:
    0x00 handshake  server -> client, once, after the session is prefilled
    0x01 audio      both ways: Ogg pages of Opus, 24 kHz mono (any page size in)
    0x02 text       server -> client: UTF-8 piece of the agent's inner monologue
    0x07 user text  server -> client, with `?transcript=1`: UTF-8 piece of what the *user* said,
                    as the paired STT row transcribes it (Parley's extension; clients ignore it)
    0x05 error      server -> client: UTF-8 message (sent before close 1001 when the server goes away)
    other tags      ignored (0x03 control .. 0x06 ping are not needed for full duplex)
Text frames are not part of the protocol: they are ignored (but count against the rate limits).
A session ends when its client closes the socket: Hibiki's too (its reference server ends a
translation no other way; the end of a source is /v1/realtime/translations' `session.close`).

Query parameters: `text_prompt` (persona), `voice_prompt` (voice file name), and the
Moshi web client's sampling parameters (`text_temperature`, `text_topk`,
`audio_temperature`, `audio_topk`, `seed` / `text_seed` / `audio_seed`). `pad_mult`,
`repetition_penalty` and `repetition_penalty_context` are accepted at their neutral values
only (what the web client sends by default); other values close 1008. Parameters with no
effect on the session (`worker_auth_id`, `email`, anything unknown) are listed in
docs/protocols.md. On a model without persona / voice prompts (Moshi), a non-empty
`text_prompt` or any `voice_prompt` closes 1008 instead of being dropped.

Refusals before the upgrade (sessions/capacity.py): HTTP 503 + Retry-After when every slot is taken
or the server is draining. Closes: 1013 when the last slot went between upgrade and admission, 1008 for options the model cannot serve, 1007 for
bytes that are not Ogg-Opus, 1009 for a message over `MAX_MESSAGE_BYTES`, 1011 when the
engine fails the session or its codec worker is lost, 1008 for a client over its message or
byte rate (sessions/limits.py). Each affects only its own connection; each refusal and refusing close
is logged once and counted (sessions/refusals.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Mapping

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..engine_client import (
    FrameOut, OptionsError, OptionsRejected, SamplingOptions, SessionClosed, SessionFull, SessionOptions, Status,
    Terminal,
)
from ..http.models import deny_unserved_model
from ..media.opus import CodecUnavailable, OpusError
from ..server.security import choose_subprotocol
from ..sessions.session import (
    CLOSE_INTERNAL, CLOSE_INVALID_PAYLOAD, CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TOO_BIG,
    CLOSE_TRY_AGAIN_LATER, EdgeSession, SessionManager,
)
from ..server.state import app_state

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
    "text_seed": ("text_seed", int),
    "audio_seed": ("audio_seed", int),
}
SEED_PARAM = "seed"  # both seeds at once; text_seed / audio_seed override it
# Features Parley's sampler does not have, accepted only at the value that means "off".
NEUTRAL_PARAMS = {"pad_mult": 0.0, "repetition_penalty": 1.0}
# repetition_penalty_context means nothing while the penalty is off: any value is accepted.


def options_from_query(query: Mapping[str, str], defaults: SessionOptions) -> SessionOptions:
    """The session a client asks for; raises OptionsError with a sentence naming the parameter."""
    given: list[tuple[str, str, float | int]] = []  # (query parameter, SamplingOptions field, value)
    if query.get(SEED_PARAM):
        seed = _number(SEED_PARAM, query[SEED_PARAM], int)
        given += [(SEED_PARAM, "text_seed", seed), (SEED_PARAM, "audio_seed", seed)]
    for param, (field_name, parse) in SAMPLING_PARAMS.items():
        raw = query.get(param)
        if raw is None or raw == "":
            continue
        given.append((param, field_name, _number(param, raw, parse)))
    for param, neutral in NEUTRAL_PARAMS.items():
        raw = query.get(param)
        if raw and _number(param, raw, float) != neutral:
            raise OptionsError(f"query parameter {param}={raw[:40]} is not supported: Parley's sampler has no "
                               f"{param.replace('_', ' ')}; leave it out or send {neutral:g}.")
    sampling = defaults.sampling
    for param, field_name, value in given:  # on top of the server's defaults (the engine's when it has none)
        try:  # one at a time, so a range error names its parameter
            sampling = dataclasses.replace(sampling or SamplingOptions(), **{field_name: value})
        except OptionsError as exc:
            raise OptionsError(f"query parameter {param}: {exc}") from None
    persona = query.get("text_prompt")
    voice = query.get("voice_prompt") or None
    return SessionOptions(persona=defaults.persona if persona is None else persona,
                          voice=voice if voice is not None else defaults.voice,
                          sampling=sampling)


def _number(param: str, raw: str, parse: type) -> float | int:
    if parse is int:
        try:
            return int(raw)  # exact, however large: a 64-bit seed does not survive a float (range: SamplingOptions)
        except ValueError:
            pass
    try:
        value = float(raw)
    except ValueError:
        raise OptionsError(f"query parameter {param} must be a number, got {raw[:40]!r}.") from None
    if parse is int:
        if not value.is_integer():
            raise OptionsError(f"query parameter {param} must be a whole number, got {raw[:40]!r}.")
        return int(value)
    return value


async def chat_endpoint(websocket: WebSocket) -> None:
    """Keys and Origins are checked before this runs (security.AccessMiddleware)."""
    manager: SessionManager = app_state(websocket).sessions
    # ?model=, if given (server/served_models.py): the duplex model's names, a Hibiki's on a translating server
    modality = "translation" if app_state(websocket).translator is not None else "duplex"
    if await deny_unserved_model(websocket, modality):
        return
    reservation = await manager.admission.reserve_or_deny(websocket)
    if reservation is None:
        return
    edge = manager.attach(websocket, PROTOCOL, reservation)
    edge.notice = lambda reason: edge.outbox.send_bytes(bytes([TAG_ERROR]) + reason.encode())
    try:
        await websocket.accept(subprotocol=choose_subprotocol(websocket.scope.get("subprotocols", [])))
        await _serve(edge, manager)
    except (WebSocketDisconnect, OSError):  # e.g. gone before the handshake byte: nothing to report
        log.info("chat session %d: the client left", edge.number)
    finally:
        edge.close()


async def _serve(edge: EdgeSession, manager: SessionManager) -> None:
    websocket = edge.websocket
    try:
        options = options_from_query(websocket.query_params, manager.defaults.options)
        await edge.slot.open(options)
    except SessionFull as exc:
        await edge.outbox.refuse(CLOSE_TRY_AGAIN_LATER, "full", f"server full: {exc}")
        return
    except (OptionsError, OptionsRejected) as exc:
        edge.counters.protocol_error()
        await edge.outbox.refuse(CLOSE_POLICY, "options", str(exc))
        return
    except SessionClosed as exc:
        await edge.outbox.refuse(CLOSE_INTERNAL, "unavailable", f"engine unavailable: {exc}")
        return

    transcript = None
    if websocket.query_params.get("transcript", "0") not in ("0", "", "false"):
        try:
            transcript = edge.slot.transcription()
        except OptionsError as exc:
            edge.counters.protocol_error()
            await edge.outbox.refuse(CLOSE_POLICY, "options", f"transcript=1: {exc}")
            return

    try:
        edge.codec = manager.codec.open()  # pinned to one codec worker for the connection's life
    except CodecUnavailable as exc:
        await edge.outbox.refuse(CLOSE_INTERNAL, "codec", f"audio codec unavailable: {exc}")
        return
    log.info("chat session %d open (persona %d chars, voice %s)", edge.number, len(options.persona), options.voice)
    await edge.outbox.send_bytes(HANDSHAKE)
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
    websocket = edge.websocket
    assert edge.codec is not None and edge.slot.session is not None
    while True:
        message = await websocket.receive()
        received = time.monotonic()  # before the Opus decode: transcript delay counts from here
        if message["type"] == "websocket.disconnect":
            return
        data = message.get("bytes")
        if data is None:  # a text frame: not part of this protocol, ignored (the docs say so)
            if not await edge.outbox.admit_message(len(message.get("text") or "")):
                return
            continue
        if not await edge.outbox.admit_message(len(data)):
            return
        if len(data) > MAX_MESSAGE_BYTES:
            edge.counters.protocol_error()
            await edge.outbox.refuse(CLOSE_TOO_BIG, "too_large",
                                     f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
            return
        if not data or data[0] != TAG_AUDIO:
            continue  # unknown or server-only tags are ignored
        try:
            pcm = await edge.codec.decode(data[1:])
        except OpusError as exc:
            edge.counters.protocol_error()
            await edge.outbox.close_socket(CLOSE_INVALID_PAYLOAD, str(exc))
            return
        except CodecUnavailable as exc:
            await _codec_lost(edge, exc)
            return
        if pcm.size:
            edge.slot.session.push_audio(pcm, received)


async def _send_frames(edge: EdgeSession) -> None:
    """Engine -> client: every frame leaves as soon as it is encoded (one message per page,
    no batching), text right after its frame's audio."""
    session = edge.slot.session
    assert session is not None and edge.codec is not None
    async for event in session.events:
        if isinstance(event, Terminal):
            if event.status is Status.FAILED:
                await edge.outbox.close_socket(CLOSE_INTERNAL, f"session failed: {event.reason}")
            elif event.status is Status.COMPLETED:
                await edge.outbox.close_socket(CLOSE_NORMAL, event.reason)
            return
        assert isinstance(event, FrameOut)
        start = time.perf_counter()
        lagging = edge.outbox.drop_if_lagging(event.produced_at)  # the client is behind: skip this (oldest) audio
        try:
            page = b"" if lagging else await edge.codec.encode(event.pcm)
        except CodecUnavailable as exc:
            await _codec_lost(edge, exc)
            return
        try:
            if page:
                await edge.outbox.send_bytes(bytes([TAG_AUDIO]) + page)
            if event.text:  # the text goes out even when the audio was dropped: it is tiny
                await edge.outbox.send_bytes(bytes([TAG_TEXT]) + event.text.encode())
        except (WebSocketDisconnect, RuntimeError, OSError):
            return  # the client left; the receive side sees the disconnect
        if lagging:
            continue
        edge.outbox.lag.sent(len(page) + 1 if page else 0)  # a frame's audio may finish a page only later
        edge.counters.frame_handled(time.perf_counter() - start)
        edge.counters.frame_sent(event.produced_at)


async def _send_user_text(edge: EdgeSession, transcript) -> None:
    """Paired transcript -> client: each new piece of the user's words as a 0x07 message."""
    async for event in transcript:
        if isinstance(event, Terminal):
            return
        if event.text:
            try:
                await edge.outbox.send_bytes(bytes([TAG_USER_TEXT]) + event.text.encode())
            except (WebSocketDisconnect, RuntimeError, OSError):
                return
            edge.counters.transcript_sent("paired", event.input_at)


async def _codec_lost(edge: EdgeSession, exc: CodecUnavailable) -> None:
    """This connection's Ogg streams are gone (worker crash / hang / shutdown): end it clearly."""
    if edge.closed:
        return
    edge.counters.codec_failure()
    log.warning("chat session %d: %s", edge.number, exc)
    await edge.outbox.close_socket(CLOSE_INTERNAL, f"audio codec lost: {exc}")
