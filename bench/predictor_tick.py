"""Predictor decision latency and forecast quality on a real trace.

    bench/predictor_tick.py [--models 1,10,100] [--ticks 3600] [--trace PATH] --json PATH

Decision latency is one input of the lead-time rule (lead time > restore p99 + decision
latency, docs/architecture.md, "Sizing"); ModelPolicy's
default budget is ``decision_latency_s = 1.0``. For N models, each tick observes every model
and decides (Predictor.tick) against an in-memory scaler; the table gives the mean and p99
wall time of one whole tick. The trace part replays a trace CSV (``--trace``; docs/architecture.md, "Traces")
binned per second through one model and reports the 15 s forecast's mean absolute error
against the mean rate over the next 15 s, next to "the next 15 s are like this second".
Target: p99 tick time for 100 models far below the 1 s budget (< 10 ms).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import random
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.clock import ManualClock  # noqa: E402
from agent.predictor.forecast import Holt  # noqa: E402
from agent.predictor.loop import ModelPolicy, Predictor  # noqa: E402

TRACE = REPO / "bench" / "traces" / "azure_llm_2023_code.csv"


class _Scaler:
    def __init__(self):
        self.t = {}

    def set_target(self, model, count, *, reason):
        self.t[model] = count

    def target(self, model):
        return self.t.get(model, 0)


def tick_latency(n_models: int, ticks: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    clock = ManualClock()
    names = [f"m{i}" for i in range(n_models)]
    pred = Predictor([ModelPolicy(n) for n in names], clock=clock, scaler=_Scaler(),
                     snapshot_durable=lambda m: True)
    times = []
    for t in range(ticks):
        clock.advance(1.0)
        burst = 200 if (t // 300) % 2 else 20
        start = time.perf_counter()
        for n in names:
            pred.observe(n, rng.randint(0, burst))
        pred.tick()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"models": n_models, "ticks": ticks, "mean_ms": statistics.fmean(times) * 1e3,
            "p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3}


def trace_error(path: Path, h: int = 15) -> dict:
    with open(path, newline="") as f:
        stamps = [datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
                  for r in csv.DictReader(f)]
    t0 = int(stamps[0])
    counts = [0] * (int(stamps[-1]) - t0 + 1)
    for s in stamps:
        counts[int(s) - t0] += 1
    p = ModelPolicy("m")
    holt = Holt(p.alpha, p.beta, p.phi)
    err_h = err_n = 0.0
    for t, x in enumerate(counts[:-h]):
        holt.update(x)
        future = sum(counts[t + 1:t + h + 1]) / h
        err_h += abs(holt.forecast(h) - future)
        err_n += abs(x - future)
    n = len(counts) - h
    return {"seconds": len(counts), "requests": len(stamps), "mean_rps": len(stamps) / len(counts),
            "holt_mae_rps": err_h / n, "naive_mae_rps": err_n / n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="1,10,100")
    ap.add_argument("--ticks", type=int, default=3600)
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.getLogger("agent.predictor").setLevel(logging.WARNING)
    rows = [tick_latency(int(n), args.ticks) for n in args.models.split(",")]
    print(f"{'models':>7} {'ticks':>6} {'mean ms/tick':>13} {'p99 ms/tick':>12}")
    for r in rows:
        print(f"{r['models']:>7} {r['ticks']:>6} {r['mean_ms']:>13.3f} {r['p99_ms']:>12.3f}")
    out = {"tick": rows, "target_p99_ms_at_100_models": 10.0}
    if args.trace.exists():
        tr = trace_error(args.trace)
        out["trace"] = tr
        print(f"\ntrace {args.trace.name}: {tr['requests']} requests in {tr['seconds']} s "
              f"({tr['mean_rps']:.2f} req/s)")
        print(f"15 s forecast MAE: holt {tr['holt_mae_rps']:.3f} req/s, "
              f"naive {tr['naive_mae_rps']:.3f} req/s")
    else:
        print(f"\ntrace not found at {args.trace}; skipped")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
