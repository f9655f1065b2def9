"""What a connection reads from and writes to: a WebSocket, or a WebRTC call (webrtc/transport.py).

The doors' connections (`/v1/realtime`'s RealtimeConnection, GPT-Live's LiveConnection, and
`/api/chat`) hold one `Transport` through their `EdgeSession` and never the socket itself, so one
session implementation serves both transports:

- `receive()` is the peer's next message (a JSON event's text, or bytes), None once it has left;
- `send_text` / `send_bytes` write one message (the EdgeSession's lock keeps them whole);
- `close(code, reason)` ends the connection (WebSocket close codes; a WebRTC call just hangs up);
- `media` is None where audio travels inside the events (base64 on a WebSocket); a WebRTC call's
  audio travels on its tracks instead: `Media.read()` is the peer's audio at the model's 24 kHz and
  `Media.play(pcm)` queues model audio for the outgoing track.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import numpy as np
from starlette.websockets import WebSocket, WebSocketState

# ASGI scope extension set by server/ws_protocol.py: a callable giving the bytes queued for the peer.
SEND_BACKLOG_EXTENSION = "parley.send_backlog"


@dataclass(frozen=True)
class IceServer:
    """A STUN or TURN server for WebRTC calls' ICE (`parley serve --ice-servers`)."""

    urls: str  # stun:host:port, turn:host:port?transport=udp, turns:host:port
    username: str | None = None
    credential: str | None = None

    def for_browser(self) -> dict:
        """The page's RTCPeerConnection takes the same servers (RTCIceServer's shape)."""
        out: dict = {"urls": self.urls}
        if self.username is not None:
            out.update(username=self.username, credential=self.credential)
        return out


def parse_ice_servers(text: str | None, username: str | None = None,
                      credential: str | None = None) -> tuple[IceServer, ...]:
    """`--ice-servers`: comma-separated stun:/turn:/turns: URLs; the TURN ones take `username` and
    `credential` (`--turn-username`, `--turn-credential-file`). ValueError names a bad one."""
    servers = []
    for url in (u.strip() for u in (text or "").split(",")):
        if not url:
            continue
        scheme = url.split(":", 1)[0].lower()
        if scheme not in ("stun", "turn", "turns") or ":" not in url or not url.split(":", 1)[1]:
            raise ValueError(f"--ice-servers: {url!r:.80} is not a stun:, turn: or turns: URL (stun:host:3478)")
        if scheme == "stun":
            servers.append(IceServer(url))
        elif username is None or credential is None:
            raise ValueError(f"--ice-servers: {url!r:.80} is a TURN server: give --turn-username and "
                             "--turn-credential-file")
        else:
            servers.append(IceServer(url, username, credential))
    if (username is not None or credential is not None) and not any(s.username for s in servers):
        raise ValueError("--turn-username and --turn-credential-file are for a turn: URL in --ice-servers")
    return tuple(servers)


class Media(Protocol):
    """Audio tracks: the peer's microphone in, the model's voice out (both 24 kHz mono float32)."""

    async def read(self) -> np.ndarray | None:
        """The next chunk of the peer's audio (any length), None once its track has ended."""

    def play(self, pcm: np.ndarray) -> int:
        """Queue model audio for the outgoing track; never blocks. Returns the 80 ms frames of the
        oldest queued audio dropped to keep the lag bound (0 usually)."""


class Transport(Protocol):
    scope: Mapping  # the request's ASGI scope: refusals name its door and client
    media: Media | None  # audio tracks; None: audio travels inside the events

    @property
    def open(self) -> bool:
        """Whether messages can still be sent."""

    def backlog(self) -> int | None:
        """Bytes queued for the peer and not yet sent (the lag bound reads it); None: unknown."""

    async def receive(self) -> str | bytes | None:
        """The peer's next message; None: it has left."""

    async def send_text(self, text: str) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    async def close(self, code: int, reason: str) -> None:
        """End the connection (a no-op once it has ended); never raises."""


class WebSocketTransport:
    """A Starlette WebSocket as a Transport (after `accept()`)."""

    media = None

    def __init__(self, websocket: WebSocket) -> None:
        self.websocket = websocket
        self.scope = websocket.scope
        self._backlog: Callable[[], int] | None = websocket.scope.get("extensions", {}).get(SEND_BACKLOG_EXTENSION)

    @property
    def open(self) -> bool:
        return self.websocket.application_state == WebSocketState.CONNECTED

    def backlog(self) -> int | None:
        return self._backlog() if self._backlog is not None else None

    async def receive(self) -> str | bytes | None:
        message = await self.websocket.receive()
        if message["type"] == "websocket.disconnect":
            return None
        text = message.get("text")
        return text if text is not None else (message.get("bytes") or b"")

    async def send_text(self, text: str) -> None:
        await self.websocket.send_text(text)

    async def send_bytes(self, data: bytes) -> None:
        await self.websocket.send_bytes(data)

    async def close(self, code: int, reason: str) -> None:
        if not self.open:
            return
        try:
            await self.websocket.close(code, reason)
        except Exception:  # already gone: nothing to tell it
            pass
