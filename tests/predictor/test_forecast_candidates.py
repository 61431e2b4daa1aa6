"""The forecast candidates and their judging, on synthetic traces of several shapes.

Shapes: steady Poisson, step bursts from zero, linear ramps, long idle gaps.  The assertions
are behaviours a sizing forecaster needs (cover a burst within steps, hold an upper quantile
of a steady rate, fall to zero in a long gap, never NaN), not figures of one trace.
"""

import math

import numpy as np
import pytest

from agent.errors import ConfigError
from agent.sim.forecast_eval import evaluate, forecasts_at_lead, pinball_loss, rate_series
from agent.predictor.forecast import (FORECASTERS, Backstop, Holt, Persistence, UpperQuantile,
                                      build_forecaster)

RNG = np.random.default_rng(12)


def steady(rate=10.0, n=600):
    return RNG.poisson(rate, n).astype(float)


def step_bursts(n=900, period=300, width=40, high=50.0):
    x = np.zeros(n)
    for s in range(100, n, period):
        x[s:s + width] = RNG.poisson(high, min(width, n - s))
    return x


def ramp(n=600, top=40.0):
    return RNG.poisson(np.linspace(0.0, top, n)).astype(float)


def idle_gaps(n=1200):
    x = RNG.poisson(8.0, n).astype(float)
    x[200:800] = 0.0
    return x


def test_pinball_loss_by_hand():
    # under by 2 costs 0.9 * 2; over by 2 costs 0.1 * 2
    assert pinball_loss(np.array([5.0, 1.0]), np.array([3.0, 3.0]), 0.9) == pytest.approx(1.0)
    assert pinball_loss(np.array([]), np.array([]), 0.9) == 0.0


def test_persistence_is_the_last_finite_sample():
    f = Persistence()
    for x in (3.0, None, math.nan, math.inf, -2.0):
        f.update(x)
    assert f.forecast(10) == 0.0   # -2 clamps to 0; the missing ones keep it
    f.update(7.0)
    assert f.forecast(5) == 7.0


def test_upper_quantile_of_a_window_by_hand():
    f = UpperQuantile(window=10, q=0.9)
    assert f.forecast(3) == 0.0
    for x in range(1, 11):          # 1..10
        f.update(float(x))
    assert f.forecast(3) == 9.0     # nearest rank: ceil(0.9 * 10) = 9th
    for _ in range(10):
        f.update(0.0)
    assert f.forecast(3) == 0.0     # the window has forgotten the old values
    with pytest.raises(ConfigError):
        UpperQuantile(window=0)
    with pytest.raises(ConfigError):
        UpperQuantile(window=5, q=1.5)


def test_upper_quantile_of_a_steady_rate_sits_above_the_mean():
    x = steady(10.0)
    f = forecasts_at_lead(x.tolist(), UpperQuantile(60, 0.9), 5)[60:]
    # Poisson(10): the 0.9 quantile is 14
    assert 13.0 <= float(np.median(f)) <= 15.0


def test_a_step_burst_is_covered_within_two_steps_only_with_the_backstop():
    x = step_bursts()
    for kind in ("holt_backstop", "quantile_backstop"):
        f = forecasts_at_lead(x.tolist(), build_forecaster(kind), 5)
        assert f[101] >= 0.5 * 50.0 * 0.75, kind     # within two steps of the burst's start
    slow = forecasts_at_lead(x.tolist(), build_forecaster("damped_holt"), 5)
    assert slow[101] < 15.0                           # Holt alone lags (alpha 0.1)


def test_holt_follows_a_ramp_and_the_quantile_does_not_fall_behind_much():
    x = ramp()
    for kind in ("holt", "quantile_backstop"):
        f = forecasts_at_lead(x.tolist(), build_forecaster(kind), 5)
        truth = np.linspace(0.0, 40.0, 600)
        assert abs(float(f[500]) - truth[505]) < 8.0, kind


@pytest.mark.parametrize("kind", FORECASTERS)
def test_a_long_idle_gap_brings_every_forecast_to_zero(kind):
    x = idle_gaps()
    f = forecasts_at_lead(x.tolist(), build_forecaster(kind), 5)
    assert f[790] < 0.5, kind              # 590 steps into the gap
    assert np.all(np.isfinite(f)) and np.all(f >= 0)


@pytest.mark.parametrize("kind", FORECASTERS)
def test_untidy_samples_never_make_nan(kind):
    f = build_forecaster(kind)
    for x in (None, math.nan, math.inf, -1.0, 1e300, 5.0):
        f.update(x)
        v = f.forecast(5)
        assert math.isfinite(v) and v >= 0.0


def test_unknown_forecaster_names_the_choices():
    with pytest.raises(ConfigError) as e:
        build_forecaster("prophet")
    assert e.value.value == "prophet" and "quantile_backstop" in str(e.value)


def test_evaluate_scores_each_candidate_at_the_lead():
    x = step_bursts()
    scores = {s.name: s for s in evaluate(x, {k: (lambda k=k: build_forecaster(k))
                                              for k in FORECASTERS}, lead_steps=5)}
    assert set(scores) == set(FORECASTERS)
    # on bursts the backstopped quantile under-forecasts less often than Holt alone
    assert scores["quantile_backstop"].under_share < scores["damped_holt"].under_share
    assert all(s.lead_steps == 5 for s in scores.values())
    # persistence on a constant series is perfect
    flat = evaluate(np.full(50, 3.0), {"p": Persistence}, lead_steps=5)[0]
    assert flat.mae == 0.0 and flat.pinball == 0.0


def test_evaluate_refuses_bad_arguments():
    with pytest.raises(ConfigError):
        evaluate(np.zeros(10), {"p": Persistence}, lead_steps=0)
    with pytest.raises(ConfigError):
        evaluate(np.zeros(10), {"p": Persistence}, lead_steps=10)
    with pytest.raises(ConfigError):
        evaluate(np.zeros(10), {"p": Persistence}, lead_steps=2, q=1.0)


def test_rate_series_bins_arrivals():
    np.testing.assert_array_equal(rate_series(np.array([0.1, 0.2, 2.5])), [2.0, 0.0, 1.0])
    np.testing.assert_array_equal(rate_series(np.array([0.1, 0.2, 2.5]), 2.0), [1.0, 0.5])
    assert rate_series(np.array([])).size == 0
    with pytest.raises(ConfigError):
        rate_series(np.array([1.0]), 0.0)


def test_backstop_takes_the_larger():
    b = Backstop(Holt(0.1, 0.0), react_alpha=1.0)
    b.update(0.0)
    b.update(10.0)
    assert b.forecast(5) == 10.0            # the fast side (alpha 1: the last sample)
