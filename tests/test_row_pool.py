"""RowPool (engine/row_pool.py): the rows and the pending queue TtsPool and SttPool share, with
fake jobs (no model, no wall time)."""

from __future__ import annotations

import asyncio

import pytest

from parley.engine.row_pool import PoolStopped, RowPool
from parley.engine.stream import OutputStream, Status, Terminal

CANCELLED = Terminal(Status.CANCELLED, "the client went away")
STOPPED = Terminal(Status.FAILED, "engine stopped")


class Full(RuntimeError):
    pass


class FakeJob:
    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = name
        self.stream = OutputStream(name, loop, 4)
        self.cancelled = False


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def pool_of(slots: int, **kw) -> RowPool:
    return RowPool(slots, lambda why: Full(why), **kw)


def enqueue(pool: RowPool, loop, name: str, **kw) -> FakeJob:
    return pool.enqueue(lambda: FakeJob(name, loop), **kw)


def test_admission_is_fifo_into_the_lowest_free_rows(loop):
    pool = pool_of(3)
    jobs = [enqueue(pool, loop, f"j{i}") for i in range(5)]
    assert pool.admit(lambda row, job: (row, job.request_id), CANCELLED) == 0
    assert pool.rows == [(0, "j0"), (1, "j1"), (2, "j2")] and pool.pending == 2 and pool.free == 0
    pool.release(1, Terminal(Status.COMPLETED))
    assert jobs[1].stream.terminal.status is Status.COMPLETED and pool.live == 2
    pool.admit(lambda row, job: (row, job.request_id), CANCELLED)
    assert pool.rows[1] == (1, "j3") and pool.job(1) is jobs[3] and pool.pending == 1


def test_front_leaves_the_job_queued_until_reserved(loop):
    pool = pool_of(2)
    first, second = enqueue(pool, loop, "a"), enqueue(pool, loop, "b")
    assert pool.front(CANCELLED) == (first, 0)
    assert pool.front(CANCELLED) == (first, 0)  # a declined admission finds it again
    row = pool.reserve(first)
    assert row == 0 and pool.rows[0] is None and pool.live == 1 and pool.pending == 1
    pool.place(row, "state")
    assert pool.rows[0] == "state" and pool.front(CANCELLED) == (second, 0)
    pool.reserve(second)
    assert pool.front(CANCELLED) == (None, 0)  # no row free


def test_the_pending_bound_raises_the_pools_error_and_builds_no_job(loop):
    made = []
    pool = pool_of(1, max_pending=2)
    for name in "ab":
        pool.enqueue(lambda name=name: made.append(name) or FakeJob(name, loop))
    with pytest.raises(Full, match="pending"):
        pool.enqueue(lambda: made.append("c") or FakeJob("c", loop))
    assert made == ["a", "b"] and pool.pending == 2


def test_reserved_rows_bound_pending_and_live_together(loop):
    pool = pool_of(2, reserve_rows=True)
    enqueue(pool, loop, "a")
    pool.admit(lambda row, job: job.request_id, CANCELLED)
    enqueue(pool, loop, "b")
    with pytest.raises(Full, match="rows"):
        enqueue(pool, loop, "c")
    pool.release(0, Terminal(Status.COMPLETED))
    enqueue(pool, loop, "c")


def test_a_job_that_needs_a_row_is_refused_unless_one_is_free_after_those_ahead(loop):
    pool = pool_of(2, max_pending=8)
    enqueue(pool, loop, "a", need_row=True)
    enqueue(pool, loop, "b", need_row=True)
    with pytest.raises(Full, match="rows"):
        enqueue(pool, loop, "c", need_row=True)
    enqueue(pool, loop, "d")  # one that can wait still queues


