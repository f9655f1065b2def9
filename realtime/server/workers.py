"""The one supervisor of the server's worker processes (the codec's pool, media/opus.py; WebRTC's,
webrtc/pool.py): each pool says how to start one worker and what its sessions lose when it dies;
the `Supervisor` owns the rest, the same way for every pool:

- a fixed number of slots, each holding one worker process on one end of a Unix socketpair;
- new sessions go to the live worker holding the fewest (`least_loaded`);
- a worker that dies or is found stuck (`lose`) ends only its own sessions, is killed if needed,
  and is replaced for new sessions; a replacement that will not start is retried with a backoff,
  and one that died right after starting waits a second first (a broken environment, not a fluke);
- `aclose()` ends every worker's sessions, closes its socket (EOF makes it exit), and kills one
  that has not exited within EXIT_GRACE_S;
- their CPU seconds, read from Linux /proc (what /metrics and the benchmarks report beside
  process_cpu_seconds_total, which covers the server process only).
"""

from __future__ import annotations

import asyncio
import math
import os
import logging
import socket
import subprocess
import time
from typing import Awaitable, Callable, Generic, Iterable, Protocol, TypeVar

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"  # cgroup v2: "QUOTA PERIOD" in microseconds, or "max PERIOD"
EXIT_GRACE_S = 3.0  # a worker told to exit (EOF on its socket) that has not by then is killed
FLUKE_AFTER_S = 5.0  # a worker that dies later than this after its start is replaced at once

log = logging.getLogger("parley.workers")


