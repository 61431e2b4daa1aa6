"""Simulator speed: one simulated hour at 200 req/s (720,000 requests) through the real code.

The production AdmissionQueue, Router and Predictor on a ManualClock, the cost scenario's
fleet (24 replicas of 80 sequences at peak).  Target: sim_wall_s_per_sim_hour <= 60 s on the
development machine.  Prints a table and writes JSON.

    .venv/bin/python bench/sim_speed.py [--hours 1] [--rps 200] [--json var/bench/sim_speed.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.sim.scenarios import CostShape, cost_policies, run_workload  # noqa: E402
from agent.sim.trace import synthetic  # noqa: E402

TARGET_S = 60.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hours", type=float, default=1.0)
    ap.add_argument("--rps", type=float, default=200.0)
    ap.add_argument("--policy", action="append", default=None,
                    help="policies to time (default: always_on, rewarm)")
    ap.add_argument("--json", type=Path, default=Path("var/bench/sim_speed.json"))
    args = ap.parse_args(argv)
    logging.getLogger("agent.predictor").setLevel(logging.WARNING)
    shape = CostShape(hours=args.hours, base_rps=args.rps, burst_rps=args.rps)
    w = synthetic(np.full(int(args.hours * 3600), args.rps), step_s=1.0,
                  occupancy_s=shape.occupancy_s, prefill_s=shape.prefill_s,
                  need_tokens=shape.need_tokens, rng=np.random.default_rng(0))
    rows = []
    for name in args.policy or ["always_on", "rewarm"]:
        cfg, make, _ = cost_policies(shape)[name]
        peak = int(np.ceil(args.rps * shape.occupancy_s / (shape.seqs_per_replica * 0.75)))
        s, rec, _ = run_workload(w, cfg, make, max_wait_s=shape.sla_s - shape.prefill_s,
                                 sla_s=shape.sla_s, initial_replicas=peak,
                                 end_s=args.hours * 3600.0, progress=True)
        rows.append({"policy": name, "requests": len(w), "sim_hours": s["sim_hours"],
                     "wall_s": rec.wall_s, "sim_wall_s_per_sim_hour": s["sim_wall_s_per_sim_hour"],
                     "us_per_request": rec.wall_s / len(w) * 1e6, "served": s["served"],
                     "sla_compliance": s["sla_compliance"],
                     "meets_target": s["sim_wall_s_per_sim_hour"] <= TARGET_S})
    print(f"{'policy':<12} {'requests':>9} {'wall s':>8} {'s/sim-h':>8} {'us/req':>7} "
          f"{'SLA %':>8}  target <= {TARGET_S:.0f} s/sim-h")
    for r in rows:
        print(f"{r['policy']:<12} {r['requests']:>9} {r['wall_s']:>8.1f} "
              f"{r['sim_wall_s_per_sim_hour']:>8.1f} {r['us_per_request']:>7.1f} "
              f"{100 * r['sla_compliance']:>8.3f}  {'ok' if r['meets_target'] else 'MISSED'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rps": args.rps, "hours": args.hours, "target_s": TARGET_S,
                                     "rows": rows,
                                     "sim_wall_s_per_sim_hour": max(r["sim_wall_s_per_sim_hour"]
                                                                    for r in rows)}, indent=1))
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
