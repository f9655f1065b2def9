"""uvicorn's websockets-sansio protocol with two additions the server needs.

1. A handshake the websockets parser refuses (a request line or header over its 8 KiB
   line limit, e.g. a PersonaPlex persona of ~7,000 characters in `text_prompt`, or a
   malformed request) is answered, 414 or 400, and the connection closed. Upstream leaves
   such a socket open and silent, and its shutdown path then fails on it.
2. The ASGI scope carries `parley.send_backlog`: a callable giving the bytes queued for the
   peer (transport buffer plus the kernel's unsent queue), which the edge uses to bound
   each client's lag (sessions/limits.py).
"""

from __future__ import annotations

import logging

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import SecurityError
from websockets.http11 import Request

from ..sessions.limits import send_backlog
from ..sessions.session import SEND_BACKLOG_EXTENSION

log = logging.getLogger("parley.server")


class ParleyWebSocketProtocol(WebSocketsSansIOProtocol):
    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.handshake_initiated and not self.close_sent and self.conn.handshake_exc is not None:
            self._refuse_handshake(self.conn.handshake_exc)

    def _refuse_handshake(self, exc: BaseException) -> None:
        too_long = isinstance(exc.__cause__, SecurityError)
        status, reason, text = ((414, "URI Too Long", "request line or header over 8 KiB; for a long persona, "
                         "set it after connecting (/v1/realtime session.update) or on the server (--persona)")
                        if too_long else (400, "Bad Request", "malformed WebSocket handshake"))
        client = "%s:%d" % self.client if self.client else "?"
        log.info("refused a WebSocket handshake from %s: %d %s", client, status, text.split(";")[0])
        body = text.encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                             % (status, reason.encode(), len(body), body))
        # As after a refused upgrade upstream: nothing more to send, shutdown just closes.
        self.handshake_complete = True
        self.close_sent = True
        self.transport.close()

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        if not self.close_sent:  # accepted for the app: its task has not started yet
            transport = self.transport
            self.scope["extensions"][SEND_BACKLOG_EXTENSION] = lambda: send_backlog(transport)
