"""Little's law targets and the breakeven keep-alive against hand-computed values."""

import math

import pytest

from agent.errors import ConfigError
from agent.predictor.keepalive import KeepAliveCosts, penalty_cost, plan_keepalive
from agent.predictor.sizing import breakeven_keepalive_s, seqs_per_replica, target_replicas


def test_design_document_worked_example():
    # docs/architecture.md, "Sizing": 72,089 KV tokens / 900 tokens = 80 sequences per replica
    assert seqs_per_replica(72_089, 900) == 80
    assert target_replicas(20, 7.0, 80, 0.75, 0, 100) == 3       # ceil(140 / 60)
    assert target_replicas(200, 7.0, 80, 0.75, 0, 100) == 24     # ceil(1400 / 60)


def test_exact_multiple_does_not_round_up():
    # 120 in flight / 60 per replica is exactly 2, despite float noise
    assert target_replicas(120 / 7.0, 7.0, 80, 0.75, 0, 100) == 2
    assert target_replicas(0.0, 7.0, 80, 0.75, 0, 100) == 0


def test_clamped_to_min_and_max():
    assert target_replicas(0.0, 7.0, 80, 0.75, 1, 5) == 1
    assert target_replicas(10_000, 7.0, 80, 0.75, 0, 5) == 5


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), -3.0])
def test_bad_rate_counts_as_zero(rate):
    assert target_replicas(rate, 7.0, 80, 0.75, 0, 5) == 0


@pytest.mark.parametrize("args,name", [
    ((1, 0.0, 80, 0.75, 0, 5), "occupancy_s"),
    ((1, 7.0, 0, 0.75, 0, 5), "seqs_per_replica"),
    ((1, 7.0, 80, 0.0, 0, 5), "utilisation"),
    ((1, 7.0, 80, 1.01, 0, 5), "utilisation"),
    ((1, 7.0, 80, 0.75, -1, 5), "min_replicas"),
    ((1, 7.0, 80, 0.75, 3, 2), "max_replicas"),
])
def test_sizing_limits(args, name):
    with pytest.raises(ConfigError) as err:
        target_replicas(*args)
    assert err.value.name == name


def test_sizing_limits_at_their_values():
    assert target_replicas(1, 7.0, 1, 1.0, 2, 2) == 2
    with pytest.raises(ConfigError):
        seqs_per_replica(100, 0)
    assert seqs_per_replica(0, 900) == 0


def test_breakeven_hand_computed():
    # c = 0.01 per s, P = 1.0, lambda = 0.5: ratio 0.02, t = ln(50) / 0.5
    assert breakeven_keepalive_s(0.01, 1.0, 0.5) == pytest.approx(7.824046010856292)
    # $2.80 per GPU-hour, P = $0.05, lambda = 0.1 req/s: ratio 0.15556, t = 18.6102 s
    assert breakeven_keepalive_s(2.80 / 3600, 0.05, 0.1) == pytest.approx(18.61, abs=1e-2)


def test_breakeven_edges():
    assert breakeven_keepalive_s(0.5, 1.0, 0.5) == 0.0       # ratio exactly 1
    assert breakeven_keepalive_s(1.0, 1.0, 0.5) == 0.0       # idle costs more than it saves
    assert breakeven_keepalive_s(0.01, 1.0, 0.0) == 0.0      # no arrivals expected
    assert breakeven_keepalive_s(0.0, 1.0, 0.5) == math.inf  # idle is free
    with pytest.raises(ConfigError):
        breakeven_keepalive_s(-0.01, 1.0, 0.5)
    with pytest.raises(ConfigError):
        breakeven_keepalive_s(0.01, -1.0, 0.5)


def test_penalty_cost_counts_gpu_time_and_waiting():
    costs = KeepAliveCosts(gpu_cost_per_s=0.001, wait_cost_per_s=0.01, restore_s=4.0)
    # one request waits at a low rate: 4 * (0.001 + 0.01 * 1)
    assert penalty_cost(4.0, 0.1, costs) == pytest.approx(0.044)
    # 2 req/s * 4 s = 8 requests wait: 4 * (0.001 + 0.01 * 8)
    assert penalty_cost(4.0, 2.0, costs) == pytest.approx(0.324)


def test_plan_without_suspend_is_one_breakeven():
    costs = KeepAliveCosts(gpu_cost_per_s=0.001, wait_cost_per_s=0.01, restore_s=4.0)
    plan = plan_keepalive(0.1, costs)
    expect = -math.log(0.001 / (0.044 * 0.1)) / 0.1      # = 14.816 s
    assert plan.warm_s == pytest.approx(expect)
    assert plan.stop_s == plan.warm_s and plan.release_tier == "stop"
    assert plan.tier(expect - 0.1) == "warm" and plan.tier(expect) == "stopped"


def test_plan_with_suspend_has_a_suspended_stage():
    costs = KeepAliveCosts(gpu_cost_per_s=0.001, suspended_cost_per_s=0.0001,
                           wait_cost_per_s=0.01, restore_s=4.0, resume_s=0.5)
    plan = plan_keepalive(0.1, costs)
    resume_pen = 0.5 * (0.001 + 0.01)                   # 0.0055
    warm = -math.log(0.0009 / (resume_pen * 0.1)) / 0.1  # 0.0009 > 0.00055: 0
    assert warm < 0 and plan.warm_s == 0.0
    stop = -math.log(0.0001 / ((0.044 - resume_pen) * 0.1)) / 0.1
    assert plan.stop_s == pytest.approx(stop)            # 36.50 s
    assert plan.release_tier == "suspend"
    assert plan.tier(1.0) == "suspended" and plan.tier(stop + 1) == "stopped"


