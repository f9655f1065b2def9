"""Capacity: what a load balancer reads, and admission decided before the WebSocket upgrade.

    GET /livez   200 while the engine thread is alive and healthy: from the first request a started
                 server answers (warming up included: readiness is the probe that waits), then as
                 long as it ticks (a tick within LIVEZ_STALL_S); never load-dependent, so a liveness
                 probe never restarts a full worker. /health is an alias.
    GET /readyz  200 only when warmed up (the engine has ticked), healthy, not draining, and at
                 least `ready_min_free` sessions admittable (`free`); else 503. /ready is an alias.
    GET /load    slots_total, live, prefill, free, draining, tick_ms_p50, tick_ms_p99, and the KV
                 block pool's kv_blocks_total, kv_blocks_used, kv_blocks_free (null without a pool).
    Prometheus   parley_slots_total, parley_sessions_active, parley_slots_free, parley_draining,
                 parley_admission_rejected_total{reason}; the pool's parley_engine_kv_* (http/metrics.py).

`free` is the sessions that can be admitted now: the free slots, and no more than the KV memory
holds to the end of their windows (engine/kv_blocks.py, rule 2), less the reservations made.

Admission: `Admission.reserve_or_deny` runs before `accept()`. With no free slot ("full"), no KV
memory for one more session ("memory"), or while draining, it answers the upgrade itself with
HTTP 503 and `Retry-After`, so a proxy can retry the session on another worker. Otherwise it
reserves a slot. The check and the reservation run
on the event loop with no await in between, and engine slots are only taken on that loop, so N
simultaneous upgrades against k free slots admit exactly k. A reservation becomes an engine slot
when the session opens (`opening`) and is dropped once its prefill is done or it fails (`release`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.websockets import WebSocket

from .refusals import Refusals
from ..server.state import app_state

if TYPE_CHECKING:  # server/security.py imports this module: `parley serve` must not load torch through it
    from ..engine_client import EngineClient

log = logging.getLogger("parley.capacity")

RETRY_AFTER_S = 1  # a refused client (or proxy) may try again this soon
LIVEZ_STALL_S = 10.0  # no tick for this long: the tick loop is stuck (a tick is due every 80 ms)
REFUSAL_REASONS = ("full", "memory", "draining", "unhealthy")
CLOSE_TRY_AGAIN_LATER = 1013  # the fallback when the server cannot send a denial response
CLOSE_POLICY = 1008  # the same, for a refusal that is not about load


@dataclass(frozen=True)
class Load:
    """One reading of the slot table, as the edge sees it (reservations included)."""

    slots_total: int
    live: int  # sessions in conversation
    prefill: int  # admitted, prompt not yet prefilled (reserved before accept included)
    free: int  # sessions admittable now: free slots, bounded by the KV memory
    draining: bool
    tick_ms_p50: float | None
    tick_ms_p99: float | None
    healthy: bool
    warmed: bool
    seconds_since_tick: float | None
    running: bool  # the engine thread is alive
    slots_free: int  # free slots less reservations, whatever the memory
    kv_blocks_total: int | None = None  # the KV block pool (None: the engine has none)
    kv_blocks_used: int | None = None
    kv_blocks_free: int | None = None


class _DenialLogFilter(logging.Filter):
    """uvicorn's websockets-sansio protocol logs "ASGI callable returned without completing
    handshake." at ERROR after every denial response (it never marks the handshake done; open
    upstream as Kludex/uvicorn#3138), which would put an ERROR in the log for each routine 503.
    Drop exactly one such record per denial this process sent; any other stays."""

    MESSAGE = "ASGI callable returned without completing handshake."

    def __init__(self) -> None:
        super().__init__()
        self.expected = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.expected > 0 and record.getMessage() == self.MESSAGE:
            self.expected -= 1
            return False
        return True


DENIAL_LOG_FILTER = _DenialLogFilter()
logging.getLogger("uvicorn.error").addFilter(DENIAL_LOG_FILTER)


class Reservation:
    """A slot held for one upgrade: pending (no engine slot yet), then prefilling, then released."""

    def __init__(self, admission: "Admission", holds_slot: bool = True) -> None:
        self._admission = admission
        self._state = "pending" if holds_slot else "released"  # released: a session that needs no slot
        if holds_slot:
            admission._pending += 1

    def opening(self) -> None:
        """Call right before the engine session is opened, with no await in between."""
        if self._state == "pending":
            self._admission._pending -= 1
            self._admission._prefilling += 1
            self._state = "prefilling"

    def release(self) -> None:
        """The session is prefilled, failed or gone. Idempotent."""
        if self._state == "pending":
            self._admission._pending -= 1
        elif self._state == "prefilling":
            self._admission._prefilling -= 1
        self._state = "released"


class Admission:
    """The edge's admission gate and the capacity signals read from the engine's slot table."""

    def __init__(self, client: "EngineClient", registry: CollectorRegistry, ready_min_free: int = 1, *,
                 refusals: Refusals) -> None:
        if ready_min_free < 0:
            raise ValueError("ready_min_free must be 0 or more")
        self.client = client
        self.refusals = refusals
        self.ready_min_free = ready_min_free
        self.draining = False  # set by the drainer (server/drain.py); never cleared
        self._pending = 0  # reserved, engine slot not taken yet
        self._prefilling = 0  # engine slot taken, prefill not done
        self.rejected = Counter("parley_admission_rejected", "WebSocket upgrades refused with HTTP 503",
                                ["reason"], registry=registry)
        for reason in REFUSAL_REASONS:
            self.rejected.labels(reason)  # export zeros, so rate() works from the first refusal
        registry.register(_CapacityCollector(self))

    def load(self) -> Load:
        c = self.client.counters()
        total = self.client.max_sessions
        slots_free = max(0, int(c["free_slots"]) - self._pending)
        free = slots_free
        if "kv_sessions_admittable" in c:  # memory for the reserved sessions is not promised yet
            free = min(free, max(0, int(c["kv_sessions_admittable"]) - self._pending))
        return Load(slots_total=total, live=max(0, int(c["live_slots"]) - self._prefilling),
                    prefill=self._pending + self._prefilling, free=free, draining=self.draining,
                    tick_ms_p50=c.get("tick_ms_p50"), tick_ms_p99=c.get("tick_ms_p99"),
                    healthy=bool(c["healthy"]), warmed=int(c["ticks"]) > 0,
                    seconds_since_tick=c.get("seconds_since_tick"), running=self.client.running,
                    slots_free=slots_free, kv_blocks_total=c.get("kv_blocks_total"),
                    kv_blocks_used=c.get("kv_blocks_used"), kv_blocks_free=c.get("kv_blocks_free"))

    def alive(self, load: Load) -> bool:
        """The engine thread runs, healthy, and ticks (before its first tick it warms up)."""
        stalled = load.seconds_since_tick is not None and load.seconds_since_tick >= LIVEZ_STALL_S
        return load.healthy and load.running and not stalled

    def ready(self, load: Load) -> bool:
        return load.warmed and load.healthy and not load.draining and load.free >= self.ready_min_free

    def refusal(self, load: Load, needs_slot: bool = True) -> str | None:
        """Why a new session cannot be admitted now, or None."""
        if load.draining:
            return "draining"
        if not load.healthy:
            return "unhealthy"
        if needs_slot and load.slots_free <= 0:
            return "full"
        if needs_slot and load.free <= 0:
            return "memory"
        return None

    async def reserve_or_deny(self, websocket: WebSocket, needs_slot: bool = True) -> Reservation | None:
        """Reserve a slot for this upgrade, or answer it with 503 + Retry-After and return None.
        `needs_slot` False (a session without a duplex row, e.g. transcription): only a draining
        or unhealthy server refuses it, and nothing is reserved."""
        load = self.load()
        reason = self.refusal(load, needs_slot)
        if reason is None:
            return Reservation(self, holds_slot=needs_slot)  # no await since load(): atomic on the event loop
        self.rejected.labels(reason).inc()
        message = {"full": f"all {load.slots_total} session slots are in use; try again later",
                   "memory": f"the KV cache cannot hold another session to the end of its window "
                             f"({load.kv_blocks_free} of {load.kv_blocks_total} blocks free); try again later",
                   "draining": "this server is draining (shutting down); connect again to reach another one",
                   "unhealthy": "the engine is not serving"}[reason]
        self.refusals.record(websocket.scope, reason, message)
        body = {"error": message, "reason": reason, "free": load.free, "total": load.slots_total,
                "draining": load.draining}
        await deny_upgrade(websocket, JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)}),
                           message, CLOSE_TRY_AGAIN_LATER)
        return None


async def deny_upgrade(websocket: WebSocket, response: Response, reason: str, close_code: int = CLOSE_POLICY) -> None:
    """Answer a WebSocket upgrade with an HTTP response instead of accepting it (where the ASGI
    server lacks the denial extension: close `close_code` with `reason`, unaccepted)."""
    try:
        await websocket.send_denial_response(response)
        DENIAL_LOG_FILTER.expected += 1
    except RuntimeError:
        await websocket.close(close_code, reason)


class _CapacityCollector:
    """The capacity gauges, read at scrape time."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def collect(self) -> Iterable:
        load = self._admission.load()
        for name, doc, value in (
                ("parley_slots_total", "conversation slots of this worker", load.slots_total),
                ("parley_sessions_active", "slots taken: sessions live or prefilling", load.live + load.prefill),
                ("parley_slots_free", "slots free for new conversations now", load.free),
                ("parley_draining", "1 while the worker drains (refuses new conversations)", int(load.draining))):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family


def _admission(request: Request) -> Admission:
    return app_state(request).sessions.admission


async def livez(request: Request) -> Response:
    admission = _admission(request)
    load = admission.load()
    alive = admission.alive(load)
    return JSONResponse({"status": "ok" if alive else "unhealthy", "healthy": load.healthy,
                         "seconds_since_tick": load.seconds_since_tick}, status_code=200 if alive else 503)


async def readyz(request: Request) -> Response:
    admission = _admission(request)
    load = admission.load()
    ready = admission.ready(load)
    body = {"ready": ready, "free": load.free, "total": load.slots_total, "draining": load.draining,
            "warmed": load.warmed, "healthy": load.healthy,
            # the names /ready answered with before /readyz existed
            "free_slots": load.free, "live_sessions": app_state(request).sessions.live_count}
    return JSONResponse(body, status_code=200 if ready else 503)


async def load(request: Request) -> Response:
    snapshot = asdict(_admission(request).load())
    return JSONResponse({key: snapshot[key] for key in ("slots_total", "live", "prefill", "free", "draining",
                                                        "tick_ms_p50", "tick_ms_p99", "kv_blocks_total",
                                                        "kv_blocks_used", "kv_blocks_free")})
