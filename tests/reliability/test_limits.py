"""The limit bookkeeping on its own, with a fake clock: rates, bursts, lag, JSON depth, budget."""

from __future__ import annotations

import json

import pytest

from parley.realtime.sessions.limits import (
    BURST_SECONDS, ConversationBudget, EdgeLimits, JSONLimitError, LagMeter, RateLimiter, parse_json_event,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_message_rate_allows_bursts_and_refuses_floods():
    clock = Clock()
    limiter = RateLimiter(EdgeLimits(max_messages_per_s=10), clock)
    assert all(limiter.admit(1) is None for _ in range(int(10 * BURST_SECONDS)))  # a full burst passes
    assert limiter.admit(1) == "message rate over 10/s"
    clock.t += 0.5  # refills at the rate: 5 more
    assert all(limiter.admit(1) is None for _ in range(5))
    assert limiter.admit(1) is not None


def test_byte_rate_and_a_largest_event_always_fits_a_burst():
    clock = Clock()
    limits = EdgeLimits(max_bytes_per_s=1000, max_event_bytes=8000)
    limiter = RateLimiter(limits, clock)
    assert limiter.admit(8000) is None  # one largest event, even past the byte rate's burst
    assert limiter.admit(1) == "byte rate over 4000 B/s"


def test_lag_counts_frame_age_and_the_send_backlog_in_the_clients_own_bytes_per_frame():
    clock = Clock()
    backlog = [0]
    meter = LagMeter(1.0, 0.08, lambda: backlog[0], clock)
    assert not meter.should_drop(clock.t)
    for _ in range(10):
        meter.sent(500)  # 500 bytes per frame
    backlog[0] = 500 * 12  # 12 frames queued: 0.96 s
    assert not meter.should_drop(clock.t)
    backlog[0] = 500 * 13  # 1.04 s
    assert meter.should_drop(clock.t) and meter.dropped == 1
    backlog[0] = 0
    assert meter.should_drop(clock.t - 1.2)  # a frame that waited 1.2 s before its send
    assert not meter.should_drop(clock.t - 0.5)
    assert meter.dropped == 2


def test_lag_without_a_backlog_source_uses_the_age_only():
    clock = Clock()
    meter = LagMeter(1.0, 0.08, None, clock)
    meter.sent(100)
    assert not meter.should_drop(clock.t - 0.9) and meter.should_drop(clock.t - 1.1)


def test_json_limits():
    limits = EdgeLimits(max_event_bytes=1000, max_json_depth=4)
    assert parse_json_event('{"a":[{"b":[1]}]}', limits) == {"a": [{"b": [1]}]}  # depth 4
    with pytest.raises(JSONLimitError, match="deeper than 4") as deep:
        parse_json_event('{"a":[{"b":[[1]]}]}', limits)
    assert deep.value.code == "invalid_json"
    with pytest.raises(JSONLimitError, match="deeper") as recursion:  # the decoder's RecursionError
        parse_json_event("[" * 200_000 + "]" * 200_000, EdgeLimits(max_event_bytes=10**6))
    assert recursion.value.code == "invalid_json"
    with pytest.raises(JSONLimitError) as big:
        parse_json_event(json.dumps({"x": "y" * 1000}), limits)
    assert big.value.code == "message_too_large"
    with pytest.raises(json.JSONDecodeError):
        parse_json_event("{nope", limits)


def test_conversation_budget():
    budget = ConversationBudget(100)
    assert budget.fits("a", 60)
    budget.set("a", 60)
    assert not budget.fits("b", 50) and budget.fits("b", 40)
    assert budget.fits("a", 100)  # replacing an item counts only its new size
    budget.set("a", 30)
    assert budget.used == 30
    budget.discard("a")
    budget.discard("missing")
    assert budget.used == 0


@pytest.mark.parametrize("field, value", [("max_messages_per_s", 0), ("max_bytes_per_s", float("inf")),
                                          ("max_lag_s", -1), ("max_json_depth", 0), ("max_event_bytes", True)])
def test_limits_refuse_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        EdgeLimits(**{field: value})