def test_cancel_of_a_pending_job_ends_it_when_it_reaches_the_front(loop):
    pool = pool_of(1)
    a, b, c = (enqueue(pool, loop, n) for n in "abc")
    a.cancelled = b.cancelled = True
    gone = Terminal(Status.CANCELLED, "cancelled before it started")
    assert pool.front(gone) == (c, 2)
    assert a.stream.terminal is gone and b.stream.terminal is gone and not c.stream.finished
    d, e = enqueue(pool, loop, "d"), enqueue(pool, loop, "e")
    d.cancelled = True
    assert pool.admit(lambda row, job: job.request_id, CANCELLED) == 0  # c takes the row; d waits
    pool.release(0, Terminal(Status.COMPLETED))
    assert pool.admit(lambda row, job: job.request_id, CANCELLED) == 1 and pool.rows == ["e"]
    assert d.stream.terminal is CANCELLED


def test_cancel_of_a_live_row_frees_it_and_counts_once(loop):
    pool = pool_of(2)
    a, b = enqueue(pool, loop, "a"), enqueue(pool, loop, "b")
    pool.admit(lambda row, job: job.request_id, CANCELLED)
    b.cancelled = True
    assert pool.release_ended(CANCELLED) == 1 and pool.rows == ["a", None] and pool.free == 1
    assert b.stream.terminal is CANCELLED and pool.release_ended(CANCELLED) == 0
    a.stream.finish(Terminal(Status.COMPLETED))  # ended elsewhere: freed, not counted
    assert pool.release_ended(CANCELLED) == 0 and pool.live == 0


def test_release_is_idempotent(loop):
    pool = pool_of(1)
    enqueue(pool, loop, "a")
    pool.admit(lambda row, job: job.request_id, CANCELLED)
    assert pool.release(0, Terminal(Status.COMPLETED)) is True
    assert pool.release(0, Terminal(Status.FAILED, "late")) is False and pool.free == 1


def test_end_rows_and_fail_job_end_only_their_jobs(loop):
    pool = pool_of(3)
    jobs = [enqueue(pool, loop, n) for n in "abcd"]
    pool.admit(lambda row, job: job.request_id, CANCELLED)
    failed = Terminal(Status.FAILED, "synthesis failed: RuntimeError")
    assert pool.end_rows([0, 2], failed) == 2 and pool.end_rows([0], failed) == 0
    assert [j.stream.terminal for j in jobs] == [failed, None, failed, None]
    row = pool.reserve(jobs[3])
    could_not = Terminal(Status.FAILED, "the request could not start: bad voice")
    pool.fail_job(jobs[3], could_not)  # admission raised after taking its row
    assert jobs[3].stream.terminal is could_not and pool.job(row) is None and pool.free == 2
    assert pool.end_rows(None, failed) == 1 and jobs[1].stream.terminal is failed and pool.live == 0


def test_stop_ends_every_live_and_pending_job_then_refuses(loop):
    pool = pool_of(2)
    jobs = [enqueue(pool, loop, n) for n in "abcd"]
    pool.admit(lambda row, job: job.request_id, CANCELLED)
    jobs[1].stream.finish(Terminal(Status.COMPLETED))  # already ended: not counted as ended by stop
    assert pool.stop(STOPPED) == (1, 2)
    assert [j.stream.terminal.status for j in jobs] == [Status.FAILED, Status.COMPLETED, Status.FAILED,
                                                         Status.FAILED]
    assert pool.live == 0 and pool.pending == 0 and pool.stopped is STOPPED
    with pytest.raises(PoolStopped) as stopped:
        enqueue(pool, loop, "e")
    assert stopped.value.terminal is STOPPED


def test_jobs_that_need_a_row_are_bounded_by_the_free_rows_not_the_pending_bound(loop):
    """A burst of live streams (need_row) arriving before the engine thread admits any fills the
    free rows: the pending bound is for jobs that wait, so it does not refuse them."""
    pool = pool_of(6, max_pending=2)
    live = [enqueue(pool, loop, f"live{i}", need_row=True) for i in range(6)]
    with pytest.raises(Full, match="rows"):
        enqueue(pool, loop, "one more", need_row=True)
    with pytest.raises(Full, match="pending"):
        enqueue(pool, loop, "upload")  # one that would wait: the pending bound
    assert pool.admit(lambda row, job: job.request_id, CANCELLED) == 0
    assert pool.rows == [job.request_id for job in live] and pool.pending == 0
