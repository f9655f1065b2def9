"""An attach or a hangup that lands on an edge worker which does not hold the call: relayed to the one
that does.

With the edge in worker processes (server/edge_worker.py) the kernel hands each connection to any
worker, but a call, and its fan-out to sidebands, lives in the worker that answered it
(calls/sideband.py). Rules this module keeps:
1. Each worker also listens on a private Unix socket of its own (in the supervisor's directory,
   reachable from this machine only). An attach whose call this worker does not hold is offered
   to the other workers there, one after the other, as the same upgrade: same path and query, the
   headers that carry the key and the origin, the subprotocols, plus `FORWARDED` and the client's
   address (`CLIENT`: the holding worker's logs and refusals name it, `RelayedClient`). A hangup
   (`POST /v1/realtime/calls/{id}/hangup`) for a call this worker does not hold goes the same way,
   as the same POST.
2. A worker never relays a request that carries `FORWARDED`: one hop at most, so an id no worker
   holds ends with its 404 after the others have each said 404 once.
3. The worker holding the call decides everything as for a direct request (keys, origin, the bound,
   draining); its refusal other than 404 is the answer, status and body.
4. Once accepted, an attach's messages pass both ways unchanged until either side closes; the other
   side is then closed with the same code and reason.
5. A new call goes to the worker holding the fewest (each call's peer costs its worker far more CPU
   than a WebSocket session, and the kernel spreads a burst of connections unevenly): each worker
   counts its calls, from the offer to the call's end, in one shared array. An offer that reaches a
   worker holding more calls than another (that one's count plus the offers sent it and not yet
   answered) is relayed there as the same POST, and its answer (status, body, `Location`) is the
   client's. A worker that cannot be reached leaves the offer to this one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, MutableSequence

import httpx2
from starlette.requests import Request
from starlette.responses import Response
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.asyncio.client import ClientConnection, unix_connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

log = logging.getLogger("parley.sideband")

FORWARDED = "x-parley-relayed"  # rule 2
CLIENT = "x-parley-relayed-client"  # the client's address, for the holding worker's logs (`RelayedClient`)
PASSED_HEADERS = ("authorization", "origin", "openai-beta", "user-agent")  # rule 1 (keys also ride subprotocols)
OPEN_TIMEOUT_S = 5.0  # a peer that does not answer an upgrade or a hangup in time is skipped (it may be restarting)
OFFER_TIMEOUT_S = 30.0  # a relayed offer waits for the other worker's SDP answer (its ICE gathering)
ANSWER_HEADERS = ("content-type", "retry-after", "location")  # what a relayed POST's answer keeps


class CallRelay:
    """This worker's way to the other workers' calls (module docstring): worker `index` of those
    whose private sockets `sockets` lists (this one's included); `calls[i]`: worker i's calls (rule 5)."""

    def __init__(self, sockets: list[str], index: int, calls: MutableSequence[int]) -> None:
        self.index, self._sockets, self._calls = index, sockets, calls
        self.peers = [path for i, path in enumerate(sockets) if i != index]  # the other workers' private sockets
        self._sent = [0] * len(sockets)  # offers relayed to each worker, not yet answered
        calls[index] = 0  # a restarted worker's predecessor's calls ended with it

    @staticmethod
    def relayed(connection: WebSocket | Request) -> bool:
        return FORWARDED in connection.headers

    def hold_call(self) -> Callable[[], None]:
        """Count one more call on this worker (rule 5) until the returned function is called (once)."""
        self._calls[self.index] += 1  # this worker's own slot: no other process writes it
        held = [True]

        def release() -> None:
            if held[0]:
                held[0] = False
                self._calls[self.index] -= 1
        return release

    def lighter(self) -> int | None:
        """Another worker holding fewer calls than this one, counting the offers sent it (rule 5)."""
        counts = [(self._calls[i] + self._sent[i], i) for i in range(len(self._sockets)) if i != self.index]
        fewest = min(counts, default=None)
        return fewest[1] if fewest is not None and fewest[0] < self._calls[self.index] else None

    async def place(self, request: Request, body: bytes, target: int) -> Response | None:
        """A WebRTC offer (`body`) answered by worker `target` (`lighter()`, rule 5), or None: it
        could not be reached, answer here."""
        log.info("call relay: a WebRTC offer goes to edge worker %d (%d calls and %d offers sent it; %d here)",
                 target, self._calls[target], self._sent[target], self._calls[self.index])
        self._sent[target] += 1
        try:
            return await self._post(self._sockets[target], request, body, OFFER_TIMEOUT_S)
        finally:
            self._sent[target] -= 1

    async def post(self, request: Request) -> Response | None:
        """`request` (a bodiless POST: a call's hangup) answered by the worker holding the call, its
        refusal (rule 3), or None: every other worker said 404 (or could not be reached)."""
        refusal: Response | None = None
        for peer in self.peers:
            answer = await self._post(peer, request, b"", OPEN_TIMEOUT_S)
            if answer is None or answer.status_code == 404:
                continue
            if answer.status_code < 300:
                return answer
            refusal = answer
        return refusal

    @staticmethod
    async def _post(peer: str, request: Request, body: bytes, timeout: float) -> Response | None:
        """`request` with `body` as the same POST to the worker at `peer` (rule 1): its answer, or None
        when it cannot be reached."""
        headers = {k: v for k, v in request.headers.items() if k in (*PASSED_HEADERS, "content-type")}
        url = f"http://localhost{request.url.path}" + (f"?{request.url.query}" if request.url.query else "")
        try:
            async with httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=peer), timeout=timeout) as client:
                answer = await client.post(url, headers=headers | _marks(request.scope), content=body)
        except httpx2.HTTPError as exc:
            log.warning("call relay: worker socket %s did not answer (%s)", peer, exc)
            return None
        return Response(answer.content, answer.status_code,
                        headers={k: v for k, v in answer.headers.items() if k.lower() in ANSWER_HEADERS})

    async def open(self, websocket: WebSocket) -> ClientConnection | Response | None:
        """The upgrade accepted by the worker holding the call, its refusal (rule 3), or None:
        every other worker said 404 (or could not be reached)."""
        scope = websocket.scope
        query = scope.get("query_string", b"").decode()
        uri = f"ws://localhost{scope['path']}" + (f"?{query}" if query else "")
        headers = [(k, v) for k, v in websocket.headers.items() if k in PASSED_HEADERS]
        headers += list(_marks(scope).items())
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


def _marks(scope) -> dict[str, str]:
    """What a relayed request carries besides the client's own headers: `FORWARDED` (rule 2) and the
    client's address when it has one (`CLIENT`, rule 1)."""
    client = scope.get("client")
    return {FORWARDED: "1"} | ({CLIENT: f"{client[0]}:{client[1]}"} if client else {})


class RelayedClient:
    """ASGI middleware of an edge worker: a request relayed over the private socket (which has no
    client address of its own) takes the address the relaying worker passed, so its refusals and
    logs name the client. A request that came over TCP keeps its own: the header cannot spoof it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket") and not scope.get("client"):
            passed = dict(scope.get("headers") or ()).get(CLIENT.encode())
            host, _, port = (passed or b"").decode("latin-1").rpartition(":")
            if host and port.isdigit():
                scope = {**scope, "client": (host, int(port))}
        await self.app(scope, receive, send)


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
