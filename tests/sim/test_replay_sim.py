"""The simulator's side of a live replay: same requests, same profile, same predictor policy."""

import pytest

from agent.sim.replay_scale import ReplayRequest
from tests.sim.replay_sim import plan_workload, simulate_plan
from agent.speed import SpeedProfile

PROFILE = SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.02,
                       decode_base_s=0.02, decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0)


def run(plan, **kw):
    args = dict(batch=4, kv_capacity_tokens=4096, restore_s=2.0,
                policy={"restore_p99_s": 2.0, "lead_time_s": 4.0, "max_replicas": 2},
                max_replicas=2, initial_replicas=1, warm_slo_s=2.0, restore_slo_s=4.0,
                max_seqs=8, mean_prompt_tokens=20.0, mean_gen_tokens=2.0)
    args.update(kw)
    return simulate_plan(plan, PROFILE, **args)


def test_plan_workload_times_each_request_by_the_profile():
    w = plan_workload([ReplayRequest(0.0, 100, 1), ReplayRequest(1.0, 10, 5)], PROFILE, 1)
    assert w.prefill_s.tolist() == pytest.approx([0.12, 0.03])
    assert w.occupancy_s.tolist() == pytest.approx([0.12, 0.03 + 4 * 0.02])
    assert w.need_tokens.tolist() == [101, 15]


def test_a_light_steady_replay_is_served_within_the_slo():
    plan = [ReplayRequest(0.1 * i, 20, 2) for i in range(200)]     # 10 req/s, ~0.05 s each
    s = run(plan)
    assert s["requests"] == 200 and s["served"] == 200 and s["lost"] == 0
    assert s["sla_attainment"] == 1.0 and s["ttft_ms"]["warm_hit"]["p99"] < 200.0


def test_an_idle_gap_releases_the_replica_and_the_next_burst_waits_for_a_restore():
    plan = [ReplayRequest(0.1 * i, 20, 2) for i in range(20)] + \
           [ReplayRequest(120.0 + 0.1 * i, 20, 2) for i in range(20)]
    s = run(plan)
    assert s["gpu_seconds"] < 0.5 * s["always_on_gpu_seconds"]
    assert s["restores"] >= 1
    restored = s["ttft_ms"]["snapshot_restore"]
    assert restored["count"] >= 1 and restored["p50"] >= 2000.0   # waited the 2 s restore


def test_overload_is_refused_not_lost():
    plan = [ReplayRequest(0.005 * i, 200, 2) for i in range(2000)]  # far past two replicas
    s = run(plan)
    assert s["lost"] == 0
    assert s["shed_429"] + s["expired_504"] > 0
    assert s["served"] + s["shed_429"] + s["expired_504"] == s["requests"]
