"""The tick's device step (engine/engine.py): the batched backend step, paired transcription beside it,
and the one device->host copy; rows the backend refuses end alone and the step reruns without them."""

from __future__ import annotations

import time
from typing import Callable

from .backend import FrameBackend, HostOutput, RowFailure
from .scheduler import TickPlan
from .session import Session
from .stt_paired import PairedTranscription


class FrameStep:
    """Runs a tick's plan on the backend (engine thread). A `RowFailure` means those rows were refused
    before any state changed: their sessions fail (`fail_session`) and the step reruns for the rest
    (bounded: each retry removes a row)."""

    def __init__(self, backend: FrameBackend, max_sessions: int,
                 find_session: Callable[[str], Session | None],
                 fail_session: Callable[[Session, str], None]) -> None:
        self._backend = backend
        self._max_sessions = max_sessions
        self._find_session = find_session  # an open session by request id (None: gone)
        self._fail_session = fail_session
        self.paired: PairedTranscription | None = None  # STT rows beside the duplex rows
        self.launch_s = 0.0  # the last run's host time until its step was queued (the rest waited for the device)

    def run(self, plan: TickPlan, while_queued: Callable[[], None] | None = None) -> HostOutput | None:
        """The plan's live rows stepped; None when every live row was refused. `while_queued` runs
        between queuing a step on the device and waiting for it, when the step was queued."""
        for _ in range(self._max_sessions + 1):
            try:
                if self.paired is not None:
                    self.paired.prepare(plan)
                start = time.perf_counter()
                out = self._backend.step(plan.frames, plan.live_mask)
                if self.paired is not None:  # part of the frame: same codes, before the host copy
                    self.paired.step(plan, out)
                self.launch_s = time.perf_counter() - start
                if while_queued is not None and out.queued:
                    while_queued()
                host = out.to_host()
                if self.paired is not None:
                    self.paired.publish()
                return host
            except RowFailure as failure:
                for row, reason in failure.reasons.items():
                    rid = plan.request_ids[row]
                    session = self._find_session(rid) if rid is not None else None
                    if session is None or not plan.live_mask[row]:
                        raise RuntimeError(f"backend refused row {row}, which is not live") from failure
                    self._fail_session(session, f"input rejected: {reason}")
                    plan.live_mask[row] = False
                    plan.request_ids[row] = None
                if not plan.any_live:
                    return None
        raise RuntimeError("backend kept refusing rows")
