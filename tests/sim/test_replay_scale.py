"""Scaling a trace window to a replica: one time compression, one token scale, both derived."""

import numpy as np
import pytest

from agent.errors import ConfigError
from agent.sim.replay_scale import fit_scale, replay_requests, scale_lengths
from agent.speed import SpeedProfile

PROFILE = SpeedProfile(prefill_tokens_per_s=1500.0, prefill_overhead_s=0.015,
                       decode_base_s=0.025, decode_per_seq_s=0.003, decode_per_ctx_token_s=1e-6)
RNG = np.random.default_rng(5)


def window(n=1000, window_s=600.0, ctx=2000, gen=30):
    arrival = np.sort(RNG.uniform(0, window_s, n))
    return arrival, RNG.integers(1, 2 * ctx, n), RNG.integers(1, 2 * gen, n)


def fit(ctx, gen, **kw):
    args = dict(window_s=600.0, profile=PROFILE, load=0.3, wall_s=240.0, ttft_slo_s=2.0,
                max_seqs=8, max_tokens_per_request=512)
    args.update(kw)
    return fit_scale(ctx, gen, **args)


def measured_load(ctx, gen, s, max_tokens=512):
    p, o = scale_lengths(ctx, gen, s.token_scale, max_tokens)
    batch = PROFILE.sustainable_concurrency(2.0, float(p.mean()), float(o.mean()), 8)
    service = np.mean([PROFILE.service_s(float(a), float(b), batch) for a, b in zip(p, o, strict=True)])
    return len(ctx) * s.speedup / 600.0 * service


def test_scale_lengths_rounds_floors_and_trims_to_the_slot():
    p, o = scale_lengths(np.array([1000, 10, 0, 5000]), np.array([100, 0, 3, 5000]), 0.1, 64)
    np.testing.assert_array_equal(o, [10, 1, 1, 63])
    np.testing.assert_array_equal(p, [54, 1, 1, 1])     # 100 trimmed to 64 - 10
    assert np.all(p + o <= 64)
    with pytest.raises(ConfigError):
        scale_lengths(np.array([1]), np.array([1]), 1.0, 1)


@pytest.mark.parametrize("load", [0.1, 0.3, 1.0, 3.0])
def test_the_fitted_scale_offers_exactly_the_load(load):
    _, ctx, gen = window()
    s = fit(ctx, gen, load=load)
    assert s.load == pytest.approx(load)
    assert measured_load(ctx, gen, s) == pytest.approx(load, rel=1e-9)
    assert s.offered_rps == pytest.approx(len(ctx) * s.speedup / 600.0)
    assert s.wall_s == pytest.approx(600.0 / s.speedup)


def test_inside_the_bounds_the_wall_time_is_the_budget():
    _, ctx, gen = window()
    s = fit(ctx, gen, wall_s=300.0)
    assert s.bound == ""
    assert s.wall_s == pytest.approx(300.0, rel=0.02)   # only length rounding moves it
    assert 0 < s.token_scale < 1


def test_a_window_too_busy_for_one_token_requests_is_replayed_slower():
    _, ctx, gen = window(n=200_000)
    s = fit(ctx, gen)
    assert s.bound == "min_tokens" and s.mean_prompt_tokens == 1.0
    assert s.wall_s > 240.0 and s.load == pytest.approx(0.3)


def test_a_window_too_light_even_at_its_own_lengths_is_replayed_faster():
    _, ctx, gen = window(n=20, ctx=20, gen=2)
    s = fit(ctx, gen, max_tokens_per_request=4096)
    assert s.bound == "trace_tokens" and s.token_scale == 1.0
    assert s.wall_s < 240.0 and s.load == pytest.approx(0.3)


def test_a_faster_replica_gets_longer_requests_not_another_shape():
    arrival, ctx, gen = window()
    slow = fit(ctx, gen)
    fast = fit(ctx, gen, profile=SpeedProfile(3000.0, 0.0075, 0.0125, 0.0015, 5e-7))
    assert fast.token_scale > slow.token_scale
    a = replay_requests(arrival, ctx, gen, slow, 512)
    b = replay_requests(arrival, ctx, gen, fast, 512)
    # the burst shape is the trace's: the same arrival order and relative times
    ta = np.array([r.at_s for r in a]) * slow.speedup
    tb = np.array([r.at_s for r in b]) * fast.speedup
    np.testing.assert_allclose(ta, arrival)
    np.testing.assert_allclose(tb, arrival)


@pytest.mark.parametrize("bad", [{"load": 0.0}, {"wall_s": float("inf")}, {"window_s": -1.0},
                                 {"ttft_slo_s": float("nan")}])
def test_bad_arguments_are_config_errors(bad):
    _, ctx, gen = window(n=10)
    with pytest.raises(ConfigError):
        fit(ctx, gen, **bad)


