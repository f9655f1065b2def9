"""The server's sockets, bound before any model loads.

`parley serve` binds its address first: a port another server listens on is one error line and
exit 2 at once, not uvicorn's bind error after every model has loaded. The bound sockets go to
uvicorn (`Server.run(sockets=...)`), which listens on them once the app has started: until then
a connection is refused, as before, rather than left waiting through the load. Torch-free: the
CLI calls it before importing the model stack.
"""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> list[socket.socket]:
    """TCP sockets bound to every address `host` resolves to (asyncio's create_server rule:
    "localhost" is 127.0.0.1 and ::1, "0.0.0.0" every IPv4 interface). OSError when any of them
    cannot be bound; none is left open then."""
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # A restart may bind while its predecessor's connections are in TIME_WAIT; a socket
            # listening on the port still refuses the bind (Linux), so a running server is found.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # its IPv4 twin binds separately
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets
