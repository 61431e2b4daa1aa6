"""The predictor loop on a manual clock: scale-up, cooldown, keep-alive, the durability guard."""

import math

import pytest

from agent.clock import ManualClock
from agent.errors import AclDenied, ConfigError, ModelNotFound
from agent.predictor.keepalive import KeepAliveCosts
from agent.predictor.loop import ModelPolicy, Predictor


class FakeScaler:
    def __init__(self, start=0, fail=None):
        self.targets = {}
        self.calls = []
        self.start = start
        self.fail = fail

    def set_target(self, model, count, *, reason):
        if self.fail:
            raise self.fail
        self.calls.append((model, count, reason))
        self.targets[model] = count

    def target(self, model):
        return self.targets.get(model, self.start)


class FakeCatalog:
    def __init__(self):
        self.rows = []

    def record_forecast(self, model, window_start_s, forecast_rps, actual_rps, target):
        self.rows.append((model, window_start_s, forecast_rps, actual_rps, target))


def make(durable=True, **policy):
    clock = ManualClock()
    scaler = FakeScaler()
    catalog = FakeCatalog()
    state = {"durable": durable}
    # These tests follow the state machine (cooldown, keep-alive, durability) with the timing
    # of the Holt + backstop forecaster they were written for; the default forecaster has
    # its own tests below.
    policy.setdefault("forecaster", "holt_backstop")
    # ... reading each step's rate (the in-flight window averaging them has its own tests)
    policy.setdefault("in_flight_window_s", 1.0)
    pol = ModelPolicy("m", **policy)
    p = Predictor([pol], clock=clock, scaler=scaler,
                  snapshot_durable=lambda m: state["durable"], catalog=catalog)
    return p, clock, scaler, catalog, state


def step(p, clock, arrivals):
    clock.advance(1.0)
    if arrivals is not None:
        p.observe("m", arrivals)
    return p.tick()[0]


def test_lead_time_must_exceed_restore_p99_plus_decision_latency():
    with pytest.raises(ConfigError) as err:
        ModelPolicy("m", lead_time_s=4.0, restore_p99_s=3.6, decision_latency_s=1.0)
    assert "4.0" in str(err.value) and "3.6" in str(err.value) and "1.0" in str(err.value)
    assert err.value.limit == pytest.approx(4.6)
    with pytest.raises(ConfigError):                       # equal is not enough
        ModelPolicy("m", lead_time_s=4.5, restore_p99_s=3.5, decision_latency_s=1.0)
    ModelPolicy("m", lead_time_s=4.51, restore_p99_s=3.5, decision_latency_s=1.0)


def test_measured_p99_that_breaks_the_lead_time_is_refused():
    p, *_ = make(lead_time_s=10.0)
    p.update_restore_p99("m", 8.9)
    with pytest.raises(ConfigError):
        p.update_restore_p99("m", 9.0)


def test_burst_from_zero_scales_up_at_once():
    p, clock, scaler, catalog, _ = make()
    d = step(p, clock, 0)
    assert d.action == "hold" and d.target == 0
    d = step(p, clock, 200)                 # 0 -> 200 req/s in one second
    assert d.action == "scale_up" and d.target >= 12
    for _ in range(8):
        d = step(p, clock, 200)
    assert d.target == 24                   # 200 req/s x 7 s / 60 per replica
    assert scaler.targets["m"] == 24
    assert [c[1] for c in scaler.calls] == sorted(c[1] for c in scaler.calls)


def test_steady_20_rps_holds_three():
    p, clock, scaler, _, _ = make()
    for _ in range(60):
        d = step(p, clock, 20)
    assert d.target == 3 and d.desired == 3 and d.actual_rps == 20.0


def test_scale_down_waits_for_cooldown_then_needs_durable_snapshot():
    p, clock, scaler, catalog, state = make(durable=False, scale_down_cooldown_s=10.0,
                                             min_replicas=1)
    for _ in range(30):
        step(p, clock, 20)
    assert scaler.targets["m"] == 3
    actions = [step(p, clock, 0) for _ in range(60)]
    assert all(d.target == 3 for d in actions)             # never below 3 while pending
    assert any(d.reason.startswith("cooldown") for d in actions)
    assert actions[-1].reason == "snapshot not durable"
    state["durable"] = True
    d = step(p, clock, 0)
    assert d.action == "scale_down" and d.target == 1      # clamped to min_replicas
    assert "release=" in d.reason


