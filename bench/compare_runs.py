"""Compare one benchmark's result files from two checkouts of rewarm, run in turn.

    python bench/compare_runs.py --dir DIR --before-commit C1 --after-commit C2 \
        --json bench/results/NAME.json

``DIR`` holds ``<bench>-before<i>.json`` and ``<bench>-after<i>.json`` (each written by that
checkout's own ``bench/<bench>.py --json``), run alternately (before 1, after 1, before 2,
...), each beside ``<bench>-<side><i>.load0`` and ``.load1`` (``/proc/loadavg`` as the run
started and ended), ``.t0`` (its UTC start) and ``.cmd`` (its command line, from the
checkout's root).  For every figure of :data:`FIGURES` found in both sides' files it reports
the median, min and max of each side, the ratio of the medians (after / before), and whether
the two sides' [min, max] ranges overlap: on a shared machine that is the noise a change
must rise above before it is one.  Benchmarks without files in ``DIR`` are left out.

The JSON has ``meta`` (bench/run_meta.py), ``title``, ``headline``, one table of figures per
benchmark and one table of the runs (command, side, start, load averages).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_meta import run_meta  # noqa: E402

FIGURES: dict[str, list[tuple[str, str]]] = {
    "frontdoor_load": [
        ("frontdoor_rps", "highest rate fully served through the front door (rps)"),
        ("direct_rps", "highest rate fully served straight to a stub (rps)"),
        ("frontdoor_cpu_us_per_request", "front door CPU per request at that rate (us)"),
        ("bare_relay_cpu_us_per_request", "bare relay CPU per request, same rate (us)"),
        ("p50_added_ms", "p50 added at half rate (ms)"),
        ("p99_added_ms", "p99 added at half rate (ms)"),
        ("trace_replay.ok", "trace arrivals answered 200"),
        ("overload.ok", "overload (2x): answered 200"),
        ("overload.shed_429", "overload (2x): refused 429"),
        ("overload.expired_504", "overload (2x): expired 504"),
        ("overload.lost", "overload (2x): never answered"),
        ("rss_peak_bytes", "front door peak RSS (bytes)"),
    ],
    "fd_fixed": [
        ("frontdoor_rps", "served through the front door at 1,500 rps offered (rps)"),
        ("frontdoor_cpu_us_per_request", "front door CPU per request at 1,500 rps (us)"),
        ("bare_relay_cpu_us_per_request", "bare relay CPU per request, same rate (us)"),
        ("p50_added_ms", "p50 added at half the rate served (ms)"),
        ("p99_added_ms", "p99 added at half the rate served (ms)"),
        ("overload.ok", "overload (twice the rate served): answered 200"),
        ("overload.shed_429", "overload (twice the rate served): refused 429"),
        ("overload.lost", "overload (twice the rate served): never answered"),
        ("rss_peak_bytes", "front door peak RSS (bytes)"),
    ],
    "http_load": [
        ("http_cpu_us_per_request", "HTTP door CPU per request (us)"),
        ("http_sse_cpu_us_per_request", "HTTP door, streamed, CPU per request (us)"),
        ("msgpack_cpu_us_per_request", "msgpack door CPU per request (us)"),
        ("http_capacity_rps", "HTTP door capacity (rps)"),
        ("http_p50_added_ms", "HTTP p50 added at half capacity (ms)"),
        ("http_p99_added_ms", "HTTP p99 added at half capacity (ms)"),
        ("msgpack_p50_added_ms", "msgpack p50 added at half capacity (ms)"),
        ("msgpack_p99_added_ms", "msgpack p99 added at half capacity (ms)"),
        ("connections_answered", "of 10,000 open connections, answered"),
        ("rss_growth_bytes_10k_connections", "RSS growth over 10,000 connections (bytes)"),
        ("overload.ok", "overload (2x): answered 200"),
        ("overload.shed_429", "overload (2x): refused 429"),
        ("overload.expired_504", "overload (2x): expired 504"),
        ("overload.lost", "overload (2x): never answered"),
    ],
    "trace_replay": [
        ("runs.0.requests", "requests in the window"),
        ("runs.0.served", "served"),
        ("runs.0.shed_429", "refused 429"),
        ("runs.0.expired_504", "expired 504"),
        ("runs.0.lost", "lost"),
        ("runs.0.sla_attainment", "SLA attainment"),
        ("runs.0.ttft_ms.warm_hit.p50", "warm-hit TTFT p50 (ms)"),
        ("runs.0.ttft_ms.warm_hit.p99", "warm-hit TTFT p99 (ms)"),
        ("runs.0.ttft_ms.snapshot_restore.p50", "snapshot-restore TTFT p50 (ms)"),
        ("runs.0.restore_s", "the probe's restore through the node agent (s)"),
        ("runs.0.restores", "restores"),
        ("runs.0.gpu_ratio", "replica-seconds / always-on"),
        ("runs.0.sim.sla_attainment", "simulator: SLA attainment"),
    ],
}
"""Per benchmark: (dotted key in its result JSON, label) of the figures compared."""

HEADLINE = (("frontdoor_load", "frontdoor_cpu_us_per_request"),
            ("fd_fixed", "frontdoor_cpu_us_per_request"),
            ("http_load", "http_cpu_us_per_request"))
"""The figures whose after / before ratio heads the result: the front door's CPU per request."""


