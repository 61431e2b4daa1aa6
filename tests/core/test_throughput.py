"""The capacity a replica sustained while backlogged (agent/throughput.py)."""

from __future__ import annotations

import pytest

from agent.errors import ConfigError
from agent.speed import SpeedProfile
from agent.throughput import (BACKLOG_META_KEYS, MAX_BACKLOG_BATCH, MAX_BACKLOG_RPS,
                              MAX_MEAN_TOKENS, MIN_BACKLOG_RPS, BacklogCapacity, BacklogMeter)

PROFILE = SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.01,
                       decode_base_s=0.02, decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def meter(**kw):
    clock = Clock()
    return BacklogMeter(clock=clock, **kw), clock


def test_nothing_is_reported_before_enough_backlog_was_seen():
    m, clock = meter(min_s=2.0, min_departures=8)
    m.tick([], backlog=True, batch=4)
    for _ in range(7):                    # 7 departures over 1.4 s
        clock.t += 0.2
        m.tick([(10, 1)], backlog=True, batch=4)
    assert m.capacity() is None
    for _ in range(3):
        clock.t += 0.2
        m.tick([(10, 1)], backlog=True, batch=4)
    got = m.capacity()
    assert got is not None
    assert got.rps == pytest.approx(10 / 2.0)
    assert got.seconds == pytest.approx(2.0)
    assert got.batch == pytest.approx(4.0)
    assert (got.prompt_tokens, got.gen_tokens) == (10.0, 1.0)


def test_only_intervals_that_began_backlogged_count():
    m, clock = meter(min_s=1.0, min_departures=1)
    m.tick([], backlog=False, batch=1)
    clock.t += 5.0                        # idle, then a tick that found one request
    m.tick([(4, 2)], backlog=False, batch=1)
    assert m.capacity() is None           # nothing was left over: not saturated
    m.tick([], backlog=True, batch=2)     # no time passed: nothing yet
    clock.t += 0.5
    m.tick([(4, 2), (6, 2)], backlog=True, batch=2)
    clock.t += 0.5
    m.tick([(8, 2)], backlog=False, batch=2)   # its interval began backlogged: counted
    clock.t += 3.0
    m.tick([(100, 100)], backlog=False, batch=1)   # began idle: not counted
    got = m.capacity()
    assert got.rps == pytest.approx(3 / 1.0)
    assert got.prompt_tokens == pytest.approx(6.0)


def test_idle_ends_an_interval_so_the_wait_is_not_counted():
    m, clock = meter(min_s=0.05, min_departures=1)
    m.tick([], backlog=True, batch=1)
    clock.t += 0.1
    m.tick([(1, 1)], backlog=True, batch=1)
    m.idle()                              # the loop ran dry (a cancel emptied it)
    clock.t += 10.0
    m.tick([(1, 1)], backlog=True, batch=1)
    got = m.capacity()
    assert got.seconds == pytest.approx(0.1) and got.rps == pytest.approx(10.0)


def test_the_window_keeps_the_newest_backlogged_seconds():
    m, clock = meter(window_s=10.0, min_s=1.0, min_departures=1)
    m.tick([], backlog=True, batch=1)
    for _ in range(10):                   # 10 s at 2 requests/s
        clock.t += 1.0
        m.tick([(1, 1)] * 2, backlog=True, batch=1)
    for _ in range(10):                   # then 10 s at 6 requests/s: the first 10 s leave
        clock.t += 1.0
        m.tick([(1, 1)] * 6, backlog=True, batch=1)
    assert m.capacity().rps == pytest.approx(6.0)
    assert m.capacity().seconds == pytest.approx(10.0)


def test_a_clock_that_does_not_advance_adds_nothing():
    m, clock = meter(min_s=0.1, min_departures=1)
    m.tick([], backlog=True, batch=1)
    m.tick([(1, 1)], backlog=True, batch=1)
    assert m.capacity() is None


@pytest.mark.parametrize("kw", [{"window_s": 0}, {"min_s": -1.0}, {"min_departures": 0},
                                {"window_s": float("inf")}])
def test_meter_limits_are_checked(kw):
    with pytest.raises(ConfigError):
        BacklogMeter(**kw)