def test_never_to_zero_while_snapshot_pending():
    p, clock, scaler, _, state = make(durable=False, scale_down_cooldown_s=5.0)
    step(p, clock, 5)
    assert scaler.targets["m"] == 1
    for _ in range(300):
        d = step(p, clock, 0)
    assert d.desired == 0 and d.target == 1 and d.reason == "snapshot not durable"
    state["durable"] = True
    assert step(p, clock, 0).target == 0


def test_missing_samples_and_gaps_never_give_nan():
    p, clock, _, catalog, _ = make()
    for _ in range(20):
        step(p, clock, 10)
    d = step(p, clock, None)                # a missing sample
    assert d.actual_rps is None and d.forecast_rps > 0 and not math.isnan(d.forecast_rps)
    clock.advance(40.0)                     # a front door restart: 40 s of nothing, then
    p.observe("m", 400, window_s=40.0)      # its counter delta over the whole gap
    d = p.tick()[0]
    assert d.actual_rps == 10.0 and d.forecast_rps == pytest.approx(10.0, rel=0.2)
    clock.advance(10_000.0)                 # a gap too long to replay: restart the forecast
    p.observe("m", 3)
    d = p.tick()[0]
    assert d.forecast_rps == pytest.approx(3.0)
    assert all(not math.isnan(r[2]) and r[2] >= 0 for r in catalog.rows)


def test_every_tick_writes_a_forecast_row():
    p, clock, _, catalog, _ = make()
    for n in (0, 20, 20):
        step(p, clock, n)
    assert [(r[0], r[1], r[3], r[4]) for r in catalog.rows] == [
        ("m", 0.0, 0.0, 0), ("m", 1.0, 20.0, 2), ("m", 2.0, 20.0, 2)]


def test_standby_does_not_scale_and_resyncs_when_acting():
    p, clock, scaler, catalog, _ = make()
    scaler.start = 5
    clock.advance(1.0)
    p.observe("m", 20)
    d = p.tick(act=False)[0]
    assert d.action == "standby" and scaler.calls == [] and catalog.rows == []
    clock.advance(1.0)
    p.observe("m", 20)
    d = p.tick()[0]
    assert d.previous == 5                  # learnt from the scaler, not assumed
    assert d.action == "hold"               # 5 > 3 wanted: only after cooldown


def test_scaler_refusal_is_retried_next_tick():
    p, clock, scaler, _, _ = make()
    scaler.fail = AclDenied("nomad: 403", service="nomad", endpoint="/v1/job/m/scale")
    d = step(p, clock, 20)
    assert d.action == "error" and d.target == 0
    scaler.fail = None
    d = step(p, clock, 20)
    assert d.action == "scale_up" and d.target >= 2


def test_keepalive_holds_zero_until_breakeven():
    costs = KeepAliveCosts(gpu_cost_per_s=0.0001, wait_cost_per_s=0.05, restore_s=4.0)
    p, clock, scaler, _, _ = make(scale_down_cooldown_s=1.0, costs=costs, alpha=0.5)
    for _ in range(3):                      # 0.1 req/s: keep-alive about 53 s
        clock.advance(10.0)
        p.observe("m", 1, window_s=10.0)
        p.tick()
    assert scaler.targets["m"] == 1
    reasons = [step(p, clock, 0) for _ in range(200)]
    first_zero = next(i for i, d in enumerate(reasons) if d.target == 0)
    assert any(d.reason.startswith("keep-alive") for d in reasons[:first_zero])
    assert reasons[first_zero].idle_s >= reasons[first_zero].keepalive.warm_s


def test_unknown_model_and_bad_observations():
    p, *_ = make()
    with pytest.raises(ModelNotFound):
        p.observe("other", 1)
    with pytest.raises(ConfigError):
        p.observe("m", -1)
    with pytest.raises(ConfigError):
        p.observe("m", 1, window_s=0.0)


def test_capacity_from_kv_report():
    p, clock, scaler, _, _ = make()
    assert p.update_capacity("m", 72_089, 900) == 80
    assert p.update_capacity("m", 36_000, 900) == 40
    for _ in range(30):
        d = step(p, clock, 20)
    assert d.target == 5                    # 140 / (40 x 0.75) = 4.67


