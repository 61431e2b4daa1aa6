"""The replay's targets on every shape of traffic, in the simulator.

    bench/replay_shapes.py [--from-json REPLAY.json | --profile ENGINE_PROFILE.json]
                           [--restore-s 2.0] [--load 0.3,3] [--traces DIR] --json PATH

``--traces DIR``: every ``*.csv`` in DIR (the Azure trace format; the five reference traces
are not in the repository: link or copy them into ``var/traces``) is first run whole through
the fleet simulator, as ``rewarm simulate --trace`` runs it (agent/sim/scenarios.py
``trace_scenario``: every policy, each request held to its own SLO, base + prefill), twice:
with the front door's default deadline, the SLO itself (agent/slo.py), and with clients' own
deadlines of 3x the SLO.
It prints per trace and policy the SLA attainment, GPU-hours against always-on, 429s
(and how many were too large for any replica), 504s and late answers.

Four synthetic 10-minute traces in the Azure format's terms (Poisson arrivals, prompt and
output lengths drawn like a code-completion trace: lognormal around 1,500 / 20 tokens), each
scaled exactly as bench/trace_replay.py scales a window (agent/sim/replay_scale.py) and run
through the simulator as bench/trace_replay.py runs it (the production request path and
predictor, simulated replicas: agent/sim/pathsim.py):

- ``steady``: 3 req/s throughout;
- ``step_bursts``: 1 req/s with four 40 s steps to 15 req/s;
- ``ramps``: a linear rise from 0.5 to 8 req/s and back down;
- ``idle_gaps``: 4 req/s for a minute, then two minutes of nothing, repeated.

The replica's speed and restore time come from a live replay's JSON (``--from-json``, its
``profile`` and ``restore_s``), an engine profile (``--profile``), or, without either, a
stand-in profile of SmolLM2-135M on a quiet two-core machine (stated in the output).  It
prints, per shape and load, the SLA attainment, 429s and 504s, TTFT p99 per path and
GPU-seconds against the always-on pool sized for the shape's busiest 10 s, and which of
bench/trace_replay.py's targets hold.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import numpy as np  # noqa: E402

from agent.argtypes import positive_float  # noqa: E402

WINDOW_S = 600.0
MAX_SEQS, MAX_SEQ_LEN = 8, 512
# A stand-in when no measurement is given: SmolLM2-135M, one thread, a quiet core (the order of
# bench/cold_start.py's quiet-machine first tokens); used only when nothing measured is passed.
STAND_IN = {"prefill_tokens_per_s": 600.0, "prefill_overhead_s": 0.03, "decode_base_s": 0.025,
            "decode_per_seq_s": 0.003, "decode_per_ctx_token_s": 0.0}


def rates(shape: str) -> np.ndarray:
    """Per-second arrival rate [600] (req/s) of a shape."""
    t = np.arange(int(WINDOW_S), dtype=np.float64)
    if shape == "steady":
        return np.full_like(t, 3.0)
    if shape == "step_bursts":
        r = np.full_like(t, 1.0)
        for start in (60, 200, 340, 480):
            r[start:start + 40] = 15.0
        return r
    if shape == "ramps":
        return 0.5 + 7.5 * (1.0 - np.abs(t - 300.0) / 300.0)
    if shape == "idle_gaps":
        return np.where((t // 60) % 3 == 0, 4.0, 0.0)
    raise ValueError(shape)


SHAPES = ("steady", "step_bursts", "ramps", "idle_gaps")


def synthetic_rows(shape: str, seed: int = 0):
    """(arrival_s, context_tokens, generated_tokens) arrays of a shape."""
    from agent.sim.trace import poisson_arrivals

    rng = np.random.default_rng(seed)
    arrival = poisson_arrivals(rates(shape), step_s=1.0, rng=rng)
    n = arrival.shape[0]
    ctx = np.clip(rng.lognormal(np.log(1500), 0.8, n), 1, 8000).astype(np.int64)
    gen = np.clip(rng.lognormal(np.log(20), 0.9, n), 1, 2000).astype(np.int64)
    return arrival, ctx, gen


def run_traces(directory: Path) -> list[dict]:
    """Each ``*.csv`` of ``directory`` through the fleet simulator under both deadline
    policies; prints a table and returns one row per trace, policy and deadline."""
    from agent.sim.fleet import StartupTimes
    from agent.sim.scenarios import trace_scenario
    from agent.sim.trace import load_trace
    from agent.slo import DEADLINE_FACTOR, TtftSlo

    files = sorted(directory.glob("*.csv"))
    if not files:
        raise SystemExit(f"--traces {directory}: no *.csv file there")
    rows = []
    print(f"{'trace':<34} {'deadline':<9} {'policy':<20} {'SLA %':>7} {'GPU x on':>8} "
          f"{'429':>5} {'(big)':>5} {'504':>5} {'late':>5}")
    for f in files:
        w = load_trace(f)
        for label, factor in (("default (= SLO)", DEADLINE_FACTOR), ("client 3x SLO", 3.0)):
            r = trace_scenario(w, StartupTimes(), slo=TtftSlo(deadline_factor=factor))
            on = next(p for p in r["policies"] if p["name"] == "always_on")["gpu_hours"]
            for pol in r["policies"]:
                ratio = pol["gpu_hours"] / on if on else float("nan")
                print(f"{f.name[:34]:<34} {label:<9} {pol['name']:<20} "
                      f"{100 * pol['sla_compliance']:>7.3f} {ratio:>8.3f} {pol['shed']:>5} "
                      f"{pol['shed_too_large']:>5} {pol['expired']:>5} {pol['late']:>5}")
                rows.append({"trace": f.name, "requests": r["requests"],
                             "deadline_factor": factor, "policy": pol["name"],
                             "sla_compliance": pol["sla_compliance"], "gpu_hours": pol["gpu_hours"],
                             "gpu_ratio_always_on": ratio, "shed": pol["shed"],
                             "shed_too_large": pol["shed_too_large"],
                             "expired": pol["expired"], "late": pol["late"],
                             "cold_arrivals": pol["cold_arrivals"],
                             "starts_by_tier": pol["starts_by_tier"]})
    return rows


TITLE = "The simulator on every shape of traffic: the shipped traces and four synthetic shapes"


def tables(traces: list[dict], runs: list[dict]) -> list[dict]:
    """The figures the benchmarks page shows (bench/render_docs.py's ``tables``)."""
    out = []
    if traces:
        out.append({
            "title": "Fleet simulator, whole trace, per deadline policy (rewarm simulate --trace)",
            "columns": ["trace", "deadline", "policy", "SLA %", "GPU-h x always-on", "429",
                        "429 too large", "504", "late"],
            "rows": [[t["trace"], "= SLO" if t["deadline_factor"] == 1.0
                      else f"{t['deadline_factor']:g}x SLO", t["policy"],
                      round(100 * t["sla_compliance"], 3), round(t["gpu_ratio_always_on"], 3),
                      t["shed"], t["shed_too_large"], t["expired"], t["late"]] for t in traces],
            "notes": "SLO per request: 2 s warm / 4 s restore plus its own prefill; late = "
                     "served after its SLO (a miss). 429 too large: KV need beyond one replica."})
    if runs:
        out.append({
            "title": "Request path and predictor on virtual time, synthetic 10-minute shapes",
            "columns": ["shape", "load", "requests", "SLA", "429", "504", "GPU x always-on"],
            "rows": [[r["shape"], r["load"], r["requests"], round(r["sla_attainment"], 4),
                      r["shed_429"], r["expired_504"], round(r["gpu_ratio"], 3)] for r in runs]})
    return out


def headline(traces: list[dict], runs: list[dict]) -> list[list]:
    """The README's figures (bench/render_docs.py ``headline``): the rewarm policy at the
    default deadline on the traces where its SLA attainment was lowest, else the synthetic
    shapes' lowest attainment."""
    if traces:
        rewarm = sorted((t for t in traces if t["policy"] == "rewarm"
                         and t["deadline_factor"] == 1.0),
                        key=lambda t: (t["sla_compliance"], t["trace"]))
        return [[f"rewarm on {t['trace']}, deadline = SLO: SLA % / GPU-h x always-on",
                 f"{100 * t['sla_compliance']:.1f} / {t['gpu_ratio_always_on']:.2f}"]
                for t in rewarm]
    return [[f"{r['shape']} at load {r['load']:g}: SLA / GPU x always-on",
             f"{r['sla_attainment']:.3f} / {r['gpu_ratio']:.2f}"]
            for r in sorted(runs, key=lambda r: (r["sla_attainment"], r["shape"]))]


def main(argv: list[str] | None = None) -> int:
    from agent.sim.replay_scale import always_on_replicas, fit_scale, replay_requests
    from agent.speed import SpeedProfile
    from trace_replay import WARM_SLO_MS, simulate, verdict

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from-json", type=Path, help="a bench/trace_replay.py JSON")
    ap.add_argument("--profile", type=Path, help="an engine profile (bench/engine_profile.py)")
    ap.add_argument("--restore-s", type=positive_float, default=2.0)
    ap.add_argument("--load", default="0.3,3")
    ap.add_argument("--max-replicas", type=int, default=2)
    ap.add_argument("--wall-s", type=positive_float, default=240.0)
    ap.add_argument("--traces", type=Path, default=None,
                    help="a folder of trace CSVs to run through the fleet simulator first")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.getLogger("agent.predictor").setLevel(logging.WARNING)
    traces = run_traces(args.traces) if args.traces is not None else []
    restore_s, source = args.restore_s, "stand-in (no measurement given)"
    profile = SpeedProfile(**STAND_IN)
    actual = None    # the replicas serve at the speed they report, unless a replay measured it
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        run = (doc.get("runs") or [doc])[0]
        profile = SpeedProfile.from_meta(run["profile"])
        actual = SpeedProfile.from_meta(run.get("calibrated_profile") or {})
        restore_s, source = float(run["restore_s"]), f"{args.from_json} (live replay)"
    elif args.profile:
        profile, source = SpeedProfile.from_file(args.profile), str(args.profile)
    loads = [positive_float(x) for x in args.load.split(",")]
    print(f"profile: {source}: {profile}; restore {restore_s:.2f} s")
    out = []
    for shape in SHAPES:
        arrival, ctx, gen = synthetic_rows(shape)
        for load in loads:
            scale = fit_scale(ctx, gen, window_s=WINDOW_S, profile=profile, load=load,
                              wall_s=args.wall_s, ttft_slo_s=WARM_SLO_MS / 1000.0,
                              max_seqs=MAX_SEQS, max_tokens_per_request=MAX_SEQ_LEN)
            plan = replay_requests(arrival, ctx, gen, scale, MAX_SEQ_LEN)
            sim = simulate(plan, profile, max_seqs=MAX_SEQS, max_seq_len=MAX_SEQ_LEN,
                           restore_s=restore_s, cap=args.max_replicas,
                           mean_prompt_tokens=scale.mean_prompt_tokens,
                           mean_gen_tokens=scale.mean_output_tokens, span_s=scale.wall_s,
                           always_on_replicas=always_on_replicas(
                               [r.at_s for r in plan], scale.capacity_rps, args.max_replicas),
                           actual=actual)
            v = verdict({**sim, "load": load, "sim": sim})
            failed = [k for k, ok in v.items() if not ok and not k.startswith("sim_")]
            w, r = sim["ttft_ms"]["warm_hit"], sim["ttft_ms"]["snapshot_restore"]
            fmt = lambda x: "-" if x is None else f"{x:,.0f}"  # noqa: E731
            print(f"{shape:<12} load {load:<4g} n {sim['requests']:>5}  SLA "
                  f"{sim['sla_attainment']:.4f}  429 {sim['shed_429']:>4}  504 "
                  f"{sim['expired_504']:>4}  warm p99 {fmt(w['p99']):>6} ms  restore p99 "
                  f"{fmt(r['p99']):>6} ms  GPU {sim['gpu_ratio']:.2f}x always-on "
                  f"({sim['always_on_replicas']})  "
                  f"{'targets met' if not failed else 'NOT met: ' + ', '.join(failed)}")
            out.append({"shape": shape, "load": load, "scale": scale.to_json(), **sim,
                        "verdict": v})
    args.json.parent.mkdir(parents=True, exist_ok=True)
    from run_meta import run_meta

    args.json.write_text(json.dumps({"meta": run_meta(), "title": TITLE,
                                     "tables": tables(traces, out),
                                     "headline": headline(traces, out),
                                     "profile": profile.to_meta(),
                                     "profile_source": source, "restore_s": restore_s,
                                     "traces": traces, "runs": out}, indent=1) + "\n")
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