def test_keepalive_recomputed_as_traffic_changes():
    costs = KeepAliveCosts(gpu_cost_per_s=0.001, wait_cost_per_s=0.01, restore_s=4.0)
    quiet = plan_keepalive(0.02, costs).warm_s
    busy = plan_keepalive(0.5, costs).warm_s
    none = plan_keepalive(0.0, costs).warm_s
    assert none == 0.0 and quiet != busy


@pytest.mark.parametrize("kw", [dict(gpu_cost_per_s=-1.0), dict(restore_s=float("nan")),
                                dict(resume_s=5.0, restore_s=4.0),
                                dict(suspended_cost_per_s=1.0, gpu_cost_per_s=0.5)])
def test_costs_limits(kw):
    with pytest.raises(ConfigError):
        KeepAliveCosts(**kw)


# --- sizing from a measured speed (docs/architecture.md, "Capacity from measured rates") --

def _profile():
    from agent.speed import SpeedProfile

    # 1,000 prompt tokens/s, 10 ms per prefill, 20 ms decode step + 2 ms per extra sequence
    return SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.01,
                        decode_base_s=0.02, decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0)


def test_replicas_for_rate_uses_service_rps_at_the_sustainable_batch():
    from agent.predictor.sizing import replicas_for_rate

    prof = _profile()
    batch = prof.sustainable_concurrency(2.0, 100, 20, 16)
    per_rps = prof.service_rps(100, 20, batch)
    kw = dict(ttft_slo_s=2.0, mean_prompt_tokens=100, mean_gen_tokens=20, max_seqs=16,
              utilisation=1.0, min_replicas=0, max_replicas=50)
    assert replicas_for_rate(0.0, prof, **kw) == 0
    assert replicas_for_rate(per_rps * 0.99, prof, **kw) == 1
    assert replicas_for_rate(per_rps * 1.01, prof, **kw) == 2
    assert replicas_for_rate(per_rps * 2.5, prof, **kw) == 3
    assert replicas_for_rate(per_rps * 2.5, prof, **{**kw, "utilisation": 0.5}) == 5
    assert replicas_for_rate(math.nan, prof, **kw) == 0


def test_replicas_for_rate_is_not_kv_slots():
    """Sixteen KV slots but a batch the SLO allows of fewer: the speed decides."""
    from agent.predictor.sizing import replicas_for_rate
    from agent.speed import SpeedProfile

    slow = SpeedProfile(prefill_tokens_per_s=200.0, prefill_overhead_s=0.01,
                        decode_base_s=0.05, decode_per_seq_s=0.02, decode_per_ctx_token_s=0.0)
    kw = dict(ttft_slo_s=2.0, mean_prompt_tokens=200, mean_gen_tokens=20, max_seqs=16,
              utilisation=1.0, min_replicas=0, max_replicas=50)
    batch = slow.sustainable_concurrency(2.0, 200, 20, 16)
    assert batch < 16
    rate = 3 * slow.service_rps(200, 20, batch) * 0.99
    assert replicas_for_rate(rate, slow, **kw) == 3
    with pytest.raises(ConfigError):
        replicas_for_rate(1.0, slow, **{**kw, "max_seqs": 0})


def test_a_measured_sustained_rate_sizes_the_pool_instead_of_the_profile():
    from agent.predictor.sizing import replicas_for_rate
    from agent.speed import SpeedProfile
    from agent.throughput import BacklogCapacity

    speed = SpeedProfile(prefill_tokens_per_s=300.0, prefill_overhead_s=0.013,
                         decode_base_s=0.012, decode_per_seq_s=0.0025, decode_per_ctx_token_s=0.0)
    kw = dict(ttft_slo_s=2.0, mean_prompt_tokens=9.0, mean_gen_tokens=1.0, max_seqs=8,
              utilisation=1.0, min_replicas=0, max_replicas=4)
    estimate = speed.service_rps(9.0, 1.0, speed.sustainable_concurrency(2.0, 9.0, 1.0, 8))
    assert replicas_for_rate(1.5 * estimate, speed, **kw) == 2
    # the replica measured 2x the estimate while backlogged (prefills batched): one is enough
    sustained = BacklogCapacity(rps=2 * estimate, seconds=10.0, batch=8.0, prompt_tokens=9.0,
                                gen_tokens=1.0)
    assert replicas_for_rate(1.5 * estimate, speed, sustained=sustained, **kw) == 1
    assert replicas_for_rate(2.5 * estimate, speed, sustained=sustained, **kw) == 2
    # ... and it measured less than the estimate: the pool is sized up, not down
    slow = BacklogCapacity(rps=0.5 * estimate, seconds=10.0, batch=8.0, prompt_tokens=9.0,
                           gen_tokens=1.0)
    assert replicas_for_rate(0.9 * estimate, speed, sustained=slow, **kw) == 2
