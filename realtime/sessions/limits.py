"""Per-connection limits, so no client can starve the others or grow the server's memory.

- `RateLimiter`: two token buckets per connection (messages and bytes), refilled at the
  configured rate and holding `BURST_SECONDS` of it. A client past either is closed (1008).
- `send_backlog` + `LagMeter`: how far a session's output is behind: the age of the next
  frame to send (time it waited in the engine's queue and the edge) plus the bytes queued for
  the client (the transport's write buffer and the kernel's unsent queue), converted to
  seconds of audio with the session's own bytes per frame. Past the limit, the oldest unsent
  frames are dropped (counted) until the client catches up. Bytes the client's own kernel
  has already acknowledged are out of the server's sight (a fixed receive window).
- `parse_json_event`: size and nesting-depth limits for realtime events (`JSONLimitError`).
- `ConversationBudget`: the bytes a realtime session's conversation items hold, bounded.

Everything here is pure bookkeeping on the event loop; defaults are far above any honest
client (docs/reliability.md has the figures).
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import termios
import time
from dataclasses import dataclass
from typing import Any, Callable

BURST_SECONDS = 2.0  # a bucket holds this many seconds of its rate: bursts pass, floods do not
# The WebSocket transport's hard cap on one message (uvicorn's ws_max_size: close 1009; server/serve.py).
WS_MAX_SIZE = 16 * 1024 * 1024


@dataclass(frozen=True)
class EdgeLimits:
    """What `parley serve` enforces per connection (flags in cli.py, figures in docs/reliability.md)."""

    max_messages_per_s: float = 500.0  # honest clients: 12.5/s (/api/chat), ~50/s (20 ms realtime appends)
    max_bytes_per_s: float = 8 * 1024 * 1024  # honest: ~8 KB/s Opus, ~64 KB/s base64 PCM16
    max_lag_s: float = 1.0  # output allowed to queue for a client before its oldest frames are dropped
    max_event_bytes: int = 8 * 1024 * 1024  # one realtime event
    max_json_depth: int = 32  # realtime events nest 4-5 levels
    max_conversation_bytes: int = 16 * 1024 * 1024  # a realtime session's stored items
    max_sidebands: int = 4  # connections attached to one call (calls/sideband.py); 0: none may attach

    def __post_init__(self) -> None:
        for name in ("max_messages_per_s", "max_bytes_per_s", "max_lag_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or value == float("inf"):
                raise ValueError(f"{name} must be a positive number, got {value!r}.")
        for name in ("max_event_bytes", "max_json_depth", "max_conversation_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}.")
        if isinstance(self.max_sidebands, bool) or not isinstance(self.max_sidebands, int) or self.max_sidebands < 0:
            raise ValueError(f"max_sidebands must be a whole number of at least 0, got {self.max_sidebands!r}.")


class _Bucket:
    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.capacity = rate * BURST_SECONDS
        self.tokens = self.capacity
        self.at = now

    def take(self, n: float, now: float) -> bool:
        self.tokens = min(self.capacity, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if n > self.tokens:
            return False
        self.tokens -= n
        return True


class RateLimiter:
    """Messages and bytes one connection may send; `admit` says why not, or None."""

    def __init__(self, limits: EdgeLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        now = clock()
        self._messages = _Bucket(limits.max_messages_per_s, now)
        # At least one largest event fits in a burst, so a legal event is never refused for its size.
        self._bytes = _Bucket(max(limits.max_bytes_per_s, limits.max_event_bytes / BURST_SECONDS), now)

    def admit(self, n_bytes: int) -> str | None:
        now = self._clock()
        if not self._messages.take(1, now):
            return f"message rate over {self._messages.rate:g}/s"
        if not self._bytes.take(n_bytes, now):
            return f"byte rate over {self._bytes.rate:g} B/s"
        return None


# ---- output lag ----

def _kernel_unsent(sock: Any) -> int:
    """Bytes the kernel still holds for this socket (Linux TIOCOUTQ); 0 where unknown."""
    try:
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return 0
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError, AttributeError):
        return 0


def send_backlog(transport: Any) -> int:
    """Bytes written for a peer and not yet on the wire: the transport's buffer and the kernel's."""
    if transport is None or transport.is_closing():
        return 0
    return transport.get_write_buffer_size() + _kernel_unsent(transport.get_extra_info("socket"))


class LagMeter:
    """Seconds of output queued for one client, from its backlog and its own bytes per frame."""

    def __init__(self, max_lag_s: float, frame_seconds: float, backlog: Callable[[], int] | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._max_lag_s = max_lag_s
        self._frame_seconds = frame_seconds
        self._backlog = backlog
        self._bytes = 0  # output bytes of the frames sent so far
        self._frames = 0
        self.dropped = 0

    def sent(self, n_bytes: int) -> None:
        self._bytes += n_bytes
        self._frames += 1

    def backlog_seconds(self) -> float:
        if self._backlog is None or self._frames == 0 or self._bytes == 0:
            return 0.0
        return self._backlog() / (self._bytes / self._frames) * self._frame_seconds

    def should_drop(self, produced_at: float) -> bool:
        """True (and counted) when a frame produced at `produced_at` (the clock's time) would
        reach the client more than the limit late."""
        age = max(0.0, self._clock() - produced_at)
        if age + self.backlog_seconds() <= self._max_lag_s:
            return False
        self.dropped += 1
        return True


# ---- realtime events ----

class JSONLimitError(ValueError):
    """An event over the size or depth limit; `code` is the error event's code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def parse_json_event(raw: str, limits: EdgeLimits) -> Any:
    """json.loads with limits: size first (before any parsing), then nesting depth."""
    if len(raw) > limits.max_event_bytes:
        raise JSONLimitError(f"event of {len(raw)} bytes exceeds the {limits.max_event_bytes}-byte limit",
                             "message_too_large")
    try:
        value = json.loads(raw)
    except RecursionError:
        value = None
        deep = True
    else:
        deep = _depth_over(value, limits.max_json_depth)
    if deep:
        raise JSONLimitError(f"event nests deeper than {limits.max_json_depth} levels", "invalid_json")
    return value


def _depth_over(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


class ConversationBudget:
    """Bytes held by a realtime session's items (their JSON size), against a fixed budget."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._sizes: dict[str, int] = {}
        self.used = 0

    @staticmethod
    def size_of(item: dict) -> int:
        return len(json.dumps(item, separators=(",", ":")))

    def fits(self, item_id: str, size: int) -> bool:
        return self.used - self._sizes.get(item_id, 0) + size <= self.max_bytes

    def set(self, item_id: str, size: int) -> None:
        self.used += size - self._sizes.get(item_id, 0)
        self._sizes[item_id] = size

    def discard(self, item_id: str) -> None:
        self.used -= self._sizes.pop(item_id, 0)