def test_ticks_are_counted_on_the_clock_not_per_call():
    p, clock, _, catalog, _ = make()
    st = p._models["m"]
    for _ in range(4):                      # ticks every 0.5 s: one Holt step per second
        clock.advance(0.5)
        p.observe("m", 10, window_s=0.5)
        p.tick()
    assert st.forecaster.slow.samples == 2
    assert st.forecaster.slow.level == pytest.approx(20.0)      # 10 arrivals per 0.5 s = 20 req/s
    # one row per step, keyed by the start of the step's window (steps anchor on tick one)
    assert [r[1] for r in catalog.rows] == [-0.5, 0.5]
    clock.advance(2.6)                      # a late tick: three whole steps since 1.5 s
    p.observe("m", 52, window_s=2.6)        # (plus the 0.5 s kept from the tick at 2.0 s)
    p.tick()
    assert st.forecaster.slow.samples == 5 and catalog.rows[-1][1] == 1.5
    assert st.forecaster.slow.level == pytest.approx(20.0)      # 62 arrivals over 3.1 s


def test_a_scale_up_by_someone_else_is_seen_and_scaled_in_when_idle():
    # A front door scaled the model up from zero through Nomad; the predictor had set nothing.
    p, clock, scaler, _, _ = make(durable=True, scale_down_cooldown_s=5.0)
    step(p, clock, 0)
    assert scaler.calls == []
    scaler.targets["m"] = 1                                # Nomad's count now
    d = step(p, clock, 0)
    assert d.target == 1 and d.action == "hold"            # seen, held through the cooldown
    for _ in range(600):
        d = step(p, clock, 0)
        if d.action == "scale_down":
            break
    assert d.action == "scale_down" and d.target == 0 and scaler.targets["m"] == 0


# --- the default forecaster and sizing from measured speed -------------------------------

def _speed():
    from agent.speed import SpeedProfile

    return SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.01,
                        decode_base_s=0.02, decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0)


def test_default_forecaster_is_the_backstopped_upper_quantile():
    assert ModelPolicy("m").forecaster == "quantile_backstop"
    with pytest.raises(ConfigError):
        ModelPolicy("m", forecaster="nope")
    with pytest.raises(ConfigError):
        ModelPolicy("m", ttft_slo_s=0.0)
    with pytest.raises(ConfigError):
        ModelPolicy("m", mean_prompt_tokens=math.nan)


def test_update_speed_sizes_by_service_rate_not_kv_slots():
    p, clock, scaler, _, _ = make(forecaster="persistence", occupancy_s=7.0,
                                  seqs_per_replica=80, max_replicas=20)
    prof = _speed()
    batch = p.update_speed("m", prof, 16, mean_prompt_tokens=100, mean_gen_tokens=20)
    assert batch == prof.sustainable_concurrency(2.0, 100, 20, 16)
    per_rps = prof.service_rps(100, 20, batch)
    rate = int(2.5 * per_rps)               # 2.5 replicas' worth (speed_utilisation 1)
    d = step(p, clock, rate)
    assert d.desired == 3 and scaler.targets["m"] == 3
    # the KV-slot model would have asked for ceil(rate * 7 / (80 * 0.75))
    assert math.ceil(rate * 7.0 / 60.0) != 3
    with pytest.raises(ConfigError):
        ModelPolicy("m", speed_utilisation=0.0)
    with pytest.raises(ConfigError):
        p.update_speed("m", prof, 0)


def test_the_default_forecaster_releases_after_a_burst_and_an_idle_gap():
    p, clock, scaler, _, _ = make(forecaster="quantile_backstop", scale_down_cooldown_s=10.0,
                                  occupancy_s=1.0, seqs_per_replica=1, utilisation=1.0,
                                  costs=KeepAliveCosts(gpu_cost_per_s=1.0, wait_cost_per_s=0.0,
                                                       restore_s=1.0))
    for _ in range(30):
        step(p, clock, 3)
    assert scaler.targets["m"] == 3
    decisions = [step(p, clock, 0) for _ in range(200)]
    assert scaler.targets["m"] == 0
    released = next(i for i, d in enumerate(decisions) if d.target == 0)
    # the upper quantile still remembers the burst (60-step window), but an idle model is
    # released after the keep-alive, floored at the restore p99 (3.6 s), not after the window
    assert released + 1 == math.ceil(ModelPolicy("m").restore_p99_s)
    assert decisions[released].reason.startswith("idle for")
    assert all(d.target == 3 for d in decisions[:released])


