"""`parley serve --edge-workers N` (N >= 1): the supervisor of the engine process and the edge workers.

The process `parley serve` started stays the supervisor: it loads nothing. Rules it keeps:
1. It starts the engine process (server/engine_core.py) and N edge workers (server/edge_worker.py),
   each with the listening sockets `parley serve` bound: the kernel hands each new connection to
   one of the workers, which owns it to the end.
2. A worker that exits unasked is started again in its place; its sessions ended with it (the
   engine freed their slots when its link closed: engine_process/core.py), no other worker's did.
   A worker that exits before it was ever ready (its app built, about to serve) stops the server
   with status 1 instead: what failed its start (a missing package, a bad setting) fails every
   replacement too, and a supervisor restarting it forever would hold the port with nobody
   accepting on it.
3. An engine process that exits unasked is started again; meanwhile every worker answers 503 and
   fails /readyz, its open sessions ended with a failed terminal, and links again once the new
   one is ready (engine_process/client.py rule 4); a worker that exits meanwhile is replaced at once
   (rule 2), its replacement linking once the engine is ready. An engine that cannot serve its configuration
   (exit 2, before it is ready) stops the server with status 2, as a one-process server would.
   A replacement that exits before it is ready is tried again, ENGINE_START_TRIES times in a row at
   most, then the server stops with status 1: a device that fails every load is the operator's
   (or the orchestrator's) to see, not a reload loop's to hide behind 503s.
4. SIGTERM drains: each worker drains its own sessions (server/drain.py) and exits, then the engine
   process is stopped. `POST /admin/drain` on any worker sends this process SIGTERM, so the whole
   server drains. SIGINT stops every process at once.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path

from .edge_worker import edge_worker
from .engine_core import EXIT_CONFIG, engine_process
from .log_format import current_kind

log = logging.getLogger("parley.server")
SPAWN = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
RESTART_PAUSE_S = 1.0  # between a process's exit and its replacement: a crash loop costs little
STOP_GRACE_S = 10.0  # after the drain (or at once for SIGINT), how long a process gets before SIGKILL
ENGINE_START_TRIES = 3  # replacements in a row that may exit before ready (rule 3)


class ProcessSupervisor:
    """The engine process and the edge workers of one `parley serve` (module docstring)."""

    def __init__(self, config, sockets: list[socket.socket], workers: int) -> None:
        self.config, self.sockets, self.count = config, sockets, workers
        self._dir = tempfile.TemporaryDirectory(prefix="parley-")
        self.path = str(Path(self._dir.name) / "engine.sock")
        self.engine: multiprocessing.process.BaseProcess | None = None
        self.workers: dict[int, multiprocessing.process.BaseProcess] = {}
        self._unready: dict[int, Connection] = {}  # workers not yet ready: the pipe each says so on
        self._failed: int | None = None  # the exit status a failed start sets (rules 2 and 3)
        self._engine_failures = 0  # replacement engines in a row that exited before ready (rule 3)
        self._stopping: int | None = None  # the signal that asked the server to stop
        self.call_counts = SPAWN.RawArray("i", workers)  # each worker's WebRTC calls (calls/call_relay.py rule 5)

    def _start_engine(self) -> int | None:
        """Start the engine process and wait for it to be ready: None (also when a signal came first:
        `_stop` ends it), or the status it exited with."""
        receive, send = SPAWN.Pipe(duplex=False)
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.engine = SPAWN.Process(target=engine_process, name="parley-engine", daemon=False,
                                    args=(self.config, self.path, send, current_kind()))
        self.engine.start()
        send.close()
        while self._stopping is None:
            if receive.poll(0.2):
                try:
                    receive.recv()
                    return None
                except EOFError:
                    break
            if not self.engine.is_alive():
                break
            self._replace_workers()  # a replacement links once this engine is ready (rule 3)
        else:
            return None
        self.engine.join()
        return self.engine.exitcode

    def _start_worker(self, index: int) -> None:
        receive, send = SPAWN.Pipe(duplex=False)
        worker = SPAWN.Process(target=edge_worker, name=f"parley-edge-{index}", daemon=False,
                               args=(self.config, self.sockets, self.path, index, self.count, current_kind(), send,
                                     self.call_counts))
        worker.start()
        send.close()
        log.info("edge worker %d started (pid %d)", index, worker.pid)
        self.workers[index] = worker
        self._unready[index] = receive

    def _heard_ready(self, index: int) -> bool:
        """Whether worker `index` has said it is ready (its pipe's end without a word: not)."""
        receive = self._unready.get(index)
        if receive is None:
            return True
        if not receive.poll():
            return False
        try:
            receive.recv()
        except EOFError:  # it exited without a word
            return False
        receive.close()
        del self._unready[index]
        return True

    def run(self) -> int:
        """Serve until stopped (rule 4); the exit status of `parley serve`."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        status = self._start_engine()
        if status is not None:
            log.error("the engine process exited with status %s before it was ready", status)
            return status if status == EXIT_CONFIG else 1
        if self._stopping is None:  # (a signal during the engine's start: nothing more to start)
            for index in range(self.count):
                self._start_worker(index)
            log.info("serving on %s:%d with %d edge workers and the engine process %d", self.config.host,
                     self.config.port, self.count, self.engine.pid)
        while self._stopping is None:
            self._watch()
        status = self._stop()
        return status if self._failed is None else self._failed

    def _watch(self) -> None:
        """Wait for a process to exit or a signal, and replace what exited unasked (rules 2, 3)."""
        processes = [p for p in (self.engine, *self.workers.values()) if p is not None]
        wait([p.sentinel for p in processes], timeout=0.5)
        if self._stopping is not None:
            return
        self._replace_workers()
        if self._stopping is None and self.engine is not None and not self.engine.is_alive():
            log.error("the engine process exited with status %s: starting another; the workers answer 503 "
                      "until it is ready", self.engine.exitcode)
            time.sleep(RESTART_PAUSE_S)
            self._engine_started(self._start_engine())

    def _replace_workers(self) -> None:
        """Start a worker in the place of each that exited unasked, or stop the server (rule 2); also
        while a replacement engine starts, so no worker's place stays empty for the engine's load."""
        for index, worker in list(self.workers.items()):
            ready = self._heard_ready(index)
            if worker.is_alive():
                continue
            if not ready:  # rule 2: its start fails, and would fail again
                log.error("edge worker %d exited with status %s before it was ready (its error is above): "
                          "stopping the server", index, worker.exitcode)
                self._fail(1)
                return
            log.error("edge worker %d exited with status %s: starting another (its sessions ended)",
                      index, worker.exitcode)
            time.sleep(RESTART_PAUSE_S)
            self._start_worker(index)

    def _engine_started(self, status: int | None) -> None:
        """A replacement engine's start (rule 3): ready (None), or the status it exited with."""
        if status is None:
            self._engine_failures = 0
            return
        self._engine_failures += 1
        if status == EXIT_CONFIG:
            log.error("the engine process cannot serve this configuration (its error is above): stopping the server")
            self._fail(EXIT_CONFIG)
        elif self._engine_failures >= ENGINE_START_TRIES:
            log.error("the engine process exited before it was ready %d times in a row (status %s; its error is "
                      "above): stopping the server", self._engine_failures, status)
            self._fail(1)

    def _fail(self, status: int) -> None:
        """Stop every process at once; `parley serve` exits with `status`."""
        self._failed, self._stopping = status, signal.SIGINT

    def _on_signal(self, sig: int, _frame) -> None:
        if self._stopping is None:
            self._stopping = sig
            log.info("%s: stopping the edge workers, then the engine process", signal.Signals(sig).name)

    def _stop(self) -> int:
        sig = self._stopping or signal.SIGINT
        for worker in self.workers.values():  # SIGTERM: each drains its own sessions first
            if worker.is_alive():
                os.kill(worker.pid, sig)
        drain = self.config.drain_timeout if sig == signal.SIGTERM else 0.0
        for worker in self.workers.values():
            _join(worker, drain + STOP_GRACE_S)
        if self.engine is not None and self.engine.is_alive():
            os.kill(self.engine.pid, signal.SIGTERM)
            _join(self.engine, STOP_GRACE_S)
        for sock in self.sockets:
            sock.close()
        self._dir.cleanup()
        return 0


def _join(process: multiprocessing.process.BaseProcess, timeout: float) -> None:
    process.join(timeout)
    if process.is_alive():
        log.error("%s did not stop within %.0f s: killed", process.name, timeout)
        process.kill()
        process.join()


def serve_processes(config, sockets: list[socket.socket], workers: int) -> int:
    """`parley serve` with the engine in its own process and `workers` edge workers."""
    return ProcessSupervisor(config, sockets, workers).run()
