"""GPT-Live's sideband: `/v1/live/sessions/{session_id}/attach` (the openai SDK's
`client.live.sideband.connect(session_id=...)`), onto a session a WebRTC call holds.

The attach itself (the registry, the key, the bound, fan-out and control) is calls/sideband.py's;
this module says what is GPT-Live's:
- what a sideband may not send (REFUSED): audio (`session.input_audio.append`; it stays with the
  call), and what the door refuses from anyone (audio fixtures, Decisions delegation, SIP's DTMF);
  every other client event is the call's own handler's (instructions, commentary and thinking
  appends, delegation answers, `response.*` for Responses delegation, mute, `session.update`,
  `session.close`);
- the last event a sideband gets when the call ends: `session.closed` (reason `remote_hangup`),
  unless the session sent its own;
- `?graceful_close=true|false`: the SDK's opt-in to the closing handshake when the session ends.
  Parley always closes that way (the parameter's own doc lets a server do so by default); any
  other value is refused (400).
"""

from __future__ import annotations

from starlette.websockets import WebSocket

from . import events as ev
from .session import REFUSED_EVENTS, LiveConnection
from ..calls.event_channel import EventChannel
from ..calls.sideband import AttachedCall, attach, refuse
from ..sessions.capacity import deny_upgrade

AUDIO_STAYS = "audio stays with the call (its media track); a sideband sends control events"
REFUSED = {
    "session.input_audio.append": AUDIO_STAYS,
    "session.start": "the session has started; a sideband attaches to it and never starts one",
    "transport.dtmf.send": "DTMF goes to SIP calls, which this server does not take",
    **REFUSED_EVENTS,
}


def attached_live_call(session_id: str, connection: LiveConnection, key: str | None) -> AttachedCall:
    """What a sideband of this GPT-Live call reaches."""

    def goodbye() -> dict | None:
        if connection.config is None:  # the session never started: nothing to close
            return None
        return ev.session_closed(connection.resource, "remote_hangup", connection.seconds)

    channel: EventChannel = connection.channel
    return AttachedCall(session_id, "live", channel, key, REFUSED, goodbye)


async def live_attach_endpoint(websocket: WebSocket) -> None:
    """Keys and Origins are checked before this runs (security.AccessMiddleware)."""
    graceful = websocket.query_params.get("graceful_close")
    if graceful not in (None, "true", "false"):
        await deny_upgrade(websocket, refuse(400, f"graceful_close must be true or false, not {graceful!r:.40}",
                                             "invalid_value", "graceful_close"), "bad graceful_close")
        return
    await attach(websocket, websocket.path_params["session_id"], "session_id")
