"""One connection's way out: the single writer, its lag, its rate limits.

Rules this module keeps:
1. Single writer: every send and the close take one lock, so the frame sender and the receive
   loop's replies never interleave bytes of two messages on the transport.
2. Lag: a frame that would reach the client more than the lag limit late is dropped (the oldest
   unsent audio), counted, rather than queued behind stale audio (sessions/limits.py LagMeter).
3. Rate limits: each received message is counted against the connection's limits; one over them
   closes the connection (1008) with a refusal, logged and counted once. A flooding connection
   never holds the event loop for more than one message (`admit_message` yields once per message).
4. Closing never raises: a transport already closed is left alone.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from ..calls.transport import Transport
from ..engine_client import TICK_SECONDS
from .counters import Counters
from .limits import EdgeLimits, LagMeter, RateLimiter

# WebSocket close codes (RFC 6455 and the IANA registry).
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_INVALID_PAYLOAD = 1007
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL = 1011
CLOSE_TRY_AGAIN_LATER = 1013
MAX_CLOSE_REASON_BYTES = 123  # a close frame's reason is at most 123 bytes of UTF-8


def close_reason(text: str) -> str:
    """Trim a reason to what a close frame can carry, without splitting a UTF-8 character."""
    data = text.encode()[:MAX_CLOSE_REASON_BYTES]
    return data.decode(errors="ignore")


class Outbox:
    """Sending on one connection's transport (rules 1-4)."""

    def __init__(self, transport: Transport, limits: EdgeLimits, counters: Counters) -> None:
        self.transport = transport
        self._counters = counters
        self._send_lock = asyncio.Lock()
        self._rate = RateLimiter(limits)
        self.lag = LagMeter(limits.max_lag_s, TICK_SECONDS, lambda: transport.backlog() or 0)

    async def send_bytes(self, data: bytes) -> None:
        async with self._send_lock:
            await self.transport.send_bytes(data)
        self._counters.bytes_out(len(data))

    async def send_text(self, data: str) -> None:
        async with self._send_lock:
            await self.transport.send_text(data)
        self._counters.bytes_out(len(data))

    async def admit_message(self, n_bytes: int) -> bool:
        """Count one received message against the rate limits (rule 3). False: it was over, and
        the connection is closed (1008)."""
        self._counters.bytes_in(n_bytes)
        why = self._rate.admit(n_bytes)
        if why is not None:
            self._counters.rate_limited()
            await self.refuse(CLOSE_POLICY, "rate_limit", f"rate limit: {why}")
            return False
        await asyncio.sleep(0)
        return True

    def drop_if_lagging(self, produced_at: float) -> bool:
        """True when this frame (FrameOut.produced_at) would reach the client more than the lag
        limit late: the caller drops its audio, counted (rule 2)."""
        if not self.lag.should_drop(produced_at):
            return False
        self._counters.lag_dropped()
        return True

    def play(self, pcm) -> None:
        """A WebRTC call's output audio: onto its track, whose queue is bounded by the lag limit
        (the oldest audio dropped past it, counted as a slow WebSocket client's frames are)."""
        dropped = self.transport.media.play(pcm)
        if dropped:
            self._counters.lag_dropped(dropped)

    async def refuse(self, code: int, reason: str, message: str) -> None:
        """Close for a refusal: logged and counted once (sessions/refusals.py), then `code` with
        `message` as the close reason. `reason`: a refusals.REASONS code."""
        self._counters.refusal(self.transport.scope, reason, message)
        await self.close_socket(code, message)

    async def close_socket(self, code: int, reason: str = "") -> None:
        """Close the transport if it is still open: a close frame, or a WebRTC hang-up (rule 4)."""
        if not self.transport.open:
            return
        async with self._send_lock:
            await self.transport.close(code, close_reason(reason))

    async def going_away(self, reason: str, notice: Callable[[str], Awaitable[None]] | None) -> None:
        """The protocol's notice (if it has one and the transport is open), then close 1001."""
        if notice is not None and self.transport.open:
            try:
                await notice(reason)
            except Exception:  # the client left meanwhile: the close below is all that is left
                pass
        await self.close_socket(CLOSE_GOING_AWAY, reason)
