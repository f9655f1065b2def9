"""Drain: stop taking sessions, let the live ones finish, then go.

Triggers: SIGTERM (`DrainingServer`, what Kubernetes and `parley launch` send) and
`POST /admin/drain` (behind the API key; with no key set, from this machine only). In an edge
worker the POST also asks the supervisor to drain the whole server (server/processes.py rule 4).

1. `draining` is set: /readyz answers 503 at once and new upgrades get 503 + Retry-After
   (sessions/capacity.py), so a proxy places them on another worker.
2. Live sessions run on until they end or `drain_timeout` seconds pass.
3. Each remaining session gets its protocol's notice, then close 1001 (going away).
4. The server exits (uvicorn's normal shutdown: lifespan exit, engine shutdown).

`drain_timeout` 0 keeps the immediate close on SIGTERM (uvicorn's own shutdown). SIGINT
always stops at once; a second SIGTERM while draining is ignored.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType
from typing import Callable

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .security import key_matches
from ..sessions.session import SessionManager
from .state import app_state

log = logging.getLogger("parley.drain")

POLL_S = 0.1  # how often the drain looks for the last session to end
GOING_AWAY = "the server is going away (maintenance); connect again to continue on another server"
LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


class Drainer:
    """The drain state machine of one worker (one per app)."""

    def __init__(self, manager: SessionManager, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError("drain timeout must be 0 or more seconds")
        self.manager = manager
        self.timeout_s = timeout_s
        self._task: asyncio.Task | None = None
        self._exit: Callable[[], None] | None = None
        # An edge worker's: asks its supervisor to drain the whole server (server/edge_worker.py)
        self.whole_server: Callable[[], None] | None = None

    @property
    def draining(self) -> bool:
        return self._task is not None

    def bind_exit(self, exit_fn: Callable[[], None]) -> None:
        """What to call once drained (the server's stop); without one a drain only closes sessions."""
        self._exit = exit_fn

    def start(self, trigger: str) -> bool:
        """Begin draining (on the event loop). False if a drain is already under way."""
        if self._task is not None:
            return False
        self.manager.admission.draining = True
        log.warning("draining (%s): refusing new sessions; %d live session(s) have up to %g s to finish",
                    trigger, self.manager.live_count, self.timeout_s)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="parley-drain")
        return True

    async def wait(self) -> None:
        """Return once a started drain has finished."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while self.manager.live_count and loop.time() < deadline:
            await asyncio.sleep(POLL_S)
        left = self.manager.live_count
        if left:
            log.warning("drain timeout (%g s): closing %d live session(s) with 1001", self.timeout_s, left)
        await self.manager.shutdown(GOING_AWAY)
        log.warning("drained; stopping")
        if self._exit is not None:
            self._exit()


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM turned into a drain (SIGINT keeps the immediate stop)."""

    def __init__(self, config: uvicorn.Config, drainer: Drainer) -> None:
        super().__init__(config)
        self.drainer = drainer
        self._loop: asyncio.AbstractEventLoop | None = None
        drainer.bind_exit(self._drained)

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if sockets is not None and self.started:  # uvicorn says where it runs only when it bound itself
            self._log_started_message(sockets)

    def _drained(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.drainer.timeout_s == 0 or self.should_exit or self._loop is None:
            super().handle_exit(sig, frame)
            return
        if self.drainer.draining:
            log.info("SIGTERM while draining: ignored (SIGINT stops at once)")
            return
        # A signal handler may interrupt the loop mid-step: start the drain from the loop itself.
        self._loop.call_soon_threadsafe(self.drainer.start, "SIGTERM")


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


async def drain_endpoint(request: Request) -> Response:
    """POST /admin/drain: 202 and the drain starts (or is already under way)."""
    manager: SessionManager = app_state(request).sessions
    keys = manager.defaults.api_keys
    if keys:  # security.AccessMiddleware has checked it already; kept so this door stands alone
        if not key_matches(_bearer(request), keys):
            return JSONResponse({"error": "invalid or missing API key: send Authorization: Bearer <key>"},
                                status_code=401)
    elif request.client is None or request.client.host not in LOOPBACK:
        return JSONResponse({"error": "no --api-key is set, so /admin/drain is accepted from this machine only"},
                            status_code=403)
    drainer: Drainer = app_state(request).drainer
    started = drainer.start("POST /admin/drain")
    if started and drainer.whole_server is not None:  # every edge worker drains, not only this one
        drainer.whole_server()
    return JSONResponse({"draining": True, "started": started, "live": manager.live_count,
                         "drain_timeout": drainer.timeout_s}, status_code=202)