def test_a_model_with_requests_queued_or_running_is_not_idle():
    """No arrival for many keep-alives, but the front door holds requests for the model (a
    restore in progress) or a replica runs them: not released until that ends."""
    p, clock, scaler, _, _ = make(forecaster="quantile_backstop", scale_down_cooldown_s=10.0,
                                  occupancy_s=1.0, seqs_per_replica=1, utilisation=1.0,
                                  costs=KeepAliveCosts(gpu_cost_per_s=1.0, wait_cost_per_s=0.0,
                                                       restore_s=1.0))
    step(p, clock, 1)
    assert scaler.targets["m"] == 1
    for _ in range(20):                    # 20 s without an arrival, busy all along
        p.observe_busy("m")
        assert step(p, clock, 0).target == 1
    decisions = [step(p, clock, 0) for _ in range(10)]
    assert decisions[0].idle_s == 2.0       # two steps since the last busy tick, not 22 s
    released = next(i for i, d in enumerate(decisions) if d.target == 0)
    assert decisions[released].reason.startswith("idle for")
    assert decisions[released - 1].idle_s < ModelPolicy("m").restore_p99_s <= \
        decisions[released].idle_s
    with pytest.raises(ModelNotFound):
        p.observe_busy("nope")


def test_a_predictor_that_saw_no_request_waits_the_keep_alive_from_its_first_tick():
    p, clock, scaler, _, _ = make(forecaster="quantile_backstop",
                                  costs=KeepAliveCosts(restore_s=1.0))
    scaler.start = 2                       # two replicas already up when it starts acting
    decisions = [step(p, clock, None) for _ in range(10)]
    first_release = next(i for i, d in enumerate(decisions) if d.action == "scale_down")
    assert first_release >= 3              # not on the first tick (idle counted from it)
    assert decisions[first_release].target == 0


def test_a_lower_rate_is_not_idle_and_keeps_the_cooldown():
    p, clock, scaler, _, _ = make(forecaster="holt_backstop", scale_down_cooldown_s=10.0,
                                  occupancy_s=1.0, seqs_per_replica=1, utilisation=1.0)
    for _ in range(20):
        step(p, clock, 3)
    decisions = [step(p, clock, 1) for _ in range(8)]
    assert all(d.target == 3 for d in decisions)    # low, not idle: the cooldown holds


def _bursts_with_gaps(p, clock, gap_steps, bursts):
    """``bursts`` one-step bursts of 3 requests, each followed by ``gap_steps`` idle steps;
    the decisions of every step."""
    out = []
    for _ in range(bursts):
        out.append(step(p, clock, 3))
        out.extend(step(p, clock, 0) for _ in range(gap_steps))
    return out


def test_keepalive_learns_the_idle_gaps_and_holds_through_them():
    # breakeven alone would release after the restore p99 (3.6 s) inside every 12 s gap
    cheap = KeepAliveCosts(gpu_cost_per_s=1.0, wait_cost_per_s=0.0, restore_s=1.0)
    p, clock, scaler, _, _ = make(forecaster="quantile_backstop", costs=cheap,
                                  occupancy_s=1.0, seqs_per_replica=3, utilisation=1.0)
    first = _bursts_with_gaps(p, clock, 12, 1)
    assert any(d.action == "scale_down" and d.target == 0 for d in first)  # nothing learnt yet
    p.observe_cold("m", 3, 2)      # the front door: 2 of the 3 cold arrivals missed their SLO
    later = _bursts_with_gaps(p, clock, 12, 6)
    # after the first gap was seen, the replica is kept through every gap that long
    assert not any(d.action == "scale_down" and d.target == 0 for d in later)
    assert all(d.target == 1 for d in later)
    # a longer gap than any seen is released after the longest seen (the 0.99 quantile)
    tail = [step(p, clock, 0) for _ in range(40)]
    released = next(i for i, d in enumerate(tail) if d.action == "scale_down")
    assert tail[released].target == 0 and tail[released].idle_s == pytest.approx(13.0)


