"""Scaling to zero where it pays: the product's policy on a trickle, a stream and long prompts."""

import json
from datetime import datetime, timedelta

import numpy as np
import pytest

from agent.cli import main
from agent.sim.scenarios import trace_scenario
from agent.sim.trace import load_trace
from agent.slo import TtftSlo


def write_trace(path, offsets_s, prompt=800, output=60):
    t0 = datetime(2024, 1, 1)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for k, off in enumerate(offsets_s):
        ts = (t0 + timedelta(seconds=float(off))).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
        p = prompt[k] if isinstance(prompt, list) else prompt
        rows.append(f"{ts},{p},{output}")
    path.write_text("\n".join(rows) + "\n")
    return path


def by_name(result):
    return {p["name"]: p for p in result["policies"]}


@pytest.fixture
def trickle(tmp_path):
    rng = np.random.default_rng(3)
    gaps = rng.uniform(300.0, 900.0, size=24)          # 5 to 15 minutes between requests
    return write_trace(tmp_path / "trickle.csv", np.cumsum(gaps) - gaps[0])


def test_a_trickle_costs_a_small_fraction_of_always_on(trickle):
    r = by_name(trace_scenario(load_trace(trickle), slo=TtftSlo()))
    on, rw = r["always_on"], r["rewarm"]
    assert rw["gpu_hours"] < 0.2 * on["gpu_hours"]
    assert rw["starts_by_tier"]["restore"] + rw["starts_by_tier"]["suspended"] >= 10
    assert rw["sla_compliance"] == 1.0                   # every cold start within 4 s + prefill
    assert rw["cold_arrivals"] >= 10 and rw["cold_within_slo"] == rw["cold_arrivals"]
    # the baseline that cold-boots goes to zero too, and its 60-90 s boots miss the deadline
    sz = r["scale_to_zero"]
    assert sz["gpu_hours"] < on["gpu_hours"] and sz["expired"] > 0


def test_a_steady_stream_keeps_its_replica(tmp_path):
    offsets = np.arange(0.0, 1800.0, 2.5)               # a request every 2.5 s for 30 min
    r = by_name(trace_scenario(load_trace(write_trace(tmp_path / "s.csv", offsets)),
                               slo=TtftSlo()))
    rw = r["rewarm"]
    assert rw["starts_by_tier"] == {"suspended": 0, "restore": 0, "naive": 0}
    assert rw["sla_compliance"] == 1.0
    assert rw["gpu_hours"] <= r["always_on"]["gpu_hours"] + 1e-9


def test_long_prompts_meet_an_slo_that_counts_their_prefill(tmp_path):
    # 20,000-token prompts: a 5 s prefill at the default 4,000 tokens/s
    offsets = np.arange(0.0, 600.0, 20.0)
    w = load_trace(write_trace(tmp_path / "long.csv", offsets, prompt=20_000, output=20))
    fixed = by_name(trace_scenario(w, sla_s=4.0, kv_capacity_tokens=200_000,
                                   only=("always_on",)))["always_on"]
    per_request = by_name(trace_scenario(w, slo=TtftSlo(), kv_capacity_tokens=200_000,
                                         only=("always_on", "rewarm")))
    assert fixed["sla_compliance"] == 0.0               # a 4 s SLO no 5 s prefill can meet
    assert per_request["always_on"]["sla_compliance"] == 1.0
    assert per_request["rewarm"]["sla_compliance"] == 1.0
    assert per_request["rewarm"]["expired"] == 0


def test_the_default_deadline_refuses_what_a_client_deadline_of_3x_would_serve_late(tmp_path):
    # a burst of 40 at once on one replica's worth of slots: later ones wait past their SLO
    offsets = np.concatenate([[0.0], np.full(40, 600.0)])
    w = load_trace(write_trace(tmp_path / "burst.csv", offsets))
    tight = by_name(trace_scenario(w, slo=TtftSlo(), seqs_per_replica=4,
                                   only=("rewarm",)))["rewarm"]
    assert TtftSlo().deadline_factor == 1.0             # the default deadline is the SLO
    loose = by_name(trace_scenario(w, slo=TtftSlo(deadline_factor=3.0), seqs_per_replica=4,
                                   only=("rewarm",)))["rewarm"]
    assert tight["late"] == 0                           # past the SLO is past the deadline
    assert loose["served"] > tight["served"]            # a late answer beats a refusal
    assert loose["late"] > 0                            # ... and it is counted as a miss
    assert loose["sla_compliance"] == pytest.approx(tight["sla_compliance"])


def test_cli_reports_the_per_request_slo(trickle, tmp_path):
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", str(trickle), "--no-progress", "--policy", "rewarm",
                 "--deadline-factor", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["slo"] == {"warm_base_s": 2.0, "restore_base_s": 4.0, "deadline_factor": 1.0}
    (p,) = data["policies"]
    assert p["sla_s"] == "per request" and p["sla_compliance"] == 1.0
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", str(trickle), "--no-progress", "--sla-s", "4",
              "--deadline-factor", "2"])
