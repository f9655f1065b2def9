"""The engine's failure contract: a request's own work failing ends that request only.

Each request-scoped phase (its sampling settings, its prefill start, a prompt chunk) gets an
injected error in a visitor session while three others run; the visitor ends with
Terminal(FAILED) pointing to the server log (not the exception text), the engine stays healthy, the
others' outputs are bit-identical to a run without the visitor, and the slot serves the next
session cleanly. Only an error in the shared frame step is fatal (see test_engine_core).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from parley.engine import (
    Engine, EngineClosed, EngineConfig, FrameOut, OptionsError, SamplingOptions, SessionOptions, Status,
)
from delay_backend import FAIL_PHASES, DelayBackend
from parley.models.config import FRAME_SAMPLES

TICKS = 14


def signal(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, frames * FRAME_SAMPLES).astype(np.float32)


def run(visitor_options: SessionOptions | None, fail_phase: str | None = None):
    """Sessions a, b, c for TICKS ticks; optionally a visitor admitted at tick 3 (its `fail_phase`
    raising; closed at tick 7 if it did not fail), and a follow-up session at tick 8 that takes
    the same free slot."""

    async def main():
        backend = DelayBackend(4, prompt_frames=3)
        engine = Engine(backend, EngineConfig(input_frames=64, output_events=256))
        others = [engine.open_nowait(SessionOptions()) for _ in range(3)]
        engine.run_ticks(1)
        for i, s in enumerate(others):
            await asyncio.wait_for(s.ready, 1)
            s.push_audio(signal(i, TICKS))
        visitor = follow_up = None
        for tick in range(TICKS):
            if visitor_options is not None and tick == 3:
                visitor = engine.open_nowait(visitor_options)
                if fail_phase is not None:
                    backend.fail_rows[visitor.row] = fail_phase
                visitor.push_audio(signal(9, 4))
            if visitor is not None and tick == 7 and fail_phase is None:
                visitor.close()  # a visitor that did not fail leaves on its own
            if visitor_options is not None and tick == 8:
                follow_up = engine.open_nowait(SessionOptions())
                follow_up.push_audio(signal(10, 4))
            engine.run_ticks(1)
        outputs = [[(f.pcm.tobytes(), f.text_token, f.tick) for f in s.events.drain() if isinstance(f, FrameOut)]
                   for s in others]
        extra = None
        if visitor is not None:
            with pytest.raises(EngineClosed) if fail_phase else _no_error():
                await asyncio.wait_for(visitor.ready, 1)
            extra = (visitor, follow_up, engine.healthy, engine.counters())
        engine.shutdown()
        return outputs, extra

    return asyncio.run(main())


class _no_error:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("phase", FAIL_PHASES)
def test_a_failing_request_phase_ends_that_request_only(phase):
    baseline, _ = run(None)
    outputs, (visitor, follow_up, healthy, counters) = run(
        SessionOptions(sampling=SamplingOptions(text_temperature=0.5)), phase)
    assert healthy and counters["healthy"]
    assert outputs == baseline  # every other session: bit-identical audio, tokens and ticks
    assert all(len(o) == TICKS - 1 for o in outputs)  # and none of their frames was skipped
    (end,) = visitor.events.drain()  # no frames: only its Terminal
    assert end.status is Status.FAILED and "see the server log" in end.reason
    assert "simulated" not in end.reason  # the exception text stays in the log
    assert counters["sessions_failed"] == 1
    # The follow-up reuses the failed session's slot and starts clean (token count from 1).
    assert follow_up.row == visitor.row
    frames = [e for e in follow_up.events.drain() if isinstance(e, FrameOut)]
    assert frames and frames[0].text_token == 1
    np.testing.assert_array_equal(frames[0].pcm, signal(10, 4)[:FRAME_SAMPLES])


def test_a_visitor_that_does_not_fail_leaves_others_bit_identical_too():
    baseline, _ = run(None)
    outputs, (visitor, _, healthy, _) = run(SessionOptions())
    assert healthy and outputs == baseline
    assert [e for e in visitor.events.drain() if isinstance(e, FrameOut)]  # it was served


@pytest.mark.parametrize("field, value", [
    ("text_temperature", 1e39), ("audio_temperature", 4e38), ("text_top_k", 10**19),
    ("audio_top_k", 2**63), ("audio_top_k", int(1e30)),
])
def test_settings_the_model_cannot_hold_are_refused_before_the_engine(field, value):
    """The critical case: these once reached the GPU and killed the engine for everyone."""
    with pytest.raises(OptionsError, match=field):
        SamplingOptions(**{field: value})


def test_the_largest_representable_settings_are_served():
    """At the limits the values are honoured (top-k at or past the vocabulary: no restriction)."""
    backend = DelayBackend(1)
    engine = Engine(backend)
    sampling = SamplingOptions(text_temperature=3.4e38, audio_temperature=3.4e38, text_top_k=2**63 - 1,
                               audio_top_k=2**63 - 1)

    async def main():
        s = engine.open_nowait(SessionOptions(sampling=sampling))
        engine.run_ticks(1)
        assert await asyncio.wait_for(s.ready, 1) is s

    asyncio.run(main())
    assert engine.healthy and backend.sampling[0] == sampling
    engine.shutdown()