def value(data: Any, key: str) -> float | None:
    """The number at dotted ``key`` (list indices as digits) of ``data``; None if absent."""
    for part in key.split("."):
        if isinstance(data, list) and part.isdigit() and int(part) < len(data):
            data = data[int(part)]
        elif isinstance(data, dict) and part in data:
            data = data[part]
        else:
            return None
    return float(data) if isinstance(data, (int, float)) and not isinstance(data, bool) else None


def _side(directory: Path, bench: str, side: str) -> list[Path]:
    return sorted(directory.glob(f"{bench}-{side}[0-9]*.json"),
                  key=lambda p: int(p.stem.rsplit(side, 1)[1]))


def _text(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


def compare(directory: Path, bench: str) -> tuple[list[list[Any]], list[list[Any]]]:
    """(figure rows, run rows) of ``bench`` in ``directory``; both empty without files."""
    sides = {s: _side(directory, bench, s) for s in ("before", "after")}
    if not sides["before"] or not sides["after"]:
        return [], []
    loaded = {s: [json.loads(p.read_text()) for p in paths] for s, paths in sides.items()}
    rows = []
    for key, label in FIGURES[bench]:
        got = {s: [v for d in loaded[s] if (v := value(d, key)) is not None] for s in loaded}
        if not got["before"] or not got["after"]:
            continue
        med = {s: statistics.median(got[s]) for s in got}
        ratio = med["after"] / med["before"] if med["before"] else None
        overlap = min(got["after"]) <= max(got["before"]) and min(got["before"]) <= max(got["after"])
        rows.append([label, med["before"], [min(got["before"]), max(got["before"])],
                     med["after"], [min(got["after"]), max(got["after"])],
                     None if ratio is None else round(ratio, 3), overlap])
    runs = []
    for paths in sides.values():
        for p in paths:
            stem = directory / p.stem
            load = [" ".join(_text(stem.with_suffix(s)).split()[:3]) for s in (".load0", ".load1")]
            runs.append([bench, p.stem.rsplit("-", 1)[1], _text(stem.with_suffix(".t0")),
                         load[0], load[1], _text(stem.with_suffix(".cmd"))])
    runs.sort(key=lambda r: r[2])
    return rows, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--before-commit", required=True)
    ap.add_argument("--after-commit", required=True)
    ap.add_argument("--title", default=None)
    ap.add_argument("--note", action="append", default=[],
                    help="a sentence for the runs table's notes (what else differs between "
                         "the two commits); repeatable")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    columns = ["figure", "before (median)", "before min max", "after (median)",
               "after min max", "after / before", "ranges overlap"]
    tables, all_runs, headline = [], [], []
    for bench in FIGURES:
        rows, runs = compare(args.dir, bench)
        if not rows:
            continue
        n = sum(1 for r in runs if r[1].startswith("before")), sum(
            1 for r in runs if r[1].startswith("after"))
        tables.append({"title": f"{bench}: {n[0]} runs before, {n[1]} after, alternating",
                       "columns": columns, "rows": rows})
        all_runs += runs
        labels = dict(FIGURES[bench])
        for row in rows:
            if any(b == bench and labels[k] == row[0] for b, k in HEADLINE):
                headline.append([f"{bench}: {row[0]}, after / before", row[5]])
    tables.append({"title": "the runs, in the order they ran",
                   "columns": ["bench", "side", "started (UTC)", "loadavg at start",
                               "loadavg at end", "command"],
                   "rows": sorted(all_runs, key=lambda r: r[2]),
                   "notes": f"before: commit {args.before_commit}; after: commit "
                            f"{args.after_commit}; each run under the shared bench lock, "
                            "its checkout's own script and build. " + " ".join(args.note)})
    out = {"title": args.title or (f"The same benchmarks on {args.before_commit} and "
                                   f"{args.after_commit}, run in turn"),
           "before_commit": args.before_commit, "after_commit": args.after_commit,
           "headline": headline, "tables": tables, "meta": run_meta()}
    for t in tables[:-1]:
        print(t["title"])
        for row in t["rows"]:
            print(f"  {row[0]:58s} {row[1]:>12.4g} {row[3]:>12.4g}  x{row[5]}  "
                  f"{'overlap' if row[6] else 'APART'}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
