"""An attach or a hangup that lands on an edge worker which does not hold the call: relayed to the one
that does.

With the edge in worker processes (server/edge_worker.py) the kernel hands each connection to any
worker, but a call, and its fan-out to sidebands, lives in the worker that answered it
(calls/sideband.py). Rules this module keeps:
1. Each worker also listens on a private Unix socket of its own (in the supervisor's directory,
   reachable from this machine only). An attach whose call this worker does not hold is offered
   to the other workers there, one after the other, as the same upgrade: same path and query, the
   headers that carry the key and the origin, the subprotocols, plus `FORWARDED`. A hangup
   (`POST /v1/realtime/calls/{id}/hangup`) for a call this worker does not hold goes the same way,
   as the same POST.
2. A worker never relays a request that carries `FORWARDED`: one hop at most, so an id no worker
   holds ends with its 404 after the others have each said 404 once.
3. The worker holding the call decides everything as for a direct request (keys, origin, the bound,
   draining); its refusal other than 404 is the answer, status and body.
4. Once accepted, an attach's messages pass both ways unchanged until either side closes; the other
   side is then closed with the same code and reason.
"""

from __future__ import annotations

import asyncio
import logging

import httpx2
from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

log = logging.getLogger("parley.sideband")

FORWARDED = "x-parley-sideband-relayed"  # rule 2
PASSED_HEADERS = ("authorization", "origin", "openai-beta", "user-agent")  # rule 1 (keys also ride subprotocols)
OPEN_TIMEOUT_S = 5.0  # a peer that does not answer an upgrade or a POST in time is skipped (it may be restarting)


class CallRelay:
    """This worker's way to the other workers' calls (module docstring)."""

    def __init__(self, peers: list[str]) -> None:
        self.peers = peers  # the other workers' private sockets

    @staticmethod
    def relayed(connection: WebSocket | Request) -> bool:
        return FORWARDED in connection.headers

    async def post(self, request: Request) -> Response | None:
        """`request` (a bodiless POST: a call's hangup) answered by the worker holding the call, its
        refusal (rule 3), or None: every other worker said 404 (or could not be reached)."""
        headers = {k: v for k, v in request.headers.items() if k in PASSED_HEADERS} | {FORWARDED: "1"}
        refusal: Response | None = None
        for peer in self.peers:
            try:
                async with httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=peer),
                                              timeout=OPEN_TIMEOUT_S) as client:
                    answer = await client.post(f"http://localhost{request.url.path}", headers=headers)
            except httpx2.HTTPError as exc:
                log.warning("call relay: worker socket %s did not answer (%s)", peer, exc)
                continue
            if answer.status_code != 404:
                response = Response(answer.content, answer.status_code,
                                    headers={k: v for k, v in answer.headers.items()
                                             if k.lower() in ("content-type", "retry-after")})
                if answer.status_code < 300:
                    return response
                refusal = response
        return refusal

    async def open(self, websocket: WebSocket) -> ClientConnection | Response | None:
        """The upgrade accepted by the worker holding the call, its refusal (rule 3), or None:
        every other worker said 404 (or could not be reached)."""
        scope = websocket.scope
        query = scope.get("query_string", b"").decode()
        uri = f"ws://localhost{scope['path']}" + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in websocket.headers.items() if k in PASSED_HEADERS] + [(FORWARDED, "1")]
        subprotocols = scope.get("subprotocols") or None
        refusal: Response | None = None
        for peer in self.peers:
            try:
                return await unix_connect(peer, uri, additional_headers=headers, subprotocols=subprotocols,
                                          max_size=None, open_timeout=OPEN_TIMEOUT_S, compression=None,
                                          user_agent_header=None)
            except InvalidStatus as exc:
                if exc.response.status_code != 404:
                    refusal = Response(exc.response.body, exc.response.status_code,
                                       headers={k: v for k, v in exc.response.headers.items()
                                                if k.lower() in ("content-type", "retry-after")})
            except (OSError, TimeoutError, ConnectionClosed, InvalidHandshake) as exc:  # (a bad answer too)
                log.warning("sideband relay: worker socket %s did not answer (%s)", peer, exc)
        return refusal


async def relay(websocket: WebSocket, upstream: ClientConnection) -> None:
    """Pass messages both ways until either side closes, then close the other alike (rule 4)."""
    await websocket.accept(subprotocol=upstream.subprotocol)

    async def down() -> None:  # the holding worker -> the client
        async for message in upstream:
            if isinstance(message, str):
                await websocket.send_text(message)
            else:
                await websocket.send_bytes(message)

    async def up() -> tuple[int, str]:  # the client -> the holding worker
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                return message.get("code", 1000), message.get("reason") or ""
            if message.get("text") is not None:
                await upstream.send(message["text"])
            elif message.get("bytes") is not None:
                await upstream.send(message["bytes"])

    downward, upward = asyncio.create_task(down()), asyncio.create_task(up())
    try:
        done, _ = await asyncio.wait({downward, upward}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (downward, upward):
            task.cancel()
        await asyncio.gather(downward, upward, return_exceptions=True)
    if upward in done and not upward.cancelled() and upward.exception() is None:
        code, reason = upward.result()  # the client left: so does the relayed attach
        await upstream.close(code if code in range(1000, 5000) and code not in (1005, 1006) else 1000, reason)
        return
    code, reason = upstream.close_code or 1000, upstream.close_reason or ""  # the call's worker closed it
    try:
        await websocket.close(code if code not in (1005, 1006) else 1011, reason)
    except (RuntimeError, WebSocketDisconnect, OSError):
        pass  # the client is gone already
