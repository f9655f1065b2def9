"""What the server's worker process pools (the codec's, media/opus.py; WebRTC's, webrtc/pool.py) share:
their start (a process on one end of a Unix socketpair), their CPU seconds, read from Linux /proc
(what /metrics and the benchmarks report beside process_cpu_seconds_total, which covers the server
process only), their restart backoff and their bounded exit."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
from typing import Iterable

EXIT_GRACE_S = 3.0  # a worker told to exit (EOF on its socket) that has not by then is killed


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
