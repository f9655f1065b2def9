"""The one-process server's WebRTC worker processes (`--webrtc-workers N`), one of the two peer
hosts (webrtc/transport.py `PeerHost`; an edge worker runs its calls' peers itself: webrtc/local.py):
every call's aiortc peer runs in one of them (webrtc/worker.py), never on the server's event loop,
whose GIL the engine thread shares.

- Started on the first call (a server that takes no WebRTC call starts none), all N at once;
  then each call is pinned for its life to the live worker holding the fewest calls.
- One Unix socketpair per worker carries every call's frames (webrtc/wire.py), routed here to the
  call's `WebRTCCall` by id.
- A worker that dies (or is found stuck) ends only its own calls, each as if its peer had left,
  and is replaced for new calls (server/workers.py's Supervisor, as for the codec's workers).
- `aclose()` (the server's shutdown, after its calls hung up) closes each socket: EOF makes a
  worker hang up whatever it still holds and exit; one that does not within 3 s is killed.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import time
from typing import Callable

from . import wire
from ..server.log_format import current_kind
from ..server.workers import Supervisor, spawn, usable_cpus
from .transport import CallUnavailable, WebRTCCall


# The automatic size: one worker per this many sessions, well under what saturates one worker's core
# (docs/benchmarks.md#64-webrtc-calls-on-the-h200-host: at 16 a worker the calls lost frames).
CALLS_PER_WORKER = 6


def default_workers(max_sessions: int) -> int:
    """One worker per CALLS_PER_WORKER sessions, at most one per CPU core but one (for the engine)."""
    return max(1, min(usable_cpus() - 1, -(-max_sessions // CALLS_PER_WORKER)))


class WorkerProcess:
    """One worker process, the server's end of its socket, and the calls pinned to it."""

    def __init__(self, index: int, proc: subprocess.Popen, pool: "WebRTCPool") -> None:
        self.index = index
        self.proc = proc
        self.pid = proc.pid
        self.calls: dict[int, WebRTCCall] = {}
        self.dead: str | None = None  # why, once it is gone
        self.started = time.monotonic()
        self.hello = asyncio.get_running_loop().create_future()
        self.link = wire.FrameProtocol(lambda op, call, payload: pool.on_frame(self, op, call, payload),
                                       lambda why: pool.on_lost(self, why))

    def load(self) -> int:
        return len(self.calls)

    def end(self, reason: str) -> None:
        self._end_calls(reason)
        if self.link.transport is not None:
            self.link.transport.abort()

    def close(self, reason: str) -> None:
        self._end_calls(reason)
        if self.link.transport is not None:
            self.link.transport.close()  # what is queued (the calls' CLOSE frames) goes first

    def _end_calls(self, reason: str) -> None:
        for call in list(self.calls.values()):
            call.lost(reason)
        self.calls.clear()


class WebRTCPool:
    """`--webrtc-workers N`: N WebRTC worker processes, calls pinned to one each."""

    def __init__(self, workers: int, *, start_timeout: float = 30.0,
                 on_restart: Callable[[], None] | None = None,
                 on_silent: Callable[[int], None] | None = None) -> None:
        if workers < 1:
            raise ValueError("--webrtc-workers must be at least 1")
        self.workers = workers
        self.argv = [sys.executable, "-m", "parley.realtime.webrtc.worker"]  # + the socket's fd, the log format
        self.start_timeout = start_timeout
        self.on_silent = on_silent  # (packets): the calls' tracks sent silence, no model audio ready
        self.supervisor: Supervisor[WorkerProcess] = Supervisor("webrtc", workers, self._spawn, on_restart)
        self._ids = itertools.count(1)
        self._started = False
        self._starting = asyncio.Lock()

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    # ---- calls ----

    async def pin(self, call: WebRTCCall) -> WorkerProcess:
        """Give the call an id and the least-loaded live worker (starting the pool on the first call)."""
        if not self._started:
            await self._start()
        worker = self.supervisor.least_loaded()
        if worker is None:
            raise CallUnavailable("no WebRTC worker is running (the server is stopping or restarting them)")
        call.id = next(self._ids) & 0xFFFFFFFF
        worker.calls[call.id] = call
        return worker

    def unpin(self, call: WebRTCCall) -> None:
        worker = call.lane
        if isinstance(worker, WorkerProcess) and worker.calls.get(call.id) is call:
            del worker.calls[call.id]

    def stuck(self, call: WebRTCCall, what: str) -> None:
        """The call's worker is stuck: it is restarted, ending every call it holds."""
        worker = call.lane
        if isinstance(worker, WorkerProcess):
            self.lose(worker, f"webrtc worker {worker.index} (pid {worker.pid}) {what} and was restarted")

    def on_frame(self, worker: WorkerProcess, op: int, call_id: int, payload: bytes) -> None:
        if op == wire.HELLO:
            if not worker.hello.done():
                worker.hello.set_result(None)
            return
        call = worker.calls.get(call_id)
        if call is not None:  # else: a call the server already let go of
            call.deliver(op, payload)

    # ---- lifecycle ----

    async def _start(self) -> None:
        async with self._starting:
            if not self._started:
                await self.supervisor.start(strict=False)
                self._started = True

    async def _spawn(self, index: int) -> WorkerProcess:
        proc, parent_sock = await spawn(self.argv, current_kind())
        worker = WorkerProcess(index, proc, self)
        try:
            await asyncio.get_running_loop().create_connection(lambda: worker.link, sock=parent_sock)
            await asyncio.wait_for(asyncio.shield(worker.hello), self.start_timeout)
        except BaseException as exc:
            worker.dead = "did not start"
            if worker.link.transport is not None:
                worker.link.transport.abort()  # it owns the socket now
            else:
                parent_sock.close()
            proc.kill()
            await asyncio.to_thread(proc.wait)
            if isinstance(exc, (asyncio.TimeoutError, ConnectionError, asyncio.CancelledError)):
                raise RuntimeError(f"webrtc worker {index} did not start (exit code {proc.poll()})") from None
            raise
        return worker

    def on_lost(self, worker: WorkerProcess, why: str) -> None:
        """The worker's socket closed: it exited, or the server closed it."""
        if not worker.hello.done():  # still starting: _spawn reports it
            worker.hello.set_exception(ConnectionError(why))
            worker.hello.exception()  # read here, so an unawaited one is not logged
            return
        self.lose(worker, f"webrtc worker {worker.index} (pid {worker.pid}) exited ({why}); its calls ended")

    def lose(self, worker: WorkerProcess, reason: str) -> None:
        """End the worker's calls, kill it if needed, and start a replacement."""
        self.supervisor.lose(worker, reason)

    async def aclose(self) -> None:
        """Close every worker (EOF on its socket makes it hang up and exit), bounded; kill stragglers."""
        await self.supervisor.aclose("the server is shutting down")

    # ---- figures ----

    def count_silent(self, packets: int) -> None:
        if self.on_silent is not None:
            self.on_silent(packets)

    def worker_pids(self) -> list[int]:
        return self.supervisor.worker_pids()

    def calls(self) -> dict[int, int]:
        """Calls pinned to each live worker, by pid."""
        return {w.pid: len(w.calls) for w in self.supervisor.live()}

    def worker_cpu_seconds(self) -> float:
        """CPU time of the live workers (Linux /proc), for /metrics and benchmarks."""
        return self.supervisor.worker_cpu_seconds()
