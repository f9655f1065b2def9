"""The KV block pool (engine/kv_blocks.py): exact block counts, no model, no clock."""

from __future__ import annotations

import pytest

from parley.engine.config import OptionsError
from parley.engine.kv_blocks import KvBlockPool, KvFull, KvLayout, KvSettings

# A 40-frame window in blocks of 10: 4 blocks a full window; each block 1 KiB.
LAYOUT = KvLayout(window_frames=40, block_frames=10, block_bytes=1024)


def pool(total: int, rows: int = 4, policy: str = "reserve") -> KvBlockPool:
    return KvBlockPool(LAYOUT, rows, total, policy)


def run(p: KvBlockPool, ids: list[str | None], ticks: int) -> list:
    changes = []
    for _ in range(ticks):
        changes.append(p.step(ids))
    return changes


def test_blocks_for_rounds_up_and_stops_at_a_window():
    p = pool(8)
    assert [p.blocks_for(f) for f in (0, 1, 10, 11, 39, 40, 41, 1000)] == [0, 1, 1, 2, 4, 4, 4, 4]


def test_a_row_takes_a_block_on_each_boundary_only():
    p = pool(8)
    p.admit(0, "a")
    assert not p.start(0, "a", 0)
    got = [p.step(["a"]).assigned for _ in range(25)]
    assert [t for t, a in enumerate(got) if a] == [0, 10, 20]  # positions 0, 10, 20
    assert got[0] == [(0, 0, 1)] and got[10] == [(0, 1, 2)] and got[20] == [(0, 2, 3)]
    c = p.counters()
    assert (c.used, c.free, c.high_water) == (3, 5, 3)


def test_a_prompt_takes_its_blocks_at_start_and_steps_go_on_after_it():
    p = pool(8)
    p.admit(1, "a")
    changes = p.start(1, "a", 23)  # positions 0..22: blocks 0, 1, 2
    assert changes.assigned == [(1, 0, 1), (1, 1, 2), (1, 2, 3)]
    assert run(p, [None, "a"], 7)[-1].assigned == []  # positions 23..29
    assert p.step([None, "a"]).assigned == [(1, 3, 4)]  # position 30


def test_a_wrapped_row_reuses_its_own_blocks():
    p = pool(8)
    p.admit(0, "a")
    p.start(0, "a", 0)
    run(p, ["a"], 40)
    assert p.held(0) == {0: 1, 1: 2, 2: 3, 3: 4}
    after = run(p, ["a"], 100)  # positions 40..139: round the ring twice more
    assert not any(after) and p.counters().used == 4


def test_a_block_that_does_not_divide_the_window_leaves_its_last_block_partly_used():
    """40 frames in blocks of 12: logical blocks 0..3 start at positions 0, 12, 24, 36; the ring
    wraps at 40 into block 0, and a full window is 4 blocks."""
    p = KvBlockPool(KvLayout(window_frames=40, block_frames=12, block_bytes=1024), 2, 8)
    assert p.blocks_for(37) == 4 and p.blocks_for(1000) == 4
    p.admit(0, "a")
    p.start(0, "a", 0)
    got = [p.step(["a"]).assigned for _ in range(45)]
    assert [t for t, a in enumerate(got) if a] == [0, 12, 24, 36]
    assert p.held(0) == {0: 1, 1: 2, 2: 3, 3: 4} and p.counters().used == 4  # positions 40..44 reuse block 0
    small = KvBlockPool(KvLayout(window_frames=40, block_frames=12, block_bytes=1024), 2, 7)
    small.admit(0, "b")  # reserve: a full window is 4 blocks, so 7 hold one session, not two
    with pytest.raises(KvFull):
        small.admit(1, "c")


def test_release_frees_blocks_at_the_next_engine_call_with_the_row_released_first():
    p = pool(8)
    p.admit(0, "a")
    p.admit(1, "b")
    p.start(0, "a", 15)
    p.start(1, "b", 0)
    p.end(0, "a")
    assert p.counters().used == 2  # still held until the engine thread collects them
    changes = p.step([None, "b"])
    assert changes.released == [0] and changes.assigned == [(1, 0, 1)]  # freed blocks go first
    assert p.counters().used == 1
    p.end(0, "a")  # idempotent
    p.end(1, "someone else")  # not the row's session: nothing
    assert p.counters().used == 1


def test_an_ended_rows_blocks_go_back_before_the_next_session_on_that_row_starts():
    p = pool(4)
    p.admit(0, "a")
    p.start(0, "a", 40)
    p.end(0, "a")
    p.admit(0, "b")
    changes = p.start(0, "b", 12)
    assert changes.released == [0] and changes.assigned == [(0, 0, 1), (0, 1, 2)]


def test_a_row_the_tick_runs_after_its_session_ended_takes_nothing():
    p = pool(8)
    p.admit(0, "a")
    p.start(0, "a", 0)
    p.step(["a"])
    p.end(0, "a")
    p.admit(0, "b")  # the row is reused before the tick the old session was planned in
    changes = p.step(["a"])
    assert changes.released == [0] and changes.assigned == []
    assert p.held(0) == {}


