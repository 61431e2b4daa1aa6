"""``rewarm simulate``: replay traffic through the real control plane on a virtual clock.

    rewarm simulate --scenario spike|cost [--json PATH] [--plot PATH.png]
    rewarm simulate --trace PATH [--speedup X] [--background-rps R] [--json PATH] [--plot PATH.png]
                    [--deadline-factor F | --sla-s S]

A trace's requests are each held to their own TTFT SLO, ``base + prefill`` (2 s warm, 4 s
when they wait for a restore; agent/slo.py), and refused or expired against a deadline of
``--deadline-factor`` times it (default 1, agent/slo.py's: the deadline is the SLO); ``--sla-s S``
instead holds every request to one fixed S, which is also its deadline.

``--startup-json PATH`` takes start-up times per tier from a benchmark's JSON (keys
``restore_s``/``zygote_restore_s``, ``suspended_s``/``resume_s``, ``naive_s``).

``--replica-profile PATH`` (with ``--trace``) runs the simulated replicas at the speed
bench/engine_profile.py measured on the real engine — batched, prefill then one decode step,
its slots, its start-up times per tier (unless ``--startup-json``) — instead of the design
documents' fixed occupancy; ``--token-scale F`` scales the trace's token counts first (a
request longer than a slot is shrunk to fit, and counted).  The document scenarios
(``--scenario``) keep their own parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from agent.argtypes import deadline_factor, nonneg_float, positive_float


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate fleet policy, capacity and cost",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenario", choices=["spike", "cost"],
                     help="spike: one burst by cold-start tier; cost: a day of traffic by policy")
    src.add_argument("--trace", type=Path, help="CSV: TIMESTAMP,ContextTokens,GeneratedTokens")
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("--plot", type=Path, help="draw a PNG here")
    p.add_argument("--startup-json", type=Path, help="start-up seconds per tier (bench JSON)")
    p.add_argument("--hours", type=positive_float, default=24.0, help="cost: simulated hours (24)")
    p.add_argument("--cold-starts", default=None,
                   help="spike: comma-separated cold-start seconds (restore,26,60,120,180,260,336)")
    p.add_argument("--speedup", type=positive_float, default=1.0, help="trace: time compression")
    p.add_argument("--background-rps", type=nonneg_float, default=0.0,
                   help="trace: steady background traffic of other tenants (req/s)")
    p.add_argument("--replica-profile", type=Path,
                   help="trace: replicas at this engine profile's speed (bench/engine_profile.py)")
    p.add_argument("--token-scale", type=positive_float, default=1.0,
                   help="trace with --replica-profile: multiply token counts (1.0)")
    p.add_argument("--sla-s", type=positive_float, default=None,
                   help="trace: one fixed TTFT SLO for every request, which is also its deadline "
                        "(default: per request, base + prefill, agent/slo.py)")
    p.add_argument("--deadline-factor", type=deadline_factor, default=None, metavar="F",
                   help="trace: each request's deadline over its SLO (>= 1; default 1, "
                        "agent/slo.py's: the deadline is the SLO)")
    p.add_argument("--policy", action="append", help="only these policies (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic arrivals")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run, parser=p)


def _table(result: dict) -> str:
    if result["scenario"] == "spike":
        rows = ["cold start s | min buffer % (0 drops) | dropped @10% | shortage min @10% | "
                "peak shortfall @10%"]
        for r in result["sweep"]:
            rows.append(f"{r['cold_start_s']:>12g} | {str(r['min_buffer_pct_zero_drops']):>21} | "
                        f"{r['dropped_at_10pct']:>12} | {r['shortage_minutes_at_10pct']:>17.2f} | "
                        f"{r['peak_shortfall_at_10pct']:>19}")
        rows.append("published AOT figures: 26 s needs < 3%, 5.6 min ~18%; at 10% 26 s drops nothing, "
                    "5.6 min is short > 4 min with ~800 calls stranded at worst")
        return "\n".join(rows)
    rows = [f"{'policy':<20} | GPU-h/day (doc) | $/1k req (doc basis) | SLA % (doc) | shed | "
            f"expired | late | TTFT p99 queued ms"]
    for p in result["policies"]:
        d = result["doc"].get(p["name"], {})
        q99 = p["ttft_ms"]["queued"]["p99"]
        basis = p.get("cost_per_1000_requests_doc_basis")   # only where the document has a row
        basis = "-" if basis is None or math.isnan(basis) else f"{basis:.3f}"
        rows.append(
            f"{p['name']:<20} | {p['gpu_hours_per_day']:7.1f} ({d.get('gpu_hours_per_day', '-'):>3}) | "
            f"{p['cost_per_1000_requests']:.3f} ({basis};"
            f" doc {d.get('cost_per_1000_requests', '-')}) | {100 * p['sla_compliance']:.3f} "
            f"({100 * d['sla_compliance'] if d else '-'}) | {p['shed']} | {p['expired']} | "
            f"{p.get('late', '-')} | "
            f"{'-' if q99 is None else f'{q99:.0f}'}")
    return "\n".join(rows)


def run(args) -> int:
    from agent.sim import scenarios
    from agent.sim.fleet import StartupTimes

    # the predictor logs each tick at INFO; a simulated day is 86,400 ticks
    logging.getLogger("agent.predictor").setLevel(logging.WARNING)
    replica = None
    if args.replica_profile is not None:
        if args.scenario:
            args.parser.error("--replica-profile runs a --trace; the document scenarios keep "
                              "their own replica model")  # inconsistent flags: usage, exit 2
        from agent.sim.profile import ReplicaProfile

        replica = ReplicaProfile.from_file(args.replica_profile)
    if args.startup_json:
        startup = StartupTimes.from_json(args.startup_json)
    elif replica is not None and replica.startup is not None:
        startup = replica.startup
    else:
        startup = StartupTimes()
    progress = not args.no_progress
    only = tuple(args.policy) if args.policy else None
    if args.scenario == "spike":
        # the documents' points, plus rewarm's own start-up: a snapshot restore
        cold = (startup.restore_s[1],) + scenarios.DEFAULT_COLD_STARTS if not args.cold_starts \
            else tuple(float(x) for x in args.cold_starts.split(","))
        result = scenarios.spike_scenario(cold_starts_s=cold, seed=args.seed, progress=progress)
    elif args.scenario == "cost":
        result = scenarios.cost_scenario(scenarios.CostShape(hours=args.hours), startup,
                                         seed=args.seed, progress=progress, only=only)
    else:
        import numpy as np

        from agent.sim.trace import background, load_trace, mix, time_scale

        w = load_trace(args.trace)
        if args.speedup != 1.0:
            w = time_scale(w, args.speedup)
        if args.background_rps > 0:
            w = mix(w, background(w.duration_s, args.background_rps,
                                  occupancy_s=float(w.occupancy_s.mean()),
                                  prefill_s=float(np.median(w.prefill_s)),
                                  need_tokens=int(w.need_tokens.mean()),
                                  rng=np.random.default_rng(args.seed)))
        from agent.slo import DEADLINE_FACTOR, TtftSlo

        slo = None
        if args.sla_s is None:
            slo = TtftSlo(deadline_factor=args.deadline_factor or DEADLINE_FACTOR)
        elif args.deadline_factor is not None:
            args.parser.error("--deadline-factor applies to the per-request SLO; --sla-s "
                              "fixes one SLO that is also the deadline")
        result = scenarios.trace_scenario(w, startup, seed=args.seed, progress=progress, only=only,
                                          sla_s=args.sla_s or 4.0, replica=replica,
                                          token_scale=args.token_scale, slo=slo)
        result["trace"] = str(args.trace)
    print(_table(result))
    print(f"sim_wall_s_per_sim_hour: {result['sim_wall_s_per_sim_hour']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=float))
    if args.plot:
        from agent.sim.plots import plot

        plot(result, args.plot)
    return 0
