"""The capacity a replica sustained while backlogged (agent/throughput.py)."""

from __future__ import annotations

import pytest

from agent.errors import ConfigError
from agent.speed import SpeedProfile
from agent.throughput import BACKLOG_META_KEYS, BacklogCapacity, BacklogMeter

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
