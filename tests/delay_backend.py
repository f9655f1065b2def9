"""A fabricated FrameBackend for tests of the engine and of the network edge (and the benchmarks
that time the edge without a model); a test double, so it lives with the tests, not in the product.

`DelayBackend` behaves like the echo model without any model: each row returns the
input frame it was given one step earlier (so outputs are a function of the row's own
input history only), its text token counts the frames the row has seen since its reset
(so a reused slot visibly starts clean), and the first step after a reset is not valid
(like the LM's one-frame acoustic delay). It follows the masking contract: rows outside
`live_mask` are left untouched.

Knobs for failure tests: samples outside [-1, 1] are refused per row (RowFailure), the
voice "unknown" is rejected at prefill (SessionRejected), the voice "crash" makes the
prompt's first chunk raise (a request-scoped failure), `fail_at_step` raises a fatal
error, `step_seconds` / `prefill_seconds` sleep to simulate slow work (a prompt of
`prompt_frames` frames, run in chunks like the real one), and `on_step` / `on_prefill` let a
test observe each call (or advance a fake clock: `FakeTime`). `queue_wait` makes each step's
output queued, like a CUDA step's, and runs when the engine waits for it (`to_host`).
`fail_rows` injects a one-shot error into one request-scoped phase of a row
({row: "sampling" | "start" | "chunk"}); like the model's
float32 / int64 setting tensors, `set_sampling` refuses values those cannot hold.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import torch

from parley.models.config import FRAME_SAMPLES

from parley.engine.backend import BackendOutput, HostOutput, RowFailure, SessionRejected
from parley.engine.config import MAX_TEMPERATURE, MAX_TOP_K, SamplingOptions, SessionOptions

FAIL_PHASES = ("sampling", "start", "chunk")


def serve_one_session(engine, ticks: int) -> None:
    """Open one session on a clocked engine that was not start()ed, serve the tick that admits it,
    then `ticks` more."""

    async def main() -> None:
        session = engine.open_nowait(SessionOptions())
        engine.serve_ticks(1)
        await session.ready
        engine.serve_ticks(ticks)

    asyncio.run(main())


class FakeTime:
    """A clock tests move by hand: `TickClock(period, now=fake.now, sleep=fake.sleep)`."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt


@dataclass
class _QueuedOutput(BackendOutput):
    wait: Callable[[], None] = lambda: None  # the device's time for the queued step

    def to_host(self) -> HostOutput:
        self.wait()
        return super().to_host()


