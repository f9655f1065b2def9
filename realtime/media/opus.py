"""Ogg-Opus at 24 kHz, decoded and encoded off the event loop.

Each `/api/chat` connection opens one `CodecStream` (an Ogg reader and an Ogg writer: Ogg
streams are stateful) from the server's codec runner and awaits its `decode` / `encode`.
The codec calls are blocking and, in sphn 0.2.1, hold the GIL (encode costs several times what
decode does, benchmarks/edge_cpu.py). Two runners:

- `CodecProcessPool` (`--codec-workers N`, N >= 1): N worker *processes*
  (`realtime/media/codec_worker.py`). A session is pinned to one worker for its lifetime, and that
  worker holds the session's sphn reader and writer; PCM and Ogg bytes travel over a Unix
  socket per worker. The event loop only frames and routes bytes (tens of microseconds per
  call), so codec work leaves the server's GIL entirely: what a full GPU's session count
  needs. Bounded: at most `max_inflight` requests per worker, each with a deadline. A worker
  that dies (or stops answering) fails only its own sessions, with `CodecUnavailable`
  (the connection closes 1011 saying so), and is restarted for new sessions.
- `CodecThreadRunner` (`--codec-workers 0`): a small thread pool in the server process.
  Keeps the loop free while a frame is encoded, but the GIL serializes the codec with the
  loop and the engine thread: fine for the handful of sessions of a CPU box.

Ordering: a connection decodes only from its receive task and encodes only from its send
task, each awaiting one call at a time, so a stream's calls never overlap or reorder (a
worker serves its requests in order; the thread pool sees one call per stream at a time).
Reader and writer are separate objects, so a decode and an encode may run concurrently.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import subprocess
import sys
import time
from typing import Callable, Protocol

import numpy as np

from . import codec_worker as wire
from ..server.workers import Supervisor, spawn, usable_cpus
from .opus_codec import OpusCodec, OpusError, check_frame


class CodecUnavailable(RuntimeError):
    """The codec could not serve this session (its worker crashed, hung, or the server is
    shutting down). The session cannot go on: its Ogg stream state is gone."""


class CodecStream(Protocol):
    """One connection's Ogg-Opus reader and writer."""

    async def decode(self, data: bytes) -> np.ndarray:
        """Feed any number of Ogg bytes; return the float32 PCM decodable so far (maybe empty).
        Raises OpusError for a corrupt stream (after which decode keeps failing)."""

    async def encode(self, pcm: np.ndarray) -> bytes:
        """Encode one 1920-sample float32 frame; return the Ogg page bytes it completes."""

    def close(self) -> None:
        """Forget the stream (idempotent, never blocks)."""


# ---------------------------------------------------------------------------- threads


class CodecThreadRunner:
    """`--codec-workers 0`: codec calls on a small in-process thread pool."""

    workers = 0

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads if threads is not None else min(4, usable_cpus()))
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="opus")

    async def start(self) -> None:
        return None

    def open(self) -> "_ThreadStream":
        return _ThreadStream(self._pool)

    def worker_pids(self) -> list[int]:
        return []

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class _ThreadStream:
    def __init__(self, pool: concurrent.futures.ThreadPoolExecutor) -> None:
        self._pool = pool
        self._codec = OpusCodec()

    async def decode(self, data: bytes) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._codec.decode, data)

    async def encode(self, pcm: np.ndarray) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._codec.encode, pcm)

    def close(self) -> None:
        return None


# ---------------------------------------------------------------------------- processes


class _Worker:
    """One codec worker process and the parent's end of its socket (all state on the event loop)."""

    def __init__(self, index: int, proc: subprocess.Popen, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, max_inflight: int) -> None:
        self.index = index
        self.proc = proc
        self.reader = reader
        self.writer = writer
        self.slots = asyncio.Semaphore(max_inflight)  # bounded: requests in flight to this worker
        self.pending: dict[int, asyncio.Future[bytes]] = {}
        self.streams = 0  # sessions pinned here now
        self.dead: str | None = None  # why, once it is gone
        self.started = time.monotonic()
        self.read_task: asyncio.Task | None = None

    def load(self) -> int:
        return self.streams

    def end(self, reason: str) -> None:
        self._fail(reason)
        try:
            self.writer.close()
        except RuntimeError:
            pass

    def close(self, reason: str) -> None:
        self.end(reason)  # the codec's streams cannot outlive their worker: nothing queued to keep
        if self.read_task is not None:
            self.read_task.cancel()

    def _fail(self, reason: str) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(CodecUnavailable(reason))
        self.pending.clear()


