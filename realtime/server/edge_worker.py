"""An edge worker process: connections end to end (protocol, codec, WebRTC peers) on the port all
workers share, and the engine through its link (realtime/engine_process/client.py).

`edge_worker` is the target the supervisor (server/processes.py) starts, with the listening
sockets `parley serve` bound. Top to bottom: link to the engine process (waiting while it loads),
build the same app a one-process server builds (server/app.py `assemble_app`) from the engine's
`EdgeSpec`, with the Opus codec on this worker's own threads and its WebRTC calls' aiortc peers on
its own loop (webrtc/local.py: no WebRTC worker processes), then run uvicorn on the shared
sockets and a private one (what other workers relay to this one: attaches and hangups for its calls,
and new calls' offers, calls/call_relay.py) until SIGINT, or SIGTERM, which drains this worker's
sessions first (server/drain.py).
While the engine process is gone (the supervisor restarts it), HTTP requests other than the
probes and /metrics get 503 + Retry-After (`EngineGate`); WebSocket upgrades get admission's
503 ("unhealthy"), as the link's counters say (engine_process/client.py rule 4).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
from multiprocessing.connection import Connection
from pathlib import Path
from typing import MutableSequence

from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from ..calls.call_relay import CallRelay, RelayedClient
from ..engine_process.client import ENGINE_GONE, RemoteClient
from ..http.metrics import exposition
from ..sessions.capacity import RETRY_AFTER_S
from .app import EngineLifetime, assemble_app
from .drain import DrainingServer
from .log_format import configure_logging
from .serve import run_server, runner, uvicorn_config
from .state import app_state

log = logging.getLogger("parley.edge")
METRICS_INTERVAL_S = 1.0  # how stale another worker's scrape of this worker's metrics may be
ENGINE_FREE_PATHS = frozenset({"/livez", "/health", "/readyz", "/ready", "/load", "/metrics"})  # answer unlinked


class EngineGate:
    """503 for HTTP requests while the engine process is gone (module docstring)."""

    def __init__(self, app: ASGIApp, *, client: RemoteClient) -> None:
        self.app, self.client = app, client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.client.linked and scope["path"] not in ENGINE_FREE_PATHS:
            body = {"error": {"message": ENGINE_GONE, "type": "server_error", "code": "engine_unavailable"}}
            await JSONResponse(body, 503, headers={"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def edge_worker(config, sockets: list[socket.socket], path: str, index: int, count: int, log_format: str,
                ready: Connection, call_counts: MutableSequence[int]) -> None:
    """The worker's main (module docstring); `count` workers in all, this one `index`, each worker's
    WebRTC calls in `call_counts` (shared: calls/call_relay.py rule 5). It says on `ready` once its app
    is built and it is about to serve (server/processes.py rule 2)."""
    configure_logging(config.log_level, log_format)
    with runner() as run:
        run.run(_serve(config, sockets, path, index, count, ready, call_counts))


def worker_socket(engine_path: str, index: int) -> str:
    """Worker `index`'s private socket, beside the engine's in the supervisor's directory."""
    return str(Path(engine_path).with_name(f"edge-{index}.sock"))


def _bind_private(path: str) -> socket.socket:
    """This worker's private socket (calls/call_relay.py rule 1); a dead predecessor's file goes first."""
    Path(path).unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    return sock


async def _serve(config, sockets: list[socket.socket], path: str, index: int, count: int, ready: Connection,
                 call_counts: MutableSequence[int]) -> None:
    client = RemoteClient(path, index)
    await client.link()
    # This worker owns its connections end to end: the codec on its threads (codec_workers 0), the
    # WebRTC calls' peers on its loop (webrtc_workers 0: server/app.py peer_host). The CLI refuses
    # --webrtc-workers and a --codec-workers above 0 beside --edge-workers: nothing set is overridden.
    spec = dataclasses.replace(client.edge_spec, codec_workers=0, webrtc_workers=0)
    reading: list[asyncio.Task] = []

    async def start() -> None:
        reading.append(asyncio.create_task(client.run()))
        reading.append(asyncio.create_task(_send_metrics(client, app_state(app).sessions.metrics, process)))

    async def stop() -> None:
        for task in reading:
            task.cancel()
        client.close_link()

    process = f"edge-{index}"
    app = assemble_app(client, spec, EngineLifetime(start, stop), process=process, others=lambda: client.others,
                       middleware=[Middleware(RelayedClient), Middleware(EngineGate, client=client)])
    # an attach or hangup for a call another worker holds goes there, over that worker's private socket,
    # and a new call to the worker holding the fewest
    calls = app_state(app).live_calls
    assert calls is not None  # assemble_app always builds the registry
    calls.relay = CallRelay([worker_socket(path, i) for i in range(count)], index, call_counts)
    private = _bind_private(worker_socket(path, index))
    # POST /admin/drain drains the whole server: the supervisor relays SIGTERM to every worker
    app_state(app).drainer.whole_server = lambda: os.kill(os.getppid(), signal.SIGTERM)
    log.info("edge worker %d serving", index)
    ready.send(index)
    ready.close()
    server = DrainingServer(uvicorn_config(app, config.host, config.port, config.log_level,
                                           ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile),
                            app_state(app).drainer)
    await run_server(server, [*sockets, private])


async def _send_metrics(client: RemoteClient, metrics, process: str) -> None:
    """This worker's metric families to the engine process, for the other workers' scrapes."""
    while True:
        client.cast("metrics", exposition(metrics.registry.collect(), process))
        await asyncio.sleep(METRICS_INTERVAL_S)