class DelayBackend:
    def __init__(self, max_sessions: int, *, step_seconds: float = 0.0, prefill_seconds: float = 0.0,
                 prompt_frames: int = 1, fail_at_step: int | None = None,
                 on_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
                 on_prefill: Callable[[int, int], None] | None = None,
                 queue_wait: Callable[[], None] | None = None) -> None:
        self.max_sessions = max_sessions
        self.step_seconds = step_seconds
        self.prefill_seconds = prefill_seconds
        self.fail_at_step = fail_at_step
        self.on_step = on_step
        self.on_prefill = on_prefill  # (row, frames) per prompt chunk
        self.queue_wait = queue_wait
        self.prompt_frames = prompt_frames
        self.prev = torch.zeros(max_sessions, FRAME_SAMPLES)
        self.count = torch.zeros(max_sessions, dtype=torch.int64)
        self.sampling: list[SamplingOptions | None] = [None] * max_sessions
        self.steps = 0
        self.resets: list[int] = []  # rows reset, in order
        self.prefills: list[tuple[int, SessionOptions]] = []  # completed prompts
        self.prefill_chunks: list[tuple[int, int]] = []  # (row, frames) per chunk run
        self.close_calls = 0
        self.fail_rows: dict[int, str] = {}  # row -> phase that raises once (FAIL_PHASES)

    def step(self, frames: torch.Tensor, live_mask: torch.Tensor) -> BackendOutput:
        if self.on_step is not None:
            self.on_step(self.steps, frames, live_mask)
        if self.fail_at_step is not None and self.steps >= self.fail_at_step:
            raise RuntimeError("simulated device failure")
        bad = live_mask & (frames.abs() > 1.0).any(dim=1)
        if bad.any():  # refuse before touching any state, as the contract asks
            raise RowFailure({int(r): "samples outside [-1, 1]" for r in bad.nonzero().flatten()})
        if self.step_seconds:
            time.sleep(self.step_seconds)
        self.steps += 1
        outputs = dict(pcm=self.prev.clone(), text_tokens=self.count.clone(), valid=self.count >= 1)
        out = (BackendOutput(**outputs) if self.queue_wait is None
               else _QueuedOutput(**outputs, queued=True, wait=self.queue_wait))
        self.prev = torch.where(live_mask[:, None], frames, self.prev)
        self.count = torch.where(live_mask, self.count + 1, self.count)
        return out

    def reset_rows(self, mask: torch.Tensor) -> None:
        self.resets.extend(int(r) for r in mask.nonzero().flatten())
        self.prev[mask] = 0.0
        self.count[mask] = 0

    def _maybe_fail(self, row: int, phase: str) -> None:
        if self.fail_rows.get(row) == phase:
            del self.fail_rows[row]
            raise RuntimeError(f"simulated {phase} failure in row {row}")

    def set_sampling(self, row: int, sampling: SamplingOptions) -> None:
        self._maybe_fail(row, "sampling")
        for value, limit in ((sampling.text_temperature, MAX_TEMPERATURE), (sampling.audio_temperature,
                             MAX_TEMPERATURE), (sampling.text_top_k, MAX_TOP_K), (sampling.audio_top_k, MAX_TOP_K)):
            if value > limit:  # what torch's masked_fill_ raises for a value its dtype cannot hold
                raise RuntimeError("value cannot be converted to the tensor's type without overflow")
        self.sampling[row] = sampling

    def start_prefill(self, row: int, options: SessionOptions) -> "_DelayPrompt":
        if options.voice == "unknown":
            raise SessionRejected("voice 'unknown' is not one of this model's voices.")
        self._maybe_fail(row, "start")
        return _DelayPrompt(self, row, options)

    def warm_up_prefill(self, chunks: tuple[int, ...]) -> tuple[int, ...]:
        """Runs the sizes a prompt here can have (up to `prompt_frames`), costing what live chunks
        cost (`on_prefill` with row -1, `prefill_seconds`); records nothing."""
        ran = tuple(n for n in chunks if n <= self.prompt_frames)
        for n in ran:
            self._spend_prefill(-1, n)
        return ran

    def _spend_prefill(self, row: int, frames: int) -> None:
        """What a prompt chunk of `frames` frames costs here: `on_prefill`, then `prefill_seconds` pro rata."""
        if self.on_prefill is not None:
            self.on_prefill(row, frames)
        if self.prefill_seconds:
            time.sleep(self.prefill_seconds * frames / self.prompt_frames)

    def text_piece(self, token: int) -> str:
        return "" if token == 0 else f"<{token}>"

    def synchronize(self) -> None:
        pass  # host-only: nothing is queued

    def close(self) -> None:
        self.close_calls += 1


class _DelayPrompt:
    def __init__(self, backend: DelayBackend, row: int, options: SessionOptions) -> None:
        self.backend, self.row, self.options = backend, row, options
        self.frames_left = backend.prompt_frames

    def run(self, max_frames: int | None = None) -> None:
        n = self.frames_left if max_frames is None else min(max_frames, self.frames_left)
        if self.options.voice == "crash":
            raise RuntimeError("simulated prompt failure")
        backend = self.backend
        backend._maybe_fail(self.row, "chunk")
        backend.prefill_chunks.append((self.row, n))
        backend._spend_prefill(self.row, n)
        self.frames_left -= n
        if self.frames_left == 0:
            backend.prefills.append((self.row, self.options))
