"""server/processes.py rules 2 and 3, on fake processes: a worker that exits after it said it was ready
is started again; one that exits before it was ever ready (its start fails, and would fail again) stops
the server with status 1 instead of being restarted forever while nobody accepts on the port. A dead
engine is started again; replacements that exit before ready stop the server after ENGINE_START_TRIES
in a row (status 1), or at once with status 2 when they cannot serve the configuration."""

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
    assert supervisor.started == [0] and supervisor._stopping is None and supervisor._failed is None


def test_a_worker_that_dies_before_it_was_ready_stops_the_server_with_status_1(supervisor, monkeypatch):
    worker(supervisor, 0, FakeProcess(alive=False, exitcode=1), said_ready=False)
    monkeypatch.setattr(supervisor, "_start_worker", supervisor.started.append)
    supervisor._watch()
    assert supervisor.started == [] and supervisor._stopping == signal.SIGINT and supervisor._failed == 1


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


def engine_starts(supervisor, monkeypatch, statuses: list) -> list:
    """The engine dies before each `_watch`; each replacement's start ends with the next of `statuses`
    (None: ready). Returns the statuses not yet used."""
    left = list(statuses)

    def start():
        status = left.pop(0)
        supervisor.engine = FakeProcess(alive=status is None, exitcode=status)
        return status
    monkeypatch.setattr(supervisor, "_start_engine", start)
    return left


def test_a_dead_engine_is_started_again_and_a_ready_one_clears_the_count(supervisor, monkeypatch):
    left = engine_starts(supervisor, monkeypatch, [1, 1, None, 1, 1, None])
    for _ in range(6):
        supervisor.engine = FakeProcess(alive=False, exitcode=-9)
        supervisor._watch()
        assert supervisor._stopping is None
    assert left == [] and supervisor._failed is None and supervisor._engine_failures == 0


def test_engine_replacements_that_never_get_ready_stop_the_server_with_status_1(supervisor, monkeypatch):
    left = engine_starts(supervisor, monkeypatch, [1] * (processes.ENGINE_START_TRIES + 2))
    supervisor.engine = FakeProcess(alive=False, exitcode=-9)
    while supervisor._stopping is None:
        supervisor._watch()
    assert len(left) == 2 and supervisor._failed == 1 and supervisor._stopping == signal.SIGINT


def test_an_engine_replacement_that_cannot_serve_the_configuration_stops_the_server_with_status_2(
        supervisor, monkeypatch):
    engine_starts(supervisor, monkeypatch, [processes.EXIT_CONFIG])
    supervisor.engine = FakeProcess(alive=False, exitcode=-9)
    supervisor._watch()
    assert supervisor._failed == processes.EXIT_CONFIG == 2 and supervisor._stopping == signal.SIGINT


class SilentPipe:
    def poll(self, timeout: float = 0.0) -> bool:
        return False

    def close(self) -> None:
        pass


def test_a_signal_while_the_engine_loads_returns_without_waiting_for_it_to_exit(supervisor, monkeypatch):
    """SIGTERM during the engine's start: `_stop` ends it; waiting for a loading engine to exit would hang."""
    loading = FakeProcess(alive=True)
    loading.join = lambda timeout=None: pytest.fail("joined a live engine")
    loading.start = lambda: supervisor._on_signal(signal.SIGTERM, None)  # the signal arrives as it starts

    class Spawn:
        Pipe = staticmethod(lambda duplex=False: (SilentPipe(), SilentPipe()))
        Process = staticmethod(lambda **kwargs: loading)
    monkeypatch.setattr(processes, "SPAWN", Spawn)
    assert supervisor._start_engine() is None and supervisor.engine is loading
    assert supervisor._stopping == signal.SIGTERM


class ReadyOnThirdPoll(SilentPipe):
    """An engine's ready pipe that has its word on the third look (the first two find the engine loading)."""

    def __init__(self) -> None:
        self.polls = 0

    def poll(self, timeout: float = 0.0) -> bool:
        self.polls += 1
        return self.polls >= 3

    def recv(self) -> None:
        return None


def test_a_worker_that_dies_while_the_engine_restarts_is_replaced_before_the_engine_is_ready(supervisor, monkeypatch):
    """Rule 3: the supervisor waits for a loading engine but still keeps rule 2, so a worker's place does
    not stay empty for the whole load (its replacement links once the engine is ready)."""
    worker(supervisor, 0, FakeProcess(alive=False, exitcode=-9), said_ready=True)
    ready = ReadyOnThirdPoll()
    started_during_load = []

    def start_worker(index: int) -> None:
        started_during_load.append((index, ready.polls))
        worker(supervisor, index, FakeProcess(alive=True), said_ready=False)  # linking: not yet ready
    monkeypatch.setattr(supervisor, "_start_worker", start_worker)

    class Spawn:
        Pipe = staticmethod(lambda duplex=False: (ready, SilentPipe()))
        Process = staticmethod(lambda **kwargs: FakeProcess(alive=True))
    monkeypatch.setattr(processes, "SPAWN", Spawn)
    monkeypatch.setattr(FakeProcess, "start", lambda self: None, raising=False)
    assert supervisor._start_engine() is None
    assert started_during_load == [(0, 1)] and supervisor._stopping is None