def test_reserve_admits_full_windows_only():
    p = pool(10)  # 2 full windows and a half
    p.admit(0, "a")
    assert p.admittable() == 1 and p.admittable(pending=1) == 0
    p.admit(1, "b")
    with pytest.raises(KvFull, match="cannot hold another session"):
        p.admit(2, "c")
    p.end(0, "a")
    assert p.admittable() == 1  # the promise goes at once, before the blocks are collected
    p.admit(2, "c")


def test_reserve_never_runs_short():
    p = pool(8, rows=2)
    for row, rid in enumerate("ab"):
        p.admit(row, rid)
        p.start(row, rid, 0)
    run(p, ["a", "b"], 200)
    c = p.counters()
    assert (c.used, c.free, c.shortfalls, c.shrinks) == (8, 0, 0, 0)


def test_shrink_admits_by_expected_share_and_floor():
    p = pool(8, rows=8, policy="shrink")  # expected 2 blocks, floor 1
    for row in range(4):
        p.admit(row, f"s{row}")
    assert p.admittable() == 0  # 4 x 2 expected blocks: the pool is promised
    with pytest.raises(KvFull):
        p.admit(4, "s4")
    p.start(0, "s0", 0)
    run(p, ["s0"], 1)  # s0 holds 1 of its expected 2: still 7 free, 7 - 7 growth = 0
    assert p.admittable() == 0


def test_shrink_takes_the_longest_rows_oldest_block_and_shortens_its_window():
    p = pool(6, rows=3, policy="shrink")  # expected 2, floor 1, 6 blocks
    for row, rid in enumerate("abc"):
        p.admit(row, rid)
    p.start(0, "a", 35)  # a: logical 0..3 in physical 1..4
    p.start(1, "b", 0)
    p.start(2, "c", 0)
    run(p, [None, "b", "c"], 1)  # b and c take one each: the pool is empty
    assert p.counters().free == 0
    changes = run(p, [None, "b", "c"], 10)[-1]  # b, then c, cross into logical block 1
    # a, the longest, gives its oldest block to each: logical 0 (physical 1), then logical 1 (2)
    assert changes.forgotten == [(0, 0), (0, 1)]
    assert changes.assigned == [(1, 1, 1), (2, 1, 2)]
    assert p.window(0) == 2 and p.held(0) == {2: 3, 3: 4}
    c = p.counters()
    assert (c.shrinks, c.used, c.shortfalls) == (2, 6, 0)
    run(p, [None, "b", "c"], 30)  # b and c wrap: they would hold 8 blocks, 6 exist; a keeps its floor (1)
    assert p.held(0) == {3: 4} and p.window(0) == 1
    assert len(p.held(1)) + len(p.held(2)) == 5 and p.counters().shortfalls == 0


def test_a_shrunk_row_reuses_its_own_oldest_block_when_its_ring_comes_round():
    p = pool(5, rows=2, policy="shrink")
    p.admit(0, "a")
    p.admit(1, "b")
    p.start(0, "a", 35)  # positions 0..34: logical 0..3 in physical 1..4
    p.start(1, "b", 0)
    p.step(["a", "b"])  # b takes physical 5, the last free block
    changes = run(p, ["a", "b"], 10)[-1]  # a writes 45 (logical 0, wrapped); b writes 10 (logical 1)
    assert changes.forgotten == [(0, 1)]  # a's oldest whole block: logical 1 (positions 10..19)
    assert changes.assigned == [(1, 1, 2)] and p.window(0) == 3
    changes = run(p, ["a", "b"], 5)[-1]  # a writes 50: logical 1 again, beyond its 3-block window
    assert changes.forgotten == [(0, 2)] and changes.assigned == [(0, 1, 3)]
    assert p.window(0) == 3 and p.counters().shrinks == 1  # its own block: no other row shrank


def test_settings_are_checked_and_size_the_pool():
    with pytest.raises(OptionsError, match="kv_policy"):
        KvSettings(policy="lru")
    with pytest.raises(OptionsError, match="kv_attention must be one of parley, flashinfer"):
        KvSettings(attention="sdpa")
    with pytest.raises(OptionsError, match="give one of them"):
        KvSettings(blocks=4, memory_gib=1.0)
    with pytest.raises(OptionsError, match="kv_blocks"):
        KvSettings(blocks=0)
    assert KvSettings().budget(LAYOUT, rows=3) == 12  # every row a full window
    assert KvSettings(blocks=9).budget(LAYOUT, rows=3) == 9
    assert KvSettings(memory_gib=10 * 1024 / 2**30).budget(LAYOUT, rows=3) == 10
    assert KvSettings(blocks=100).budget(LAYOUT, rows=3) == 12  # no row holds more than a window
    with pytest.raises(OptionsError, match="cannot hold one session"):
        KvSettings(blocks=3).budget(LAYOUT, rows=3)
    assert KvSettings(policy="shrink", blocks=1).budget(LAYOUT, rows=3) == 1
    assert KvLayout(40, 12, 1024).window_blocks == 4  # 3 blocks of 12 and one of 4 slots used
    for bad in (0, 41):
        with pytest.raises(OptionsError, match="1 .. the 40-frame window"):
            KvLayout(40, bad, 1024)
