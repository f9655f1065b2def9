"""The row half of a slack source: the rows a pool's requests run in, and the queue they wait in.

    pool = RowPool(slots=4, full=lambda why: Busy(...), max_pending=64)
    job = pool.enqueue(lambda: Job(...))           # event loop; the `full` error, or PoolStopped
    row = pool.reserve(job); pool.place(row, state) # engine thread: the front job takes the lowest free row
    pool.release(row, Terminal(Status.COMPLETED))   # the row is free again, the job's stream ended
    pool.stop(terminal)                             # the engine is gone: every live and pending job ends

A pool (engine/tts_pool.py, engine/stt_pool.py) keeps only what is its own: the model step,
what a row's state is (`rows[i]`, any object), and what a row's output is. What they share lives
here, once:
- Rows follow SlotTable's rules (engine/slots.py): fixed at start, the lowest free row first (runs
  are reproducible and a bucketed step over the lowest rows stays small), each owned by one job,
  released idempotently by its owner.
- Pending jobs wait in one FIFO queue, bounded: `max_pending` jobs waiting at most (a job that
  needs a row now, `need_row`, only by the rows free for it), and with
  `reserve_rows` the waiting and the live together at most `slots` (a request is refused unless
  a row is left for it). A full pool raises the pool's own `full(why)` error at once ("pending": the
  queue is at its bound; "rows": no row is left), never waits.
- Cancel is a flag on the job (any thread); the engine thread acts on it: a pending job ends
  when it reaches the front of the queue with a row free (`front`, `admit`), a live one at the next
  `release_ended`.
- Failure terminals: `end_rows` (a step that raised: its rows), `fail_job` (an admission that
  raised), `stop` (the engine stopped: every live and pending job, and later enqueues raise
  PoolStopped carrying the terminal).
A job is any object with `request_id`, `cancelled` and `stream` (its OutputStream). Counting is
the pool's: each method returns how many jobs it ended.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Generic, Iterable, Protocol, TypeVar

from .slots import SlotTable
from .stream import OutputStream, Terminal


class Job(Protocol):
    request_id: str
    cancelled: bool
    stream: OutputStream


J = TypeVar("J", bound=Job)
R = TypeVar("R")


class PoolStopped(Exception):
    """The pool's engine has stopped: nothing will run a new job. `terminal` is what it ended with."""

    def __init__(self, terminal: Terminal) -> None:
        super().__init__(terminal.reason)
        self.terminal = terminal