def usable_cpus(cpu_max: str = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may use, for sizing the default worker counts: its affinity (taskset,
    cpusets), capped by a cgroup v2 CPU quota (a container's limit, as a Kubernetes pod's), where
    os.cpu_count() would count every core of the host; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit readable: the affinity stands
    return max(1, cpus)


class Worker(Protocol):
    """What the supervisor needs of one pool's worker."""

    index: int
    proc: subprocess.Popen
    dead: str | None  # why, once it is gone
    started: float  # time.monotonic() at its start

    def load(self) -> int:
        """Sessions pinned to it now."""

    def end(self, reason: str) -> None:
        """End its sessions with `reason` and drop its socket at once (it is gone or being killed)."""

    def close(self, reason: str) -> None:
        """End its sessions with `reason`, then close its socket after what is queued (EOF: it exits)."""


W = TypeVar("W", bound=Worker)


class Supervisor(Generic[W]):
    """`count` worker processes of one kind, started by `launch(index)` (which returns a worker that
    said it is ready, or raises), restarted when lost."""

    def __init__(self, kind: str, count: int, launch: Callable[[int], Awaitable[W]],
                 on_restart: Callable[[], None] | None = None) -> None:
        if count < 1:
            raise ValueError(f"a {kind} worker pool needs at least one worker")
        self.kind = kind
        self.count = count
        self.restarts = 0
        self._launch = launch
        self._on_restart = on_restart
        self._slots: list[W | None] = [None] * count
        self._tasks: set[asyncio.Task] = set()
        self.closing = False

    async def start(self, *, strict: bool) -> None:
        """Start every worker at once. strict: one that cannot start fails the whole start (after
        closing the others); otherwise it is retried in the background."""
        spawned = await asyncio.gather(*(self._launch(i) for i in range(self.count)), return_exceptions=True)
        errors = [w for w in spawned if isinstance(w, BaseException)]
        for index, worker in enumerate(spawned):
            if not isinstance(worker, BaseException):
                self._slots[index] = worker
            elif not strict:
                log.error("%s; retrying", worker)
                self._respawn_later(index, 1.0)
        if strict and errors:
            await self.aclose("the server is shutting down")
            raise RuntimeError(f"{self.kind} workers failed to start: {errors[0]}") from errors[0]
        log.info("%s: %d of %d worker processes started (pids %s)", self.kind, len(self.worker_pids()),
                 self.count, self.worker_pids())

    def live(self) -> list[W]:
        return [w for w in self._slots if w is not None and w.dead is None]

    def least_loaded(self) -> W | None:
        """The live worker with the fewest sessions; None when none is live or the pool is closing."""
        live = self.live()
        return None if self.closing or not live else min(live, key=lambda w: w.load())

    def lose(self, worker: W, reason: str) -> None:
        """End the worker's sessions, kill it if needed, and start a replacement. Idempotent."""
        if worker.dead is not None:
            return
        worker.dead = reason
        if not self.closing:
            log.error("%s", reason)
        worker.end(reason)
        if worker.proc.poll() is None:
            worker.proc.kill()
        if not self.closing and self._slots[worker.index] is worker:
            fluke = time.monotonic() - worker.started > FLUKE_AFTER_S
            self._respawn_later(worker.index, 0.0 if fluke else 1.0)

    def _respawn_later(self, index: int, delay: float) -> None:
        task = asyncio.get_running_loop().create_task(self._respawn(index, delay),
                                                      name=f"{self.kind}-worker-{index}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _respawn(self, index: int, delay: float) -> None:
        old = self._slots[index]
        if old is not None:
            await asyncio.to_thread(old.proc.wait)  # reap it
        attempt = 0
        while not self.closing:
            await asyncio.sleep(delay)
            try:
                worker = await self._launch(index)
            except Exception as exc:  # noqa: BLE001 - keep trying, bounded by the backoff
                attempt += 1
                delay = backoff(attempt)
                log.error("%s worker %d restart failed (%s); retrying in %.1f s", self.kind, index, exc, delay)
                continue
            if self.closing:
                worker.close("the server is shutting down")
                await asyncio.to_thread(worker.proc.wait)
                return
            self._slots[index] = worker
            self.restarts += 1
            if self._on_restart is not None:
                self._on_restart()
            log.warning("%s worker %d restarted (pid %d)", self.kind, index, worker.proc.pid)
            return

    async def aclose(self, reason: str) -> None:
        """Close every worker (its sessions end with `reason`), bounded; kill stragglers."""
        self.closing = True
        for task in list(self._tasks):
            task.cancel()
        workers = [w for w in self._slots if w is not None]
        self._slots = [None] * self.count
        for worker in workers:
            worker.dead = worker.dead or reason
            worker.close(reason)
        await reap(w.proc for w in workers)

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.live()]

    def worker_cpu_seconds(self) -> float:
        """CPU time of the live workers (Linux /proc), for /metrics and benchmarks."""
        return cpu_seconds(self.worker_pids())


async def spawn(argv: list[str], *args: str) -> tuple[subprocess.Popen, socket.socket]:
    """`argv FD *args`, FD the child's end of a new socketpair; returns the process and the
    server's end."""
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # fork+exec off the loop (the server process can be large); close_fds keeps every other
        # descriptor (the listening socket, other workers' sockets) out of the child.
        proc = await asyncio.to_thread(
            subprocess.Popen, [*argv, str(child_sock.fileno()), *args],
            pass_fds=(child_sock.fileno(),), close_fds=True, stdin=subprocess.DEVNULL)
    except BaseException:
        parent_sock.close()
        raise
    finally:
        child_sock.close()
    return proc, parent_sock


def backoff(attempt: int) -> float:
    """Seconds before restart attempt `attempt` (1, 2, ...) of a worker that would not start."""
    return min(30.0, 0.5 * 2 ** attempt)


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU of the processes (all their threads); one that is gone counts 0."""
    return sum(_stat_cpu(f"/proc/{pid}/stat") for pid in pids)


def thread_cpu_seconds(tid: int) -> float:
    """User + system CPU of one thread of this process (/proc/<tid>/stat would be its whole process's)."""
    return _stat_cpu(f"/proc/self/task/{tid}/stat")


def _stat_cpu(path: str) -> float:
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, IndexError, ValueError):
        return 0.0


async def reap(procs: Iterable[subprocess.Popen], grace_s: float = EXIT_GRACE_S) -> None:
    """Wait for workers told to exit, at most `grace_s` each; kill the stragglers."""
    for proc in procs:
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), grace_s)
        except asyncio.TimeoutError:
            proc.kill()
            await asyncio.to_thread(proc.wait)
