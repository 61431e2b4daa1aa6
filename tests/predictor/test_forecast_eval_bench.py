"""bench/forecast_eval.py on synthetic traces: its JSON keys, its verdict, its bad-input exit."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def bench():
    spec = importlib.util.spec_from_file_location("forecast_eval", REPO / "bench" / "forecast_eval.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_trace(path: Path, arrival_s) -> Path:
    base = np.datetime64("2023-11-16T18:00:00", "ns")
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for a in arrival_s:
        stamp = str(base + np.timedelta64(int(a * 1e9), "ns")).replace("T", " ")
        lines.append(f"{stamp},100,10")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_bench_scores_every_candidate_and_names_the_winner(tmp_path):
    rng = np.random.default_rng(1)
    steps = np.concatenate([np.full(100, 2.0), np.full(40, 30.0), np.zeros(200), np.full(100, 5.0)])
    counts = rng.poisson(steps)
    arrival = np.concatenate([t + rng.random(c) for t, c in enumerate(counts)])
    trace = write_trace(tmp_path / "t.csv", np.sort(arrival))
    out = tmp_path / "f.json"
    assert bench().main(["--trace", str(trace), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["lead_steps"] == 5 and res["q"] == 0.9
    names = [s["name"] for s in res["scores"]]
    assert names == ["persistence", "holt", "damped_holt", "upper_quantile", "holt_backstop",
                     "quantile_backstop"]
    best = min(res["scores"], key=lambda s: s["pinball"])
    assert res["best_pinball"] == best["name"]
    assert res["holt_wins"] == (best["name"] in ("holt", "damped_holt"))
    assert all(s["mae"] >= 0 and s["pinball"] >= 0 for s in res["scores"])


def test_a_bad_trace_exits_2_naming_the_row(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,1,1\nNaT,1,1\n")
    assert bench().main(["--trace", str(bad), "--json", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "NaT" in err
