"""The last replica's keep-alive read from the model's idle gaps (keepalive.gap_breakeven_s)."""

import pytest

from agent.clock import ManualClock
from agent.errors import ConfigError
from agent.predictor.forecast import InFlightRate, UpperQuantile, build_forecaster
from agent.predictor.keepalive import (KeepAliveCosts, gap_breakeven_s, penalty_cost,
                                       plan_keepalive)
from agent.predictor.loop import ModelPolicy, Predictor


def test_gaps_all_longer_than_the_deterministic_breakeven_release_at_once():
    # idle 1/s, penalty 50: keeping a replica through a gap is worth it only below 50 s
    assert gap_breakeven_s([600.0, 900.0, 300.0], 1.0, 50.0) == 0.0


def test_gaps_all_shorter_keep_the_replica_through_the_longest():
    assert gap_breakeven_s([2.0, 4.0, 3.0, 4.0], 1.0, 50.0) == 4.0


def test_mixed_gaps_by_hand():
    # gaps 5, 10, 400 at idle cost 1/s and penalty 30 per cold start:
    #   T=0:   3 x 30                     = 90
    #   T=5:   5 + 2 x (5 + 30)           = 75
    #   T=10:  5 + 10 + 1 x (10 + 30)     = 55   <- least
    #   T=400: 5 + 10 + 400               = 415
    assert gap_breakeven_s([400.0, 5.0, 10.0], 1.0, 30.0) == 10.0


def test_ties_go_to_the_longer_keepalive():
    # penalty 20: T=0: 2 x 20 = 40; T=10: 10 bridged + (10 idle + 20) for the long one = 40
    assert gap_breakeven_s([10.0, 1000.0], 1.0, 20.0) == 10.0


@pytest.mark.parametrize("gaps, cost, pen", [([], 1.0, 1.0), ([-1.0], 1.0, 1.0),
                                             ([float("inf")], 1.0, 1.0),
                                             ([1.0], -1.0, 1.0), ([1.0], 1.0, float("nan"))])
def test_bad_inputs_are_named(gaps, cost, pen):
    with pytest.raises(ConfigError):
        gap_breakeven_s(gaps, cost, pen)


def test_plan_uses_the_gaps_when_given_and_poisson_otherwise():
    costs = KeepAliveCosts(gpu_cost_per_s=0.001, wait_cost_per_s=0.01, restore_s=4.0)
    poisson = plan_keepalive(0.5, costs)
    pen = penalty_cost(4.0, 0.5, costs)
    short = plan_keepalive(0.5, costs, [3.0, 7.0, 5.0])
    assert short.warm_s == gap_breakeven_s([3.0, 7.0, 5.0], costs.gpu_cost_per_s, pen) == 7.0
    assert poisson.warm_s != short.warm_s
    assert plan_keepalive(0.5, costs, [10_000.0] * 3).warm_s == 0.0


def _predictor(**policy):
    clock = ManualClock()
    targets = {}

    class Scaler:
        def target(self, model):
            return targets.get(model, 0)

        def set_target(self, model, count, *, reason):
            targets[model] = count

    p = Predictor([ModelPolicy("m", **policy)], clock=clock, scaler=Scaler(),
                  snapshot_durable=lambda m: True)
    return p, clock, targets


def _run(p, clock, arrivals_at, until_s):
    """Tick once a second; ``arrivals_at``: the whole seconds at which one request comes.
    Returns the seconds at which the target was 0."""
    at = set(arrivals_at)
    zero = []
    for t in range(1, until_s):
        clock.advance(1.0)
        p.observe("m", 1 if t in at else 0)
        d = p.tick()[0]
        if d.target == 0:
            zero.append(t)
    return zero


def test_a_trickle_with_long_gaps_is_released_soon_after_each_request():
    p, clock, targets = _predictor()
    arrivals = [600 * k for k in range(1, 16)]          # one request every 10 minutes
    zero = set(_run(p, clock, arrivals, arrivals[-1] + 61))
    # after the gaps are learnt, the replica is gone within a minute of each request
    for a in arrivals[11:]:
        assert a + 60 in zero
    assert len(zero) > 0.8 * (arrivals[-1] + 60)


def test_a_stream_with_short_idle_gaps_keeps_its_replica():
    # a request every 20 s: each gap beyond the Poisson keep-alive of its rate, far below the
    # restore penalty over the idle price
    p, clock, targets = _predictor()
    arrivals = list(range(20, 2000, 20))
    zero = _run(p, clock, arrivals, 2000)
    learnt = arrivals[11]
    assert not [t for t in zero if t > learnt + 1]


def test_measured_restore_becomes_the_keepalive_cost():
    p, clock, _ = _predictor()
    p.update_restore_p99("m", 9.0)
    assert p._models["m"].policy.costs.restore_s == 9.0


def test_in_flight_rate_sizes_batches_by_their_mean_over_one_occupancy():
    raw, windowed = UpperQuantile(60, 0.9), InFlightRate(UpperQuantile(60, 0.9), 15)
    for t in range(120):                                # 30 requests every 3 s
        x = 30.0 if t % 3 == 0 else 0.0
        raw.update(x)
        windowed.update(x)
    assert raw.forecast(15) == 30.0
    assert windowed.forecast(15) == pytest.approx(10.0, rel=0.01)
    with pytest.raises(ConfigError):
        InFlightRate(raw, 0)


def test_backstop_still_reacts_to_one_step_of_a_burst():
    f = build_forecaster("quantile_backstop", in_flight_window=7)
    f.update(0.0)
    f.update(200.0)
    assert f.forecast(15) >= 100.0          # the fast term reads each step's rate
