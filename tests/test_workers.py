"""The one worker supervisor (realtime/server/workers.py) that the codec's and WebRTC's pools share,
with fake workers: least-loaded placement, a lost worker's sessions ended and the worker replaced,
a strict start that fails as a whole, and a bounded close. (The pools' real processes are killed
mid-session in tests/test_server_moshi.py and tests/test_webrtc_workers.py.)"""

from __future__ import annotations

import asyncio

import pytest

from parley.realtime.server.workers import Supervisor


class FakeProc:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = 0 if self.returncode is None else self.returncode
        return self.returncode


class FakeWorker:
    def __init__(self, index: int, pid: int) -> None:
        self.index, self.proc, self.dead, self.started = index, FakeProc(pid), None, 0.0
        self.sessions: list[str] = []
        self.ended: list[str] = []
        self.closed: list[str] = []

    def load(self) -> int:
        return len(self.sessions)

    def end(self, reason: str) -> None:
        self.ended.append(reason)

    def close(self, reason: str) -> None:
        self.closed.append(reason)


def launcher(fail: set[int] = frozenset()):
    pids = iter(range(100, 200))

    async def launch(index: int) -> FakeWorker:
        if index in fail:
            raise RuntimeError(f"worker {index} did not start")
        return FakeWorker(index, next(pids))
    return launch


def test_sessions_go_to_the_least_loaded_live_worker():
    async def scenario():
        sup = Supervisor("test", 3, launcher())
        await sup.start(strict=True)
        first = sup.least_loaded()
        first.sessions.append("a")
        second = sup.least_loaded()
        assert second is not first
        second.sessions += ["b", "c"]
        third = sup.least_loaded()
        assert third not in (first, second)
        third.sessions += ["d", "e"]
        assert sup.least_loaded() is first
        assert sorted(sup.worker_pids()) == [100, 101, 102]
    asyncio.run(scenario())


def test_a_lost_worker_ends_its_own_sessions_and_is_replaced():
    restarted = []

    async def scenario():
        sup = Supervisor("test", 2, launcher(), on_restart=lambda: restarted.append(1))
        await sup.start(strict=True)
        lost, other = sup.live()
        lost.started = -1e9  # long running: replaced at once
        sup.lose(lost, "worker 0 exited")
        sup.lose(lost, "again")  # idempotent
        assert lost.dead == "worker 0 exited" and lost.ended == ["worker 0 exited"]
        assert lost.proc.returncode == -9 and other.ended == [] and other.dead is None
        assert sup.live() == [other]
        for _ in range(100):
            if sup.restarts:
                break
            await asyncio.sleep(0.01)
        assert sup.restarts == 1 and restarted == [1]
        assert len(sup.live()) == 2 and lost not in sup.live()
        await sup.aclose("the server is shutting down")
        assert all(w.closed == ["the server is shutting down"] for w in (other,))
        assert sup.least_loaded() is None
    asyncio.run(scenario())


def test_a_strict_start_fails_as_a_whole_and_closes_what_started():
    async def scenario():
        sup = Supervisor("test", 2, launcher(fail={1}))
        with pytest.raises(RuntimeError, match="test workers failed to start: worker 1 did not start"):
            await sup.start(strict=True)
        assert sup.live() == [] and sup.closing
    asyncio.run(scenario())


def test_a_lenient_start_keeps_the_workers_that_started():
    async def scenario():
        sup = Supervisor("test", 2, launcher(fail={1}))
        await sup.start(strict=False)
        assert [w.index for w in sup.live()] == [0]
        await sup.aclose("bye")
    asyncio.run(scenario())


def test_a_pool_needs_a_worker():
    with pytest.raises(ValueError, match="at least one worker"):
        Supervisor("codec", 0, launcher())
