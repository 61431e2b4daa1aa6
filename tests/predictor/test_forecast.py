"""Holt forecasting on synthetic shapes, untidy input, and the Azure code trace."""

import csv
import math
import pathlib
from datetime import datetime

import pytest

from agent.errors import ConfigError
from agent.predictor.forecast import CounterRate, Holt

TRACE = pathlib.Path(__file__).resolve().parents[2] / "bench" / "traces" / "azure_llm_2023_code.csv"


def run(series, h=15, **kw):
    holt = Holt(kw.get("alpha", 0.5), kw.get("beta", 0.1), kw.get("phi", 1.0))
    out = []
    for x in series:
        holt.update(x)
        out.append(holt.forecast(h))
    return holt, out


def test_first_sample_sets_level_and_no_trend():
    holt = Holt(0.5, 0.1)
    assert holt.forecast(10) == 0.0            # nothing seen yet
    holt.update(4.0)
    assert holt.level == 4.0 and holt.trend == 0.0
    holt.update(8.0)
    # level = 0.5*8 + 0.5*(4 + 0) = 6; trend = 0.1*(6-4) + 0.9*0 = 0.2
    assert holt.level == pytest.approx(6.0)
    assert holt.trend == pytest.approx(0.2)
    assert holt.forecast(5) == pytest.approx(6.0 + 5 * 0.2)


def test_damped_forecast_sums_the_geometric_series():
    holt = Holt(0.5, 0.5, phi=0.5)
    holt.update(0.0)
    holt.update(8.0)
    # level = 4 + 0.5*(0 + 0) = 4; trend = 0.5*4 + 0 = 2
    assert holt.forecast(2) == pytest.approx(4.0 + (0.5 + 0.25) * 2.0)


def test_step_converges_to_new_level():
    _, out = run([0.0] * 30 + [20.0] * 120)
    assert out[29] == 0.0
    assert out[-1] == pytest.approx(20.0, rel=0.02)


def test_ramp_forecast_leads_the_ramp():
    ramp = [float(t) for t in range(100)]          # +1 req/s every second
    _, out = run(ramp, h=15, alpha=0.5, beta=0.3)
    # after settling, the 15-step forecast tracks x_t + 15 within a few req/s
    assert out[-1] == pytest.approx(99 + 15, abs=3.0)


def test_spike_decays_and_never_goes_negative():
    series = [1.0] * 20 + [200.0] + [1.0] * 200
    _, out = run(series, h=15, alpha=0.5, beta=0.2, phi=0.9)
    assert max(out) > 50.0                         # the spike is seen
    assert all(v >= 0.0 and not math.isnan(v) for v in out)
    assert out[-1] == pytest.approx(1.0, abs=0.2)


def test_falling_ramp_clamps_at_zero():
    _, out = run([100.0 - 5 * t for t in range(20)] + [0.0] * 5, h=30)
    assert all(v >= 0.0 for v in out)
    assert out[-1] == 0.0


def test_missing_samples_hold_the_forecast():
    holt, _ = run([10.0] * 50)
    before = holt.forecast(15)
    for bad in (None, float("nan"), float("inf")):
        holt.update(bad)
    assert holt.missing == 3 and holt.samples == 50
    assert holt.forecast(15) == pytest.approx(before, rel=1e-6)


def test_negative_sample_is_clamped():
    holt, _ = run([-5.0, -1.0])
    assert holt.level == 0.0 and holt.forecast(3) == 0.0


def test_burst_from_zero_is_tracked():
    _, out = run([0.0] * 100 + [200.0] * 5, h=15)
    assert out[99] == 0.0
    assert out[-1] > 150.0


@pytest.mark.parametrize("kw", [dict(alpha=0.0, beta=0.1), dict(alpha=1.01, beta=0.1),
                                dict(alpha=0.5, beta=-0.01), dict(alpha=0.5, beta=1.01),
                                dict(alpha=0.5, beta=0.1, phi=0.0),
                                dict(alpha=0.5, beta=0.1, phi=1.01),
                                dict(alpha=float("nan"), beta=0.1)])
def test_parameters_out_of_range_are_refused(kw):
    with pytest.raises(ConfigError) as err:
        Holt(**kw)
    assert err.value.name in kw


def test_parameters_at_their_limits_are_accepted():
    Holt(1.0, 0.0, 1.0)
    Holt(1e-9, 1.0, 1e-9)


def test_counter_rate_handles_reset_gap_and_stale_reading():
    c = CounterRate()
    assert c.sample(100, 0.0) is None
    assert c.sample(120, 1.0) == (20, 1.0)
    assert c.sample(125, 1.0) is None               # time did not move: ignored
    assert c.sample(7, 2.0) == (7, 1.0)            # counter reset after a restart
    assert c.resets == 1
    assert c.sample(67, 32.0) == (60, 30.0)        # a 30 s gap, returned as such
    with pytest.raises(ConfigError):
        c.sample(-1, 33.0)


def _trace_per_second(path):
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        times = [datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
                 for r in rows]
    t0 = int(times[0])
    counts = [0] * (int(times[-1]) - t0 + 1)
    for t in times:
        counts[int(t) - t0] += 1
    return counts


def test_azure_code_trace_forecast_is_sane_and_beats_naive():
    counts = _trace_per_second(TRACE)
    assert sum(counts) > 1000 and len(counts) > 600   # an hour of arrivals
    h = 15
    holt = Holt(0.1, 0.01, 0.9)
    err_holt = err_naive = 0.0
    forecasts = []
    for t, x in enumerate(counts):
        holt.update(float(x))
        f = holt.forecast(h)
        assert f >= 0.0 and not math.isnan(f)
        forecasts.append(f)
        if t + h < len(counts):
            future = sum(counts[t + 1:t + h + 1]) / h        # mean rate over the lead window
            err_holt += abs(f - future)
            err_naive += abs(x - future)                     # "the next 15 s are like now"
    n = len(counts) - h
    mean_rate = sum(counts) / len(counts)
    # Bursty per-second counts (median 0, peaks of tens): the forecast must not be biased
    # and must do no worse than repeating the last second.
    assert sum(forecasts) / len(forecasts) == pytest.approx(mean_rate, rel=0.15)
    assert err_holt / n <= err_naive / n
