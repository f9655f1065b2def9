"""Realtime's sideband: `/v1/realtime?call_id=...` (the openai SDK's `client.realtime.connect(call_id=...)`)
joins a WebRTC call (`POST /v1/realtime/calls` answered its id in `Location`).

The attach itself (the registry, the key, the bound, fan-out and control) is calls/sideband.py's;
this module says what is Realtime's:
- what a sideband may not send (REFUSED): audio, which stays with the call (`input_audio_buffer.append`,
  and `conversation.item.create`, whose only items here are user audio); every other client event
  is the call's own handler's (`session.update`, `response.create` / `.cancel`, buffer commits
  and clears, item retrieve / truncate / delete);
- the URL names the call and nothing else: `model` or `intent` with `call_id` is refused (400),
  the call's session already has its model;
- when the call ends a sideband is closed normally (1000): the Realtime API has no closing event.
"""

from __future__ import annotations

from starlette.websockets import WebSocket

from .connection import REALTIME_SUBPROTOCOL, RealtimeConnection
from ..calls.sideband import AttachedCall, attach, refuse
from ..sessions.capacity import deny_upgrade

AUDIO_STAYS = "audio stays with the call (its media track); a sideband sends control events"
REFUSED = {
    "input_audio_buffer.append": AUDIO_STAYS,
    "conversation.item.create": f"items here are user audio, and {AUDIO_STAYS}",
}


def attached_realtime_call(call_id: str, connection: RealtimeConnection, key: str | None) -> AttachedCall:
    """What a sideband of this Realtime call reaches."""
    return AttachedCall(call_id, "openai", connection.channel, key, REFUSED, lambda: None)


async def realtime_attach(websocket: WebSocket) -> None:
    """`/v1/realtime` with `?call_id=`; keys and Origins are checked before this runs."""
    extra = sorted(set(websocket.query_params) & {"model", "intent"})
    if extra:
        await deny_upgrade(websocket, refuse(400, f"{extra[0]}: call_id joins an existing call, whose session "
                                                  f"already has its {extra[0]}; leave it out", "invalid_value",
                                             extra[0]), "call_id with another setting")
        return
    await attach(websocket, websocket.query_params["call_id"], "call_id", REALTIME_SUBPROTOCOL)
