"""A connection's engine session on both OpenAI doors: opened (a full server or a stopped engine
told as an `error`, then the connection refused) and re-prefilled (the slot handed over by
`Slot.reopen`; a slot lost meanwhile told, then the connection closed).
"""

from __future__ import annotations

from ..engine_client import OptionsError, OptionsRejected, SessionClosed, SessionFull, SessionOptions
from ..sessions.session import CLOSE_INTERNAL, CLOSE_TRY_AGAIN_LATER
from .event_channel import EventChannel, SessionLost


async def open_or_refuse(channel: EventChannel, options: SessionOptions) -> bool:
    """Open the connection's engine session; False if the server is full or the engine is down
    (the client told, the connection refused). OptionsError and OptionsRejected (settings the
    model will not take) are the caller's."""
    edge = channel.edge
    try:
        await edge.slot.open(options)
    except SessionFull as exc:
        await channel.server_error(f"server full: {exc}", "session_limit_reached")
        await edge.outbox.refuse(CLOSE_TRY_AGAIN_LATER, "full", "server full: every session slot is taken")
        return False
    except SessionClosed as exc:
        await channel.server_error(f"cannot start the session: {exc}", "session_failed")
        await edge.outbox.refuse(CLOSE_INTERNAL, "unavailable", str(exc))
        return False
    return True


async def open_once(channel: EventChannel, options: SessionOptions) -> bool:
    """`open_or_refuse` for a door whose session cannot start again with other settings: options
    the model will not take are told too, then the connection refused."""
    try:
        return await open_or_refuse(channel, options)
    except (OptionsError, OptionsRejected) as exc:
        await channel.server_error(f"cannot start the session: {exc}", "session_failed")
        await channel.edge.outbox.refuse(CLOSE_INTERNAL, "options", str(exc))
        return False


async def reopen_or_lose(channel: EventChannel, options: SessionOptions) -> None:
    """Re-prefill with `options`. OptionsRejected (the previous session is back) is the caller's;
    a slot lost meanwhile is told, the connection closed, and SessionLost raised."""
    try:
        await channel.edge.slot.reopen(options)
    except (SessionFull, SessionClosed) as exc:
        await channel.server_error(f"lost the session slot while re-prefilling: {exc}", "session_failed")
        await channel.edge.outbox.close_socket(CLOSE_TRY_AGAIN_LATER, "session slot lost while re-prefilling")
        raise SessionLost(str(exc)) from exc
