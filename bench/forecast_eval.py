"""Forecasters judged at the lead time the predictor needs, on any trace in the Azure CSV format.

    bench/forecast_eval.py --trace CSV [--restore-p99-s 3.6] [--decision-s 1.0] [--step-s 1]
                           [--q 0.9] --json PATH

The trace is binned into requests per second per ``--step-s`` step (the predictor's step).
Each candidate of :func:`agent.predictor.forecast.build_forecaster` is fed the series one step
at a time and its forecast ``lead`` steps ahead is compared with the rate then, where
``lead = ceil((restore p99 + decision latency) / step)`` (agent/sim/forecast_eval.py): MAE and
the 0.9-quantile pinball loss, the share of steps under-forecast and the mean forecast (a
proxy for the capacity it would hold).  The candidates are persistence (rate now), Holt (the
predictor's weights, undamped), damped Holt (``phi`` 0.9), the upper
quantile of the last minute, and each of the last two with the reactive backstop.  The table
marks the best of each column; the JSON also holds every score.  Nothing is fitted to the
trace: every candidate runs with its documented defaults.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.argtypes import positive_float  # noqa: E402
from agent.errors import ConfigError, InvalidTrace  # noqa: E402
from agent.sim.forecast_eval import evaluate, rate_series  # noqa: E402
from agent.predictor.forecast import FORECASTERS, build_forecaster  # noqa: E402
from agent.sim.trace import read_trace  # noqa: E402


def judge(arrival_s, *, lead_s: float, step_s: float = 1.0, q: float = 0.9) -> dict:
    """Every candidate's scores on arrivals [N] (seconds) at ``lead_s`` ahead (JSON-ready)."""
    lead_steps = max(1, math.ceil(lead_s / step_s - 1e-9))
    series = rate_series(arrival_s, step_s)
    scores = evaluate(series, {k: (lambda k=k: build_forecaster(k)) for k in FORECASTERS},
                      lead_steps=lead_steps, q=q)
    best_pinball = min(scores, key=lambda s: s.pinball).name
    best_mae = min(scores, key=lambda s: s.mae).name
    return {"lead_s": lead_s, "lead_steps": lead_steps, "step_s": step_s, "q": q,
            "steps": int(series.shape[0]), "mean_rps": float(series.mean()),
            "scores": [s.to_json() for s in scores],
            "best_pinball": best_pinball, "best_mae": best_mae,
            "holt_wins": best_pinball == "holt" or best_pinball == "damped_holt"}


def table(result: dict) -> str:
    rows = [f"lead {result['lead_s']:.1f} s = {result['lead_steps']} steps of "
            f"{result['step_s']:g} s; {result['steps']} steps, mean {result['mean_rps']:.2f} req/s",
            f"{'forecaster':<18}{'MAE req/s':>11}{'pinball@' + format(result['q'], 'g'):>13}"
            f"{'under %':>9}{'mean f':>9}"]
    for s in result["scores"]:
        mark = (" <- best pinball" if s["name"] == result["best_pinball"] else "") + \
               (" <- best MAE" if s["name"] == result["best_mae"] else "")
        rows.append(f"{s['name']:<18}{s['mae']:>11.3f}{s['pinball']:>13.3f}"
                    f"{100 * s['under_share']:>9.1f}{s['mean_forecast']:>9.2f}{mark}")
    rows.append(f"Holt {'wins' if result['holt_wins'] else 'does not win'} on pinball loss "
                f"(best: {result['best_pinball']})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--restore-p99-s", type=positive_float, default=3.6,
                    help="restore p99 (s; default 3.6, a 13B snapshot restore)")
    ap.add_argument("--decision-s", type=positive_float, default=1.0,
                    help="decision latency (s; the predictor's 1 s tick)")
    ap.add_argument("--step-s", type=positive_float, default=1.0, help="predictor step (s)")
    ap.add_argument("--q", type=positive_float, default=0.9, help="pinball quantile (0..1)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        rows = read_trace(args.trace)
        result = judge(rows.arrival_s, lead_s=args.restore_p99_s + args.decision_s,
                       step_s=args.step_s, q=args.q)
    except (InvalidTrace, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result["trace"] = args.trace.name
    print(table(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
