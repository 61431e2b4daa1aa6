"""Front-door CPU per request at fixed offered rates (the same load for two checkouts).

``bench/frontdoor_load.py`` measures CPU per request at each front door's own highest fully
served rate, so two versions are compared at different loads; this script offers the same
Poisson rates to both.  It reuses frontdoor_load.py's roles (stub replicas reporting their
speed, the front door, the open-loop load generator) from the checkout given by ``--repo``
(default: this one).

Usage: ``python bench/frontdoor_cpu_same_rate.py [--repo PATH] [--rates 3000 6000]
[--repeats 2] [--json PATH]``; prints one row per run (rate, answered, 429, 504, lost, p99 ms,
CPU us per answered request) and the mean CPU per rate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--rates", type=float, nargs="+", default=[3000.0, 6000.0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--duration", type=float, default=3.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo / "bench"))
    import frontdoor_load as fl

    reps, ports = fl._spawn("--role", "replicas")
    fd, (port,) = fl._spawn("--role", "frontdoor", "--ports", *ports, "--max-seqs", "256",
                            "--deadline-ms", "600000")
    rows = []
    try:
        for _ in range(args.repeats):
            for rate in args.rates:
                cpu0 = fl._cpu_s(fd.pid)
                run = fl._run_load(int(port), rate, args.duration, 64)
                cpu_us = (fl._cpu_s(fd.pid) - cpu0) * 1e6 / max(1, run["ok"])
                rows.append({"rate": rate, "cpu_us_per_request": cpu_us,
                             **{k: run[k] for k in ("offered", "ok", "shed_429", "expired_504",
                                                    "lost", "p99_ms")}})
                r = rows[-1]
                print(f"{rate:8.0f} rps  ok {r['ok']}/{r['offered']}  429 {r['shed_429']}  "
                      f"504 {r['expired_504']}  lost {r['lost']}  p99 {r['p99_ms']:.1f} ms  "
                      f"cpu {cpu_us:.1f} us/request", flush=True)
    finally:
        fd.terminate()
        reps.terminate()
    means = {str(rate): sum(r["cpu_us_per_request"] for r in rows if r["rate"] == rate)
             / max(1, sum(1 for r in rows if r["rate"] == rate)) for rate in args.rates}
    print("mean cpu us/request by rate:", {k: round(v, 1) for k, v in means.items()})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"repo": str(args.repo), "runs": rows,
                                         "mean_cpu_us_per_request": means}, indent=2))


if __name__ == "__main__":
    main()