def test_conversion_to_another_shape_follows_the_profiles_ratio():
    c = BacklogCapacity(rps=20.0, seconds=5.0, batch=4.0, prompt_tokens=10.0, gen_tokens=1.0)
    assert c.rps_at(None, 500, 50) == 20.0          # no profile: the measured rate
    assert c.rps_at(PROFILE, 10, 1) == pytest.approx(20.0)
    longer = c.rps_at(PROFILE, 100, 1)
    ratio = PROFILE.service_s(10, 1, 4) / PROFILE.service_s(100, 1, 4)
    assert longer == pytest.approx(20.0 * ratio) and longer < 20.0


def test_meta_round_trip_and_refusals():
    c = BacklogCapacity(rps=3.5, seconds=12.0, batch=6.5, prompt_tokens=9.0, gen_tokens=2.0)
    meta = {k: repr(v) for k, v in c.to_meta().items()}
    assert set(meta) == set(BACKLOG_META_KEYS)
    assert BacklogCapacity.from_meta(meta) == c
    assert BacklogCapacity.from_meta({**meta, "backlog_rps": "nan"}) is None
    assert BacklogCapacity.from_meta({k: v for k, v in meta.items() if k != "backlog_s"}) is None
    assert BacklogCapacity.from_meta({**meta, "backlog_rps": "0"}) is None
    with pytest.raises(ConfigError) as err:
        BacklogCapacity(rps=1.0, seconds=1.0, batch=-1.0, prompt_tokens=1.0, gen_tokens=1.0)
    assert err.value.name == "backlog_batch"


@pytest.mark.parametrize("key,at,over", [
    ("backlog_rps", MAX_BACKLOG_RPS, MAX_BACKLOG_RPS * 1.0001),
    ("backlog_rps", MIN_BACKLOG_RPS, MIN_BACKLOG_RPS * 0.9999),
    ("backlog_batch", MAX_BACKLOG_BATCH, MAX_BACKLOG_BATCH + 1),
    ("backlog_prompt_tokens", MAX_MEAN_TOKENS, MAX_MEAN_TOKENS * 1.0001),
    ("backlog_gen_tokens", MAX_MEAN_TOKENS, MAX_MEAN_TOKENS * 1.0001),
])
def test_every_limit_at_and_just_over(key, at, over):
    """A value at its limit is a capacity; just past it the report is refused (None from
    meta, a ConfigError naming the key, the value and the limit)."""
    base = dict(zip(BACKLOG_META_KEYS, (3.0, 10.0, 2.0, 100.0, 10.0), strict=True))
    assert BacklogCapacity.from_meta({**base, key: at}) is not None
    assert BacklogCapacity.from_meta({**base, key: repr(over)}) is None
    with pytest.raises(ConfigError) as err:
        BacklogCapacity(*{**base, key: over}.values())
    assert (err.value.name, err.value.value) == (key, over)
    assert str(over) in str(err.value) or repr(over) in str(err.value)


def test_a_converted_rate_stays_within_the_limits():
    """However far the asked shape is from the measured one, the rate answered is finite and
    within [MIN_BACKLOG_RPS, MAX_BACKLOG_RPS] (its inverse is an occupancy, its sum a
    capacity); a length past MAX_MEAN_TOKENS, or not a number, is answered the measured
    rate."""
    fast = BacklogCapacity(rps=MAX_BACKLOG_RPS, seconds=5.0, batch=1.0, prompt_tokens=1e6,
                           gen_tokens=1e6)
    assert fast.rps_at(PROFILE, 1, 1) == MAX_BACKLOG_RPS
    slow = BacklogCapacity(rps=MIN_BACKLOG_RPS, seconds=5.0, batch=1.0, prompt_tokens=1.0,
                           gen_tokens=1.0)
    assert slow.rps_at(PROFILE, MAX_MEAN_TOKENS, MAX_MEAN_TOKENS) == MIN_BACKLOG_RPS
    for length in (MAX_MEAN_TOKENS * 2, float("inf"), float("nan")):
        assert slow.rps_at(PROFILE, length, 1) == MIN_BACKLOG_RPS
        assert fast.rps_at(PROFILE, 1, length) == MAX_BACKLOG_RPS


def test_a_meter_whose_measurement_is_past_the_limits_reports_none():
    """A backlogged stretch so long that 8 departures make less than MIN_BACKLOG_RPS (a
    process stopped while work waited) is not reported as a capacity."""
    m, clock = meter(min_s=1.0, min_departures=1)
    m.tick([], backlog=True, batch=1)
    clock.t += 1e7
    m.tick([(1, 1)] * 8, backlog=True, batch=1)
    assert m.capacity() is None
    clock.t += 1.0
    m.tick([(1, 1)], backlog=True, batch=1)   # within the window: the long span still counts
    assert m.capacity() is None
