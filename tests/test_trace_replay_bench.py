"""bench/trace_replay.py's pieces that need no stack: argument checks, policy, the verdict."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("trace_replay", REPO / "bench" / "trace_replay.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(load, **kw):
    r = {"load": load, "requests": 1000, "served": 995, "shed_429": 5,
         "shed_429_within_50ms": 5, "expired_504": 0, "lost": 0, "sla_attainment": 0.993,
         "ttft_ms": {"warm_hit": {"p50": 100.0, "p99": 1500.0},
                     "snapshot_restore": {"p50": 2000.0, "p99": 3500.0}},
         "gpu_seconds": 70.0, "always_on_gpu_seconds": 100.0}
    r.update(kw)
    r.setdefault("sim", {**{k: v for k, v in r.items() if k != "sim"}})
    return r


def test_a_run_that_meets_every_target(bench):
    v = bench.verdict(run(0.3))
    assert all(v.values()), v


@pytest.mark.parametrize("change,failed", [
    ({"sla_attainment": 0.98}, "sla_099"),
    ({"lost": 1}, "lost_0"),
    ({"expired_504": 6}, "expired_under_0_5pct"),
    ({"gpu_seconds": 81.0}, "gpu_under_0_8"),
    ({"gpu_seconds": 101.0}, "gpu_never_above_always_on"),
    ({"ttft_ms": {"warm_hit": {"p50": 100.0, "p99": 2001.0},
                  "snapshot_restore": {"p50": 2000.0, "p99": 3500.0}}}, "warm_p99_2000ms"),
])
def test_each_low_load_target_fails_alone(bench, change, failed):
    r = run(0.3)
    sim = dict(r["sim"])
    r.update(change)
    r["sim"] = sim
    v = bench.verdict(r)
    assert not v[failed]


def test_overload_targets(bench):
    r = run(3.0, served=500, shed_429=500, shed_429_within_50ms=470, expired_504=0)
    assert not bench.verdict(r)["fast_429_95pct"]          # 470 < 0.95 * 500
    r = run(3.0, served=500, shed_429=490, shed_429_within_50ms=490, expired_504=10)
    v = bench.verdict(r)
    assert v["fast_429_95pct"] and v["expired_under_1pct"]
    assert not bench.verdict(run(3.0, expired_504=11))["expired_under_1pct"]


def test_sim_agreement(bench):
    r = run(0.3)
    r["sim"] = {**r["sim"], "sla_attainment": 0.98, "gpu_seconds": 80.0}
    v = bench.verdict(r)
    assert not v["sim_sla_within_1pp"] and not v["sim_gpu_within_10pct"]
    assert v["sim_warm_hit_p99_within_25pct"]


def test_loads_and_policy(bench):
    assert bench.load_list("0.3,3") == [0.3, 3.0]
    with pytest.raises(argparse.ArgumentTypeError):
        bench.load_list("0.3,inf")
    pol = bench.predictor_policy(2.0, 2)
    assert pol["lead_time_s"] > pol["restore_p99_s"] + pol["decision_latency_s"]
    assert pol["max_replicas"] == 2


def test_deadline_policies(bench):
    assert bench.policy_list("default,client3x") == ["default", "client3x"]
    assert bench.deadline_factors()["default"] == 1.0     # the front door's: the SLO
    assert bench.deadline_factors()["client3x"] == 3.0
    with pytest.raises(argparse.ArgumentTypeError):
        bench.policy_list("slo")
    with pytest.raises(argparse.ArgumentTypeError):
        bench.policy_list("slo,loose")
    with pytest.raises(argparse.ArgumentTypeError):
        bench.policy_list(",")


def test_a_bad_trace_exits_2_before_any_stack(bench, tmp_path, capsys):
    bad = tmp_path / "b.csv"
    bad.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,1,\xff\n")
    assert bench.main(["--trace", str(bad), "--json", str(tmp_path / "o.json")]) == 2
    assert "line 2" in capsys.readouterr().err


def test_records_are_strict_json_when_a_decision_never_saw_a_request(bench, tmp_path):
    # idle_s is inf before a model's first request (agent/predictor/loop.py): json.dumps
    # wrote the bare word Infinity, which no strict JSON reader (jq, JSON.parse) accepts
    import json
    import math
    from types import SimpleNamespace

    d = SimpleNamespace(at_s=5.0, action="hold", target=0, desired=0, reason="idle",
                        forecast_rps=float("nan"), idle_s=math.inf, keepalive_s=30.0,
                        cold_miss=None)
    bench.write_records(tmp_path / "rec", 1.0, "default", [], [], [d])

    def refuse(word):
        raise ValueError(f"not JSON: {word}")
    lines = (tmp_path / "rec.1.default.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=refuse) for line in lines]
    assert rows == [{"kind": "decision", "t_s": 0.0, "action": "hold", "target": 0,
                     "desired": 0, "reason": "idle", "forecast_rps": None, "idle_s": None,
                     "keepalive_s": 30.0, "cold_miss": None}]


def test_the_0_8_gpu_target_applies_only_where_the_window_has_idle_minutes(bench):
    busy = run(0.3, gpu_seconds=95.0, idle_minutes=0)      # no idle minute: <= 1.0x only
    v = bench.verdict(busy)
    assert "gpu_under_0_8" not in v and v["gpu_never_above_always_on"]
    assert not bench.verdict(run(0.3, gpu_seconds=95.0, idle_minutes=2))["gpu_under_0_8"]


def test_idle_minutes_and_fluid_bounds(bench):
    import numpy as np

    from agent.sim.replay_scale import ReplayRequest
    from agent.speed import SpeedProfile
    from agent.throughput import BacklogCapacity

    assert bench.idle_minutes(np.array([0.0, 30.0, 200.0, 201.0])) == 2   # one 170 s gap
    assert bench.idle_minutes(np.array([0.0, 59.0])) == 0
    plan = [ReplayRequest(0.0, 10, 1) for _ in range(6)] + [ReplayRequest(5.0, 10, 1)]
    speed = SpeedProfile(1000.0, 0.0, 0.01, 0.0, 0.0)
    sustained = BacklogCapacity(rps=2.0, seconds=10.0, batch=1.0, prompt_tokens=10.0,
                                gen_tokens=1.0)
    bounds = bench.fluid_bounds(plan, speed, sustained, 1, 2)
    # 0.5 s each: one replica starts 5 of the 6 within 2 s, then the late one; two, all
    assert bounds == {1: pytest.approx(6 / 7), 2: 1.0}


def test_the_spread_of_repeated_runs(bench):
    runs = [run(0.3, sla_attainment=x, deadline_policy="default") for x in (0.991, 0.995, 0.989)]
    for r, s in zip(runs, (0.99, 0.99, 0.992), strict=True):
        r["sim"]["sla_attainment"] = s
    table = bench.spread_table(runs + [run(0.3, deadline_policy="client3x")])
    assert table["rows"] == [["0.3", "default", 3, "0.9910 / 0.9950 / 0.9890", 0.6, 0.2]]
    assert bench.spread_table([run(0.3)]) is None          # one run: no spread