def test_an_empty_window_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        fit(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert e.value.name == "requests"


def test_always_on_is_sized_for_the_busiest_ten_seconds():
    from agent.sim.replay_scale import always_on_replicas

    steady = np.arange(0, 100, 0.5)                    # 2 req/s
    assert always_on_replicas(steady, 5.0, 4) == 1
    burst = np.concatenate([steady, 50 + np.arange(0, 10, 0.05)])   # +20 req/s for 10 s
    assert always_on_replicas(burst, 5.0, 4) == 4     # 22 req/s peak / 5 -> 5, capped at 4
    assert always_on_replicas(burst, 5.0, 8) == 5
    assert always_on_replicas(np.array([]), 5.0, 4) == 1


def fit_within(ctx, gen, **kw):
    from agent.sim.replay_scale import fit_within_wall

    args = dict(window_s=600.0, profile=PROFILE, load=0.3, wall_s=240.0, ttft_slo_s=2.0,
                max_seqs=8, max_tokens_per_request=512)
    args.update(kw)
    return fit_within_wall(ctx, gen, **args)


def test_a_window_too_busy_for_the_budget_is_thinned_evenly_to_fit_it():
    arrival, ctx, gen = window(n=200_000)
    s, kept = fit_within(ctx, gen)
    assert s.wall_s <= 1.25 * 240.0 and s.load == pytest.approx(0.3)
    assert s.requests == kept.size < len(ctx)
    assert np.all(np.diff(kept) > 0)                       # in arrival order, no repeats
    # the arrival shape is kept: the share of requests in each minute barely moves
    full = np.histogram(arrival, bins=10, range=(0, 600))[0] / len(arrival)
    thin = np.histogram(arrival[kept], bins=10, range=(0, 600))[0] / kept.size
    np.testing.assert_allclose(thin, full, atol=0.01)


def test_a_window_that_fits_the_budget_is_not_thinned():
    _, ctx, gen = window()
    s, kept = fit_within(ctx, gen)
    assert kept.size == len(ctx) and s == fit(ctx, gen)


def test_a_measured_capacity_sets_the_load_instead_of_the_profile():
    from agent.throughput import BacklogCapacity

    _, ctx, gen = window()
    by_profile = fit(ctx, gen)
    # the replica was measured to sustain twice what the profile says at that shape
    p, o = scale_lengths(ctx, gen, by_profile.token_scale, 512)
    sustained = BacklogCapacity(rps=2 * by_profile.capacity_rps, seconds=10.0, batch=8.0,
                                prompt_tokens=float(p.mean()), gen_tokens=float(o.mean()))
    by_measure = fit(ctx, gen, sustained=sustained)
    assert by_measure.load == pytest.approx(0.3)
    # the same wall time, so the same arrival rate: the requests grow until the measured
    # replica is at 0.3 of what it sustains
    assert by_measure.speedup == pytest.approx(by_profile.speedup, rel=0.02)
    assert by_measure.token_scale > by_profile.token_scale
    assert by_measure.batch == 8


def test_fluid_attainment_is_a_bound_any_scheduler_meets_at_best():
    from agent.sim.replay_scale import fluid_attainment

    at = np.array([0.0, 0.0, 0.0, 0.0, 10.0])
    service = np.full(5, 1.0)
    # one replica: waits of 0, 1, 2 s are within 2 s, the 4th (3 s) is refused and costs
    # nothing, the 5th finds it free
    assert fluid_attainment(at, service, 2.0, 1) == pytest.approx(4 / 5)
    assert fluid_attainment(at, service, 2.0, 2) == 1.0
    assert fluid_attainment(at, service, 0.5, 1) == pytest.approx(2 / 5)
    assert fluid_attainment(np.array([]), np.array([]), 2.0) == 1.0
    with pytest.raises(ConfigError):
        fluid_attainment(at, service, 2.0, 0)
    with pytest.raises(ConfigError):
        fluid_attainment(at, service[:2], 2.0, 1)


def test_the_always_on_fit_lowers_the_load_until_one_replica_meets_the_slo():
    from agent.sim.replay_scale import fit_for_always_on, fluid_attainment, request_seconds

    rng = np.random.default_rng(9)
    # a quiet window with one dense burst at minute 5: 10x the mean rate for 20 s
    arrival = np.sort(np.concatenate([rng.uniform(0, 600, 400), rng.uniform(300, 320, 300)]))
    ctx, gen = rng.integers(200, 3000, arrival.size), rng.integers(5, 60, arrival.size)
    kw = dict(window_s=600.0, profile=PROFILE, wall_s=240.0, ttft_slo_s=2.0, max_seqs=8,
              max_tokens_per_request=512)
    plain = fit_scale(ctx, gen, load=0.3, **kw)
    plan = replay_requests(arrival, ctx, gen, plain, 512)
    at = np.array([r.at_s for r in plan])
    assert fluid_attainment(at, request_seconds(plan, PROFILE, None, plain.batch), 2.0) < 0.99
    scale, kept, got = fit_for_always_on(ctx, gen, arrival, load=0.3, wait_slo_s=2.0, **kw)
    assert got >= 0.99 and scale.load < 0.3 and kept.size == arrival.size
    # a window one replica already serves is left at the asked load
    calm = np.sort(rng.uniform(0, 600, 300))
    scale, _, got = fit_for_always_on(ctx[:300], gen[:300], calm, load=0.3, wait_slo_s=2.0, **kw)
    assert scale.load == pytest.approx(0.3) and got >= 0.99
