"""The replay through the production request path (agent/sim/pathsim.py) on synthetic traces
of several shapes: it ends, answers every request, refuses early when no capacity can make the
SLO, serves through a restore when one can, and agrees with the older simulator
(tests/sim/replay_sim.py) where both model the same thing.  Virtual time only: no test sleeps."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agent.errors import ConfigError
from agent.predictor.keepalive import KeepAliveCosts
from agent.sim.pathsim import PathSimConfig, simulate_path
from agent.sim.replay_scale import ReplayRequest
from agent.sim.vloop import LoopClock, VirtualLoop, run_virtual
from agent.speed import SpeedProfile

SPEED = SpeedProfile(prefill_tokens_per_s=2000.0, prefill_overhead_s=0.01, decode_base_s=0.03,
                     decode_per_seq_s=0.004, decode_per_ctx_token_s=1e-6)


def policy(restore_s: float, cap: int) -> dict:
    return {"restore_p99_s": restore_s, "decision_latency_s": 1.0,
            "lead_time_s": restore_s + 2.0, "ttft_slo_s": 2.0, "max_replicas": cap,
            "costs": KeepAliveCosts(restore_s=restore_s)}


def run(plan, *, restore_s=1.0, cap=2, initial=1, span_s=None, records=None):
    span = span_s if span_s is not None else (plan[-1].at_s if plan else 0.0)
    return simulate_path(plan, SPEED, max_seqs=8, max_seq_len=512, restore_s=restore_s,
                         policy=policy(restore_s, cap), mean_prompt_tokens=40,
                         mean_gen_tokens=8, initial_replicas=initial, span_s=span,
                         config=PathSimConfig(max_replicas=cap, restores_per_model=cap),
                         records=records)


def poisson(rate_rps: float, seconds: float, seed: int = 0, start_s: float = 0.0,
            prompt: int = 40, output: int = 8) -> list[ReplayRequest]:
    rng = np.random.default_rng(seed)
    t = start_s + np.cumsum(rng.exponential(1.0 / rate_rps, int(rate_rps * seconds * 1.5)))
    return [ReplayRequest(float(x), prompt, output) for x in t if x < start_s + seconds]


def answered_all(out: dict) -> None:
    assert out["lost"] == 0
    assert out["served"] + out["shed_429"] + out["expired_504"] == out["requests"]


# --- the virtual loop ---------------------------------------------------------------------

def test_virtual_loop_jumps_to_the_next_timer_and_runs_them_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        clock, seen = LoopClock(loop), []
        loop.call_later(5.0, lambda: seen.append(("b", clock.now())))
        loop.call_later(2.0, lambda: seen.append(("a", clock.now())))
        await asyncio.sleep(3600.0)
        return seen, clock.now()
    seen, end = run_virtual(main(), start_s=100.0)
    assert seen == [("a", 102.0), ("b", 105.0)]
    assert end == pytest.approx(3700.0)


def test_virtual_loop_refuses_to_wait_forever():
    async def main():
        await asyncio.get_running_loop().create_future()   # nobody will set it
    with pytest.raises(ConfigError, match="deadlock"):
        run_virtual(main())
    loop = VirtualLoop()
    assert loop.time() == 0.0
    loop.close()


# --- shapes ---------------------------------------------------------------------------------

def test_steady_light_load_is_served_warm_within_the_slo():
    plan = poisson(2.0, 120.0)
    out = run(plan)
    answered_all(out)
    assert out["served"] == len(plan)
    warm = out["ttft_ms"]["warm_hit"]
    # the predictor may bring up a second replica early on: a request it serves that arrived
    # before it came up is on the restore path, the rest are warm hits
    assert warm["count"] >= 0.95 * len(plan)
    assert warm["p99"] < 2000.0
    # at least the own prefill, never less
    assert warm["p50"] >= SPEED.prefill_s(40) * 1000.0 - 1e-6
    assert out["sla_attainment"] == 1.0


def test_step_burst_from_zero_when_the_restore_cannot_make_the_slo_is_refused_at_once():
    plan = poisson(20.0, 2.0, start_s=10.0)
    out = run(plan, restore_s=10.0, initial=0, span_s=30.0)   # restore 10 s > SLO 4 s
    answered_all(out)
    assert out["served"] == 0 or out["ttft_ms"]["snapshot_restore"]["count"] == out["served"]
    unserved = out["requests"] - out["served"]
    assert out["shed_429"] == unserved > 0
    assert out["shed_429_within_50ms"] == out["shed_429"]
    assert out["expired_504"] == 0


def test_step_burst_from_zero_is_served_through_a_restore_that_makes_the_slo():
    plan = poisson(4.0, 3.0, start_s=10.0)
    records: dict = {}
    out = run(plan, restore_s=1.0, initial=0, span_s=40.0, records=records)
    answered_all(out)
    restore = out["ttft_ms"]["snapshot_restore"]
    assert restore["count"] > 0 and out["restores"] >= 1
    first = records["outcomes"][0]
    assert first.code == 200 and first.path == "snapshot_restore"
    assert first.ttft_ms >= 1000.0           # the first waited for the whole restore (1 s) ...
    assert restore["p99"] <= 4000.0          # ... and all within the restore path's SLO
    assert out["expired_504"] == 0


def test_ramp_and_a_long_idle_gap_scale_down_and_up_and_lose_nothing():
    ramp = [ReplayRequest(float(t), 40, 8) for t in np.cumsum(1.0 / np.linspace(1, 12, 400))]
    gap_end = ramp[-1].at_s + 200.0
    after = poisson(3.0, 20.0, seed=3, start_s=gap_end)
    records: dict = {}
    out = run(ramp + after, restore_s=1.0, span_s=after[-1].at_s + 5.0, records=records)
    answered_all(out)
    actions = [d.action for d in records["decisions"]]
    assert "scale_down" in actions            # the predictor released the idle replicas
    late = records["outcomes"][len(ramp):]
    assert any(o.path == "snapshot_restore" for o in late)   # capacity came back for them
    assert out["restores"] >= 1
    # scaled to zero in the gap: fewer replica-seconds than one replica the whole span
    assert out["gpu_seconds"] < out["one_replica_gpu_seconds"]
    assert out["served"] >= 0.9 * out["requests"]


def test_overload_is_refused_early_not_expired():
    plan = poisson(200.0, 5.0, prompt=200, output=32)
    out = run(plan, restore_s=1.0, cap=1)
    answered_all(out)
    assert out["shed_429"] > 0
    assert out["expired_504"] <= 0.01 * out["requests"]


def test_agrees_with_the_old_simulator_on_a_warm_steady_replay():
    """One warm replica, no restores needed: both simulators serve every request warm with
    the same replica model, so their counts agree and their TTFTs are close."""
    from tests.sim.replay_sim import simulate_plan

    plan = poisson(1.0, 200.0, seed=7)
    new = run(plan, cap=1)
    old = simulate_plan(plan, SPEED, batch=8, kv_capacity_tokens=8 * 512, restore_s=1.0,
                        policy=policy(1.0, 1), max_replicas=1, initial_replicas=1,
                        warm_slo_s=2.0, restore_slo_s=4.0, max_seqs=8, mean_prompt_tokens=40,
                        mean_gen_tokens=8, span_s=plan[-1].at_s)
    assert new["served"] == old["served"] == len(plan)
    for q in ("p50", "p99"):
        a, b = new["ttft_ms"]["warm_hit"][q], old["ttft_ms"]["warm_hit"][q]
        assert abs(a - b) <= 0.25 * b, (q, a, b)


@pytest.mark.parametrize("at_s, prompt, output, field", [
    (float("nan"), 40, 8, "at_s"), (-1.0, 40, 8, "at_s"), (float("inf"), 40, 8, "at_s"),
    ("3", 40, 8, "at_s"), (True, 40, 8, "at_s"), (0.0, -1, 8, "prompt_tokens"),
    (0.0, 40, 2.5, "output_tokens"), (0.0, True, 8, "prompt_tokens")])
def test_a_plan_request_that_is_no_time_or_count_is_refused_by_name(at_s, prompt, output, field):
    with pytest.raises(ConfigError) as err:
        ReplayRequest(at_s, prompt, output)
    assert err.value.name == field and repr(err.value.value) in str(err.value)


def test_plans_at_the_edges_end_and_answer_every_request():
    assert run([])["requests"] == 0
    assert ReplayRequest(0, 0, 0).at_s == 0               # at the limits: accepted
    one = run([ReplayRequest(0.0, 40, 8)])
    assert one["served"] == 1 and one["lost"] == 0
    burst = run([ReplayRequest(1.0, 40, 8)] * 50)          # all at one instant
    assert burst["requests"] == 50 and burst["lost"] == 0
    assert burst["served"] + burst["shed_429"] == 50


def test_a_lone_request_after_scale_to_zero_is_served_by_one_restore():
    """The front door's stats count the model from 0, so the predictor sees the first request
    (it took the counter's first appearance as its baseline, kept scaling to zero and drained
    each restored replica under the held request: 4 restores, then a 429 three seconds late)."""
    records: dict = {}
    out = run([ReplayRequest(5.0, 40, 8)], span_s=10.0, records=records)
    assert out["served"] == 1 and out["lost"] == 0 and out["shed_429"] == 0
    assert out["restores"] == 1 and out["counts"].get("rerouted", 0) == 0