class RowPool(Generic[J, R]):
    def __init__(self, slots: int, full: Callable[[str], Exception], *, max_pending: int | None = None,
                 reserve_rows: bool = False) -> None:
        self.slots = slots
        self.max_pending = max_pending
        self._full = full
        self._reserve_rows = reserve_rows
        self._table = SlotTable(slots)
        self._jobs: list[J | None] = [None] * slots
        self.rows: list[R | None] = [None] * slots  # each row's state (the pool's own type)
        self._pending: deque[J] = deque()
        self._lock = threading.Lock()
        self._stopped: Terminal | None = None

    # ---- event loop side ----

    def enqueue(self, make: Callable[[], J], *, need_row: bool = False) -> J:
        """Queue the job `make()` builds (called only once it is accepted). `need_row`: refused
        unless a row is free for it now, counting the jobs ahead of it (a live stream cannot wait)."""
        with self._lock:
            if self._stopped is not None:
                raise PoolStopped(self._stopped)
            # The bound is on jobs that wait for a row; one that needs a row now is bounded by the
            # free rows below (a burst of live streams into free rows is not refused as a queue).
            if not need_row and self.max_pending is not None and len(self._pending) >= self.max_pending:
                raise self._full("pending")
            if self._reserve_rows and len(self._pending) + self._table.live >= self.slots:
                raise self._full("rows")
            if need_row and self._table.free <= len(self._pending):
                raise self._full("rows")
            job = make()
            self._pending.append(job)
            return job

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def live(self) -> int:
        """Rows owned by a job."""
        return self._table.live

    @property
    def free(self) -> int:
        return self._table.free

    @property
    def takeable(self) -> int:
        """Rows a new job could take now: neither live nor promised to a waiting job."""
        return max(0, self.slots - self.live - self.pending)

    @property
    def stopped(self) -> Terminal | None:
        return self._stopped

    def job(self, row: int) -> J | None:
        return self._jobs[row]

    # ---- engine thread ----

    def front(self, cancelled: Terminal) -> tuple[J | None, int]:
        """The next job to admit, left in the queue (an admission item may be declined and must
        find it again), or None when no row is free or nothing waits; cancelled jobs met at the
        front end with `cancelled`. Returns (that job, how many cancelled jobs ended)."""
        ended = 0
        if not self._table.free:
            return None, ended
        with self._lock:
            while self._pending:
                job = self._pending[0]
                if not job.cancelled:
                    return job, ended
                self._pending.popleft()
                job.stream.finish(cancelled)
                ended += 1
        return None, ended

    def reserve(self, job: J) -> int:
        """Take `job` out of the queue into the lowest free row; returns the row (its state is
        None until `place`)."""
        with self._lock:
            self._pending.remove(job)
            row = self._table.acquire(job.request_id)
            self._jobs[row] = job
        return row

    def place(self, row: int, state: R) -> None:
        self.rows[row] = state

    def admit(self, start: Callable[[int, J], R], cancelled: Terminal) -> int:
        """Every free row takes the next job in the queue, in order (`start(row, job)` makes its
        state); cancelled jobs end with `cancelled` instead. Returns how many of those ended."""
        ended = 0
        with self._lock:
            while self._table.free and self._pending:
                job = self._pending.popleft()
                if job.cancelled:
                    job.stream.finish(cancelled)
                    ended += 1
                    continue
                row = self._table.acquire(job.request_id)
                self._jobs[row] = job
                self.rows[row] = start(row, job)
        return ended

    def release(self, row: int, terminal: Terminal | None = None) -> bool:
        """Free `row` (no-op if no job owns it) and end its job's stream with `terminal`, if
        given. Returns whether this call ended the stream."""
        job = self._jobs[row]
        if job is None:
            return False
        self.rows[row] = None
        self._jobs[row] = None
        self._table.release(row, job.request_id)
        return terminal is not None and job.stream.finish(terminal)

    def release_ended(self, cancelled: Terminal) -> int:
        """Free the rows whose job was cancelled (its stream ends with `cancelled`) or whose
        stream has ended. Returns how many cancelled jobs this ended."""
        ended = 0
        for row, job in enumerate(self._jobs):
            if job is None:
                continue
            if job.cancelled and job.stream.finish(cancelled):
                ended += 1
            if job.stream.finished:
                self.release(row)
        return ended

    def end_rows(self, rows: Iterable[int] | None, terminal: Terminal) -> int:
        """End the jobs in `rows` (None: every row) with `terminal` (a step they shared raised).
        Returns how many rows were live."""
        ended = 0
        for row in range(self.slots) if rows is None else rows:
            if self._jobs[row] is not None:
                self.release(row, terminal)
                ended += 1
        return ended

    def fail_job(self, job: J, terminal: Terminal) -> None:
        """An admission of `job` raised: wherever it is (queued, or in the row it took), it ends."""
        with self._lock:
            if job in self._pending:
                self._pending.remove(job)
        for row, owner in enumerate(self._jobs):
            if owner is job:
                self.release(row)
        job.stream.finish(terminal)

    def stop(self, terminal: Terminal) -> tuple[int, int]:
        """The engine stopped: every live job, then every pending one, ends with `terminal`, and
        later `enqueue` calls raise PoolStopped. Returns (live jobs whose stream this ended,
        pending jobs ended)."""
        with self._lock:
            self._stopped = terminal
            pending, self._pending = list(self._pending), deque()
        live = sum(self.release(row, terminal) for row in range(self.slots))
        for job in pending:
            job.stream.finish(terminal)
        return live, len(pending)