class CodecProcessPool:
    """`--codec-workers N`: N codec worker processes, sessions pinned to one each."""

    def __init__(self, workers: int, *, max_inflight: int = 512, request_timeout: float = 3.0,
                 start_timeout: float = 30.0, on_restart: Callable[[], None] | None = None) -> None:
        self.workers = workers
        self.max_inflight = max_inflight
        self.request_timeout = request_timeout
        self.start_timeout = start_timeout
        self.supervisor: Supervisor[_Worker] = Supervisor("codec", workers, self._spawn, on_restart)
        self._stream_ids = itertools.count(1)
        self._req_ids = itertools.count(1)

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    # ---- lifecycle (event loop) ----

    async def start(self) -> None:
        """Start every worker and wait until each says it is ready (raises if one cannot start)."""
        await self.supervisor.start(strict=True)

    async def _spawn(self, index: int) -> _Worker:
        proc, parent_sock = await spawn([sys.executable, "-m", "parley.realtime.media.codec_worker"])
        try:
            reader, writer = await asyncio.open_unix_connection(sock=parent_sock, limit=1 << 20)
            head = await asyncio.wait_for(reader.readexactly(wire.REPLY.size), self.start_timeout)
            if wire.REPLY.unpack(head)[0] != wire.STATUS_READY:
                raise RuntimeError("unexpected first message")
        except BaseException as exc:
            parent_sock.close()
            proc.kill()
            await asyncio.to_thread(proc.wait)
            if isinstance(exc, (asyncio.IncompleteReadError, asyncio.TimeoutError)):
                raise RuntimeError(f"codec worker {index} did not start (exit code {proc.poll()})") from None
            raise
        worker = _Worker(index, proc, reader, writer, self.max_inflight)
        worker.read_task = asyncio.get_running_loop().create_task(self._read_loop(worker),
                                                                  name=f"codec-worker-{index}")
        return worker

    async def aclose(self) -> None:
        """Close every worker (EOF on its socket makes it exit), bounded; kill stragglers."""
        await self.supervisor.aclose("the server is shutting down")

    def worker_pids(self) -> list[int]:
        return self.supervisor.worker_pids()

    def worker_cpu_seconds(self) -> float:
        """CPU time of the live workers (Linux /proc), for /metrics and benchmarks."""
        return self.supervisor.worker_cpu_seconds()

    # ---- sessions ----

    def open(self) -> "_ProcessStream":
        """Pin a new stream to the least-loaded live worker."""
        worker = self.supervisor.least_loaded()
        if worker is None:
            raise CodecUnavailable("no codec worker is running (the server is shutting down or restarting them)")
        worker.streams += 1
        return _ProcessStream(self, worker, next(self._stream_ids) & 0xFFFFFFFF)

    async def call(self, worker: _Worker, op: int, sid: int, payload: bytes) -> bytes:
        if worker.dead is not None:
            raise CodecUnavailable(worker.dead)
        async with worker.slots:
            if worker.dead is not None:
                raise CodecUnavailable(worker.dead)
            req = next(self._req_ids) & 0xFFFFFFFF
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[bytes] = loop.create_future()
            worker.pending[req] = fut
            deadline = loop.call_later(self.request_timeout, _expire, fut)  # cheaper than wait_for
            try:
                worker.writer.write(wire.REQUEST.pack(op, sid, req, len(payload)) + payload)
                await worker.writer.drain()
                return await fut
            except asyncio.TimeoutError:
                self.supervisor.lose(worker, f"codec worker {worker.index} (pid {worker.proc.pid}) did not answer "
                                             f"within {self.request_timeout:g} s and was restarted")
                raise CodecUnavailable(worker.dead) from None
            except (ConnectionError, RuntimeError) as exc:
                if isinstance(exc, CodecUnavailable):
                    raise
                self.supervisor.lose(worker, f"codec worker {worker.index} connection lost: {exc}")
                raise CodecUnavailable(worker.dead) from None
            finally:
                deadline.cancel()
                worker.pending.pop(req, None)

    def send_close(self, worker: _Worker, sid: int) -> None:
        worker.streams = max(0, worker.streams - 1)
        if worker.dead is None:
            try:
                worker.writer.write(wire.REQUEST.pack(wire.OP_CLOSE, sid, 0, 0))
            except (ConnectionError, RuntimeError):
                pass

    # ---- crashes ----

    async def _read_loop(self, worker: _Worker) -> None:
        reader = worker.reader
        try:
            while True:
                status, req, n = wire.REPLY.unpack(await reader.readexactly(wire.REPLY.size))
                payload = await reader.readexactly(n) if n else b""
                fut = worker.pending.get(req)
                if fut is None or fut.done():
                    continue  # the caller gave up (timeout / cancelled)
                if status == wire.STATUS_OK:
                    fut.set_result(payload)
                elif status == wire.STATUS_OPUS_ERROR:
                    fut.set_exception(OpusError(payload.decode(errors="replace")))  # the worker's OpusCodec says why
                else:
                    fut.set_exception(CodecUnavailable(f"codec error: {payload.decode(errors='replace')}"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            return
        if self.supervisor.closing or worker.dead is not None:
            return
        code = await asyncio.to_thread(_wait_exit, worker.proc)
        self.supervisor.lose(worker, f"codec worker {worker.index} (pid {worker.proc.pid}) exited with code "
                                     f"{code}; its sessions' audio streams were lost")


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(asyncio.TimeoutError())


def _wait_exit(proc: subprocess.Popen) -> int | None:
    try:
        return proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class _ProcessStream:
    def __init__(self, pool: CodecProcessPool, worker: _Worker, sid: int) -> None:
        self._pool = pool
        self._worker = worker
        self._sid = sid
        self._closed = False

    @property
    def worker_pid(self) -> int:
        return self._worker.proc.pid

    async def decode(self, data: bytes) -> np.ndarray:
        out = await self._pool.call(self._worker, wire.OP_DECODE, self._sid, bytes(data))
        return np.frombuffer(out, dtype=np.float32)

    async def encode(self, pcm: np.ndarray) -> bytes:
        check_frame(pcm)
        payload = np.ascontiguousarray(pcm, dtype=np.float32).tobytes()
        return await self._pool.call(self._worker, wire.OP_ENCODE, self._sid, payload)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.send_close(self._worker, self._sid)


CodecRunner = CodecThreadRunner | CodecProcessPool


def make_codec_runner(workers: int | None, *, max_sessions: int = 8,
                      on_restart: Callable[[], None] | None = None) -> CodecThreadRunner | CodecProcessPool:
    """`workers` None: automatic (threads up to 8 sessions, else one process per 32 sessions,
    at most one per CPU core); 0: threads; N: N worker processes."""
    if workers is None:
        workers = 0 if max_sessions <= 8 else min(max(1, usable_cpus() - 1), -(-max_sessions // 32))
    if workers == 0:
        return CodecThreadRunner()
    return CodecProcessPool(workers, on_restart=on_restart)
