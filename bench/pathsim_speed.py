"""Speed of the request-path simulator (agent/sim/pathsim.py): CPU seconds per 10-minute window.

Four synthetic 10-minute windows of about 1,500 requests (2.5 req/s on average: steady, step
bursts, a ramp, a long idle gap), each replayed through the production request path and
predictor with simulated replicas, as bench/trace_replay.py's ``sim`` column runs.  Target:
well under a minute of CPU per window.  Prints a table and writes JSON.

    .venv/bin/python bench/pathsim_speed.py [--json var/bench/pathsim_speed.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from agent.sim.replay_scale import ReplayRequest  # noqa: E402
from agent.speed import SpeedProfile  # noqa: E402

TARGET_CPU_S = 60.0
WINDOW_S = 600.0
# A stand-in for SmolLM2-135M's replica on two CPU cores (bench/replay_shapes.py's order of
# magnitude); the speed changes how much work each request is, not the simulator's cost much.
SPEED = SpeedProfile(prefill_tokens_per_s=260.0, prefill_overhead_s=0.056, decode_base_s=0.054,
                     decode_per_seq_s=0.014, decode_per_ctx_token_s=0.0)


def rates(shape: str) -> np.ndarray:
    """Requests per second, one value per second of the window (mean about 2.5)."""
    t = np.arange(int(WINDOW_S))
    if shape == "steady":
        return np.full(t.size, 2.5)
    if shape == "step_bursts":
        return np.where((t % 150) < 30, 7.0, 1.4)
    if shape == "ramp":
        return 0.2 + 4.6 * t / t[-1]
    if shape == "idle_gap":
        return np.where((t > 200) & (t < 400), 0.0, 3.75)
    raise ValueError(shape)


def plan_for(shape: str, seed: int = 0) -> list[ReplayRequest]:
    rng = np.random.default_rng(seed)
    counts = rng.poisson(rates(shape))
    at = np.concatenate([s + np.sort(rng.random(c)) for s, c in enumerate(counts)])
    prompt = np.clip(rng.lognormal(np.log(12), 0.6, at.size), 1, 200).astype(int)
    return [ReplayRequest(float(a), int(p), 1 + int(rng.integers(0, 3)))
            for a, p in zip(at, prompt, strict=True)]


def main(argv: list[str] | None = None) -> int:
    from trace_replay import simulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=REPO / "var" / "bench" / "pathsim_speed.json")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)   # the request path logs each late first token
    rows = []
    for shape in ("steady", "step_bursts", "ramp", "idle_gap"):
        plan = plan_for(shape)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        out = simulate(plan, SPEED, max_seqs=8, max_seq_len=512, restore_s=1.3, cap=2,
                       mean_prompt_tokens=12.0, mean_gen_tokens=2.0, span_s=WINDOW_S,
                       always_on_replicas=2)
        cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
        rows.append({"shape": shape, "requests": len(plan), "cpu_s": round(cpu_s, 3),
                     "wall_s": round(wall_s, 3), "served": out["served"],
                     "shed_429": out["shed_429"], "expired_504": out["expired_504"],
                     "lost": out["lost"], "meets_target": cpu_s < TARGET_CPU_S})
    print(f"{'shape':<12} {'requests':>8} {'CPU s':>7} {'wall s':>7} {'served':>7} {'429':>5} "
          f"{'504':>4} {'lost':>4}  target < {TARGET_CPU_S:.0f} CPU s per 10-min window")
    for r in rows:
        print(f"{r['shape']:<12} {r['requests']:>8} {r['cpu_s']:>7.2f} {r['wall_s']:>7.2f} "
              f"{r['served']:>7} {r['shed_429']:>5} {r['expired_504']:>4} {r['lost']:>4}  "
              f"{'ok' if r['meets_target'] else 'MISSED'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"window_s": WINDOW_S, "target_cpu_s": TARGET_CPU_S,
                                     "rows": rows}, indent=1) + "\n")
    print(f"written to {args.json}")
    return 0 if all(r["meets_target"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
