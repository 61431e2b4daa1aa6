"""Scenario results on shortened shapes (the full runs live in the CLI and bench/)."""

import json

import pytest

from agent.cli import main
from agent.sim.plots import plot
from agent.sim.scenarios import (CostShape, SpikeShape, cost_scenario, run_spike_once,
                                 spike_scenario, spike_workload)

SHORT_SPIKE = SpikeShape(platform_calls=600, call_s=60.0, steady_s=300.0, ramp_s=300.0,
                         hold_s=600.0, tail_s=120.0, seqs_per_replica=16, tenant_share=0.04)


@pytest.mark.slow
def test_spike_sweep_slower_cold_start_needs_more_buffer(tmp_path):
    r = spike_scenario(SHORT_SPIKE, cold_starts_s=(10.0, 200.0), seed=1)
    fast, slow = r["sweep"]
    assert {"cold_start_s", "min_buffer_pct_zero_drops", "dropped_at_10pct",
            "shortage_minutes_at_10pct"} <= set(fast)
    assert fast["min_buffer_pct_zero_drops"] < slow["min_buffer_pct_zero_drops"]
    assert fast["dropped_at_10pct"] <= slow["dropped_at_10pct"]
    assert fast["shortage_minutes_at_10pct"] < slow["shortage_minutes_at_10pct"]
    assert slow["peak_shortfall_at_10pct"] > 0
    assert r["sim_wall_s_per_sim_hour"] > 0 and r["runs"] > 4
    # the bisection's answer really drops nothing
    w = spike_workload(SHORT_SPIKE, seed=1)
    b = slow["min_buffer_pct_zero_drops"] / 100
    assert run_spike_once(w, SHORT_SPIKE, 200.0, b)[0]["dropped"] == 0
    assert plot(r, tmp_path / "spike.png").stat().st_size > 10_000


def test_cost_short_run_orders_policies():
    shape = CostShape(hours=0.5, burst_s=300.0, burst_period_s=1800.0)
    r = cost_scenario(shape, only=("always_on", "snapshot_reactive", "rewarm"))
    by = {p["name"]: p for p in r["policies"]}
    assert by["always_on"]["gpu_hours_per_day"] == pytest.approx(576.0)   # 24 replicas
    assert by["always_on"]["sla_compliance"] == 1.0
    assert by["rewarm"]["gpu_hours_per_day"] < 0.5 * by["always_on"]["gpu_hours_per_day"]
    assert by["rewarm"]["sla_compliance"] > 0.99
    assert r["sim_wall_s_per_sim_hour"] > 0


def test_cli_cost_json_and_plot(tmp_path):
    out, png = tmp_path / "cost.json", tmp_path / "cost.png"
    startup = tmp_path / "bench.json"
    startup.write_text(json.dumps({"zygote_restore_s": 1.5, "naive_s": [50, 70]}))
    rc = main(["simulate", "--scenario", "cost", "--hours", "0.1", "--no-progress",
               "--startup-json", str(startup),
               "--policy", "always_on", "--policy", "rewarm", "--json", str(out),
               "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [p["name"] for p in data["policies"]] == ["always_on", "rewarm"]
    for p in data["policies"]:
        assert {"gpu_hours_per_day", "cost_per_1000_requests", "sla_compliance"} <= set(p)
    assert data["sim_wall_s_per_sim_hour"] > 0
    assert data["startup"]["restore_s"] == [1.5, 1.5] and data["startup"]["naive_s"] == [50, 70]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_trace_replay(tmp_path):
    csv = tmp_path / "t.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:17:{i // 10:02d}.{i % 10}000000,{500 + i},{20 + i % 7}"
             for i in range(300)]
    csv.write_text("\n".join(rows) + "\n")
    out = tmp_path / "trace.json"
    assert main(["simulate", "--trace", str(csv), "--no-progress", "--speedup", "2",
                 "--background-rps", "3", "--policy", "rewarm", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (p,) = data["policies"]
    assert p["requests"] > 300                # the trace plus background
    assert p["served"] + p["shed"] + p["expired"] + p["unfinished"] == p["requests"]
