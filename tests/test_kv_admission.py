"""Admission by KV memory (engine/kv_blocks.py) through the engine and the network edge, on the
fabricated echo backend: the engine maps blocks before the steps that need them and frees them
when a row ends; a server whose KV budget holds N sessions refuses the N+1th with HTTP 503
before the upgrade (one log line, counted) while the N others' output is what it would have been.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from parley.engine import Engine, EngineConfig, EngineFull, SessionOptions
from parley.engine.kv_blocks import KvBlockPool, KvChanges, KvFull, KvLayout
from delay_backend import DelayBackend
from parley.models.config import FRAME_SAMPLES
from parley.realtime.server.app import create_app
from parley.realtime.server.services import ServerInfo, Services
from parley.realtime.sessions.session import ServerDefaults
from server_harness import serve, wait_for
from test_capacity import get_json, http, upgrade

N = FRAME_SAMPLES
# A 40-frame window in 4 blocks of 10; a budget of 8 blocks holds 2 sessions under reserve.
LAYOUT = KvLayout(window_frames=40, block_frames=10, block_bytes=1024)


class PagedDelayBackend(DelayBackend):
    """DelayBackend with a block table: records the pool's changes with the step count they came before."""

    def __init__(self, max_sessions: int) -> None:
        super().__init__(max_sessions)
        self.kv_calls: list[tuple[int, KvChanges]] = []

    def map_kv_blocks(self, changes: KvChanges) -> None:
        self.kv_calls.append((self.steps, changes))


def signal(seed: int, frames: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.9, 0.9, frames * N).astype(np.float32)


def run_two_and_maybe_a_third(third: bool):
    async def main():
        backend = PagedDelayBackend(4)
        engine = Engine(backend, EngineConfig(input_frames=64, output_events=256), kv=KvBlockPool(LAYOUT, 4, 8))
        a, b = engine.open_nowait(SessionOptions()), engine.open_nowait(SessionOptions())
        engine.run_ticks(1)
        await asyncio.wait_for(asyncio.gather(a.ready, b.ready), 1)
        a.push_audio(signal(0, 30))
        b.push_audio(signal(1, 30))
        refused = None
        for tick in range(30):
            if third and tick == 5:
                with pytest.raises(KvFull) as refused:
                    engine.open_nowait(SessionOptions())
            engine.run_ticks(1)
        outputs = [[(f.pcm, f.text_token) for f in s.events.drain() if hasattr(f, "pcm")] for s in (a, b)]
        counters = engine.counters()
        a.close()
        engine.run_ticks(1)
        c = engine.open_nowait(SessionOptions())  # a's blocks are free again: a third fits now
        engine.run_ticks(1)
        await asyncio.wait_for(c.ready, 1)
        engine.shutdown()
        return outputs, refused, counters, backend.kv_calls, (a.row, c.row)

    return asyncio.run(main())


def test_the_engine_maps_blocks_on_boundaries_and_frees_them_when_a_row_ends():
    outputs, _, counters, calls, (row_a, row_c) = run_two_and_maybe_a_third(third=False)
    assigned = [(steps, row, logical) for steps, ch in calls for row, logical, _ in ch.assigned if steps < 30]
    # A row's 1-frame prompt (position 0) takes block 0 when it starts, before any step; the step
    # before position p (steps run == p - 1) takes block p // 10 at p = 10, 20, 30.
    assert assigned == [(steps, row, j) for steps, j in ((0, 0), (9, 1), (19, 2), (29, 3)) for row in (0, 1)]
    assert (counters["kv_blocks_total"], counters["kv_blocks_used"], counters["kv_blocks_free"]) == (8, 8, 0)
    assert counters["kv_sessions_admittable"] == 0 and counters["kv_shortfalls"] == 0
    released = [row for _, ch in calls for row in ch.released]
    assert released == [row_a] and row_c == row_a  # a's row and blocks went to the next session


def test_a_session_the_memory_cannot_hold_is_refused_and_the_others_output_is_unchanged():
    alone, _, _, _, _ = run_two_and_maybe_a_third(third=False)
    beside, refused, _, _, _ = run_two_and_maybe_a_third(third=True)
    assert isinstance(refused.value, EngineFull) and "cannot hold another session" in str(refused.value)
    for mine, reference in zip(beside, alone):
        assert len(mine) == len(reference) == 29
        for (pcm, token), (ref_pcm, ref_token) in zip(mine, reference):
            assert token == ref_token and np.array_equal(pcm, ref_pcm)


def kv_app(rows: int, blocks: int):
    backend = PagedDelayBackend(rows)
    engine = Engine(backend, kv=KvBlockPool(LAYOUT, rows, blocks))
    return create_app(Services(engine, ServerDefaults(), ServerInfo(model="delay"), codec_workers=0))


def test_a_server_refuses_past_its_kv_budget_with_503_a_log_line_and_reports_blocks(caplog):
    caplog.set_level(logging.INFO, logger="parley.refusals")
    app = kv_app(rows=4, blocks=8)  # 4 slots, memory for 2
    with serve(app) as base:
        asyncio.run(wait_for(lambda: get_json(base, "/readyz")[0] == 200, 10))
        load = get_json(base, "/load")[1]
        assert (load["free"], load["kv_blocks_total"], load["kv_blocks_used"], load["kv_blocks_free"]) == (2, 8, 0, 8)

        async def three():
            first, second = await upgrade(base, "/api/chat"), await upgrade(base, "/api/chat")
            assert first[0] == second[0] == "admitted"
            await asyncio.sleep(0.3)  # a few ticks: each live row holds its first block
            load = (await asyncio.to_thread(get_json, base, "/load"))[1]
            readyz = (await asyncio.to_thread(get_json, base, "/readyz"))[0]
            third = await upgrade(base, "/api/chat")
            metrics = (await asyncio.to_thread(http, base, "/metrics"))[2]
            for _, (ws, _) in (first, second):
                await ws.close()
            return load, readyz, third, metrics

        load, readyz, third, metrics = asyncio.run(three())
        assert (load["live"], load["free"], load["kv_blocks_used"], load["kv_blocks_free"]) == (2, 0, 2, 6)
        assert readyz == 503  # no session fits: a balancer sends the next one elsewhere
        assert third[0] == "refused"
        status, retry_after, body = third[1]
        assert (status, retry_after, body["reason"]) == (503, "1", "memory")
        assert "cannot hold another session" in body["error"]
        for line in ('parley_admission_rejected_total{reason="memory"} 1.0',
                     'parley_refusals_total{door="/api/chat",reason="memory"} 1.0',
                     "parley_engine_kv_blocks_total 8.0", "parley_engine_kv_blocks_used 2.0",
                     "parley_engine_kv_blocks_free 6.0", "parley_engine_kv_sessions_admittable 0.0"):
            assert line in metrics, line
        refusals = [r.getMessage() for r in caplog.records if r.name == "parley.refusals"]
        assert len(refusals) == 1 and "memory" in refusals[0] and "/api/chat" in refusals[0]
        asyncio.run(wait_for(lambda: get_json(base, "/load")[1]["kv_blocks_used"] == 0, 10))
        assert get_json(base, "/load")[1]["free"] == 2
