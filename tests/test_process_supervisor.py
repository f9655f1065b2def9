"""server/processes.py rule 2, on fake processes: a worker that exits after it said it was ready is
started again; one that exits before it was ever ready (its start fails, and would fail again) stops
the server with status 1 instead of being restarted forever while nobody accepts on the port."""

from __future__ import annotations

import multiprocessing
import signal

import pytest

from parley.realtime.server import processes
from parley.realtime.server.processes import ProcessSupervisor


class FakeProcess:
    def __init__(self, alive: bool, exitcode: int | None = None, pid: int = 0) -> None:
        self.alive, self.exitcode, self.pid, self.sentinel = alive, exitcode, pid, None

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        pass


@pytest.fixture
def supervisor(monkeypatch):
    monkeypatch.setattr(processes, "wait", lambda *args, **kwargs: None)
    monkeypatch.setattr(processes.time, "sleep", lambda seconds: None)
    sup = ProcessSupervisor(config=None, sockets=[], workers=1)
    sup.engine = FakeProcess(alive=True)
    sup.started = []
    yield sup
    sup._dir.cleanup()


def worker(sup: ProcessSupervisor, index: int, process: FakeProcess, said_ready: bool) -> None:
    """Worker `index` as `_start_worker` leaves it, its pipe's far end closed after `said_ready`."""
    receive, send = multiprocessing.Pipe(duplex=False)
    if said_ready:
        send.send(index)
    send.close()
    sup.workers[index] = process
    sup._unready[index] = receive


def test_a_worker_that_dies_after_it_was_ready_is_started_again(supervisor, monkeypatch):
    worker(supervisor, 0, FakeProcess(alive=False, exitcode=-9), said_ready=True)
    monkeypatch.setattr(supervisor, "_start_worker", supervisor.started.append)
    supervisor._watch()
    assert supervisor.started == [0] and supervisor._stopping is None and not supervisor._failed


def test_a_worker_that_dies_before_it_was_ready_stops_the_server_with_status_1(supervisor, monkeypatch):
    worker(supervisor, 0, FakeProcess(alive=False, exitcode=1), said_ready=False)
    monkeypatch.setattr(supervisor, "_start_worker", supervisor.started.append)
    supervisor._watch()
    assert supervisor.started == [] and supervisor._stopping == signal.SIGINT and supervisor._failed


def test_a_live_worker_not_yet_ready_is_left_alone_and_heard_once_it_is(supervisor):
    receive, send = multiprocessing.Pipe(duplex=False)
    supervisor.workers[0], supervisor._unready[0] = FakeProcess(alive=True), receive
    supervisor._watch()
    assert supervisor._stopping is None and not supervisor._heard_ready(0)
    send.send(0)
    assert supervisor._heard_ready(0) and 0 not in supervisor._unready


def test_run_exits_1_when_a_worker_cannot_start(supervisor, monkeypatch):
    monkeypatch.setattr(supervisor, "_start_engine", lambda: None)
    monkeypatch.setattr(supervisor, "_start_worker",
                        lambda index: worker(supervisor, index, FakeProcess(alive=False, exitcode=1), said_ready=False))
    supervisor.config = type("Config", (), {"host": "127.0.0.1", "port": 0, "drain_timeout": 0.0})()
    supervisor.engine = FakeProcess(alive=False, exitcode=0)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert supervisor.run() == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