@pytest.mark.parametrize("quantile, cold", [
    (0.0, (3, 2)),       # gap quantile off: cold misses change nothing
    (0.99, (3, 0)),      # every cold arrival served in time: a release is SLO-safe
    (0.99, None),        # nothing known about cold arrivals yet
    (0.99, (300, 3)),    # 1 % missed: within slo_attainment 0.99
])
def test_keepalive_is_the_breakeven_alone_unless_cold_arrivals_miss_their_slo(quantile, cold):
    cheap = KeepAliveCosts(gpu_cost_per_s=1.0, wait_cost_per_s=0.0, restore_s=1.0)
    p, clock, scaler, _, _ = make(forecaster="quantile_backstop", costs=cheap,
                                  occupancy_s=1.0, seqs_per_replica=3, utilisation=1.0,
                                  keepalive_gap_quantile=quantile)
    if cold is not None:
        p.observe_cold("m", *cold)
    decisions = _bursts_with_gaps(p, clock, 12, 4)
    downs = [d for d in decisions if d.action == "scale_down" and d.target == 0]
    assert len(downs) == 4                        # released inside every gap
    assert all(d.idle_s < 5.0 for d in downs)     # at the restore p99 floor (3.6 s)


def test_observe_cold_checks_its_counts_and_keeps_a_window():
    p, *_ = make()
    with pytest.raises(ConfigError):
        p.observe_cold("m", 1, -1)
    with pytest.raises(ConfigError):
        p.observe_cold("m", -1, 0)
    with pytest.raises(ModelNotFound):
        p.observe_cold("x", 1, 0)
    assert p.cold_miss_fraction("m") is None
    p.observe_cold("m", 4, 1)
    p.observe_cold("m", 0, 0)                     # no reading
    assert p.cold_miss_fraction("m") == 0.25
    p.observe_cold("m", 0, 2)                     # misses counted a reading after arrival
    assert p.cold_miss_fraction("m") == 0.75
    for _ in range(64):                           # the window forgets the oldest readings
        p.observe_cold("m", 1, 0)
    assert p.cold_miss_fraction("m") == 0.0
    p.observe_cold("m", 0, 200)                   # never above 1
    assert p.cold_miss_fraction("m") == 1.0


def test_gaps_older_than_the_window_are_forgotten():
    from agent.predictor.keepalive import IdleGaps

    gaps = IdleGaps(window_s=100.0)
    gaps.record(30.0, now_s=0.0)
    gaps.record(5.0, now_s=50.0)
    assert gaps.quantile(0.99, 60.0) == 30.0
    assert gaps.quantile(0.5, 60.0) == 5.0
    assert gaps.quantile(0.99, 120.0) == 5.0     # the 30 s gap ended 120 s ago
    assert gaps.quantile(0.99, 200.0) is None
    gaps.record(1e9, now_s=200.0)                # longer than the range: kept as the range
    assert gaps.quantile(0.99, 200.0) == 100.0
    gaps.record(float("nan"), now_s=200.0)       # no reading
    assert len(gaps) == 1


def test_a_clock_jump_or_a_bad_end_time_never_keeps_stale_gaps():
    """Gaps are forgotten by when they ended, not by the order they came in: after the clock
    went forward and back, or a NaN end time, a gap older than the window is not counted."""
    from agent.predictor.keepalive import IdleGaps

    gaps = IdleGaps(window_s=100.0)
    gaps.record(10.0, now_s=1000.0)              # the clock jumped forward...
    gaps.record(20.0, now_s=5.0)                 # ...and back
    gaps.record(30.0, now_s=6.0)
    assert gaps.quantile(0.99, 50.0) == 30.0     # the gap "ending at 1000" has not ended yet
    assert gaps.quantile(0.99, 200.0) is None    # 5 and 6 are 194 s old: forgotten
    assert gaps.quantile(0.99, 1050.0) == 10.0
    gaps = IdleGaps(window_s=100.0)
    gaps.record(40.0, now_s=float("nan"))        # no reading of the clock
    gaps.record(50.0, now_s=float("inf"))
    gaps.record(True, now_s=5.0)                 # not a gap in seconds
    gaps.record(20.0, now_s=5.0)
    assert len(gaps) == 1 and gaps.quantile(0.99, 50.0) == 20.0
    assert gaps.quantile(0.99, 500.0) is None and len(gaps) == 0


def test_bad_gap_quantile_and_window_are_refused():
    from agent.predictor.keepalive import IdleGaps

    with pytest.raises(ConfigError) as err:
        ModelPolicy("m", keepalive_gap_quantile=1.5)
    assert err.value.name == "keepalive_gap_quantile"
    with pytest.raises(ConfigError):
        IdleGaps(window_s=0.0)
    with pytest.raises(ConfigError):
        IdleGaps(window_s=10.0, max_gaps=0)
