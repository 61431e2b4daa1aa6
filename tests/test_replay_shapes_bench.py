"""bench/replay_shapes.py's trace folder: every CSV through the fleet simulator, both deadline
policies, on small trace files written here."""

from __future__ import annotations

import importlib.util
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("replay_shapes", REPO / "bench" / "replay_shapes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write(path, offsets_s):
    t0 = datetime(2024, 1, 1)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [(t0 + timedelta(seconds=o)).strftime("%Y-%m-%d %H:%M:%S.%f") + "0,900,40"
             for o in offsets_s]
    path.write_text("\n".join(rows) + "\n")


def test_every_trace_in_the_folder_under_both_deadline_policies(bench, tmp_path):
    write(tmp_path / "trickle.csv", [400.0 * k for k in range(12)])
    write(tmp_path / "stream.csv", [0.5 * k for k in range(1200)])
    (tmp_path / "notes.txt").write_text("not a trace")
    rows = bench.run_traces(tmp_path)
    assert {r["trace"] for r in rows} == {"trickle.csv", "stream.csv"}
    assert {r["deadline_factor"] for r in rows} == {1.0, 3.0}
    rewarm = {(r["trace"], r["deadline_factor"]): r for r in rows if r["policy"] == "rewarm"}
    assert len(rewarm) == 4
    assert rewarm[("trickle.csv", 3.0)]["gpu_ratio_always_on"] < 0.5
    assert rewarm[("stream.csv", 3.0)]["sla_compliance"] == 1.0
    assert [row[0].split(",")[0] for row in bench.headline(rows, [])] == [
        "rewarm on " + r["trace"] for r in sorted(
            (r for r in rows if r["policy"] == "rewarm" and r["deadline_factor"] == 1.0),
            key=lambda r: (r["sla_compliance"], r["trace"]))]
    table = bench.tables(rows, [])[0]
    assert len(table["rows"]) == len(rows) and len(table["columns"]) == len(table["rows"][0])


def test_an_empty_folder_is_refused(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.run_traces(tmp_path)
