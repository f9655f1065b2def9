"""`/v1/realtime`'s WebSocket route: admission, dialect, and which kind of session the connection is.

- A realtime conversation (the default): `RealtimeConnection` (realtime_api/connection.py), holding a
  duplex slot.
- `?model=`, if given, must be one of the session's modality's served names (server/served_models.py:
  the duplex model's, or the STT's for a transcription session): another is OpenAI's 404
  `model_not_found` before the upgrade. Left out, the session's label is the served name.
- A transcription session, asked for as OpenAI clients do, with `?intent=transcription` in the URL:
  `TranscriptionConnection` (realtime_api/transcription.py) on a standalone STT row. It needs no duplex
  slot, so it is admitted while the duplex slots are full (not while draining or unhealthy).
  Without an STT model the connection goes on as a realtime conversation and its first event
  after `session.created` is an `error` naming `intent`.
- `?call_id=`: a sideband joining a WebRTC call's session (realtime_api/attach.py), no session of its own.
"""

from __future__ import annotations

import logging

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..http.models import deny_unserved_model
from .events import Dialect
from .connection import BETA_SUBPROTOCOL, PROTOCOL, REALTIME_SUBPROTOCOL, RealtimeConnection
from .settings import NO_STT, ClientError
from .transcription import TranscriptionConnection
from .attach import realtime_attach
from ..server.security import choose_subprotocol
from ..server.state import app_state

log = logging.getLogger("parley.realtime")


def select_dialect(websocket: WebSocket) -> Dialect:
    beta = websocket.headers.get("openai-beta", "").replace(" ", "").lower()
    if "realtime=v1" in beta or BETA_SUBPROTOCOL in websocket.scope.get("subprotocols", []):
        return Dialect.BETA
    return Dialect.GA


async def realtime_endpoint(websocket: WebSocket) -> None:
    """Keys and Origins are checked before this runs (security.AccessMiddleware)."""
    if "call_id" in websocket.query_params:
        await realtime_attach(websocket)
        return
    state = app_state(websocket)
    manager, stt_model = state.sessions, state.stt_model
    intent = websocket.query_params.get("intent")
    transcription = intent == "transcription" and stt_model is not None
    modality = "stt" if transcription else "duplex"  # what `?model=` must name (server/served_models.py)
    if await deny_unserved_model(websocket, modality):
        return
    reservation = await manager.admission.reserve_or_deny(websocket, needs_slot=not transcription)
    if reservation is None:
        return
    edge = manager.attach(websocket, PROTOCOL, reservation)
    try:
        await websocket.accept(subprotocol=choose_subprotocol(websocket.scope.get("subprotocols", []),
                                                              REALTIME_SUBPROTOCOL))
        dialect = select_dialect(websocket)
        model = websocket.query_params.get("model")
        if transcription:
            connection: RealtimeConnection = TranscriptionConnection(edge, dialect, model or stt_model, state.client)
        else:
            refused = None
            if intent is not None:
                why = NO_STT if intent == "transcription" else "only 'transcription' may be asked for"
                refused = ClientError(f"intent={intent!r:.40}: {why}; this is a realtime conversation",
                                      "unsupported_parameter", "intent")
            connection = RealtimeConnection(edge, dialect, model or manager.defaults.model_name,
                                            served=state.models.of("duplex"),
                                            transcription_sessions=stt_model is not None, opening_error=refused)
        edge.notice = lambda reason: connection.send(connection.events.error(
            reason, "server_shutting_down", kind="server_error"))
        await connection.run()
    except (WebSocketDisconnect, OSError):
        log.info("realtime session %d: the client left", edge.number)
    finally:
        edge.close()
