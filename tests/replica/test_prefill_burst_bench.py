"""bench/prefill_burst.py end to end on a tiny synthetic model (eager): both replicas serve
every burst, the JSON carries both modes' figures, their ratio, the targets and the meta.
It checks the bench's plumbing; the figures themselves are the bench's to measure."""

import importlib.util
import json
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("prefill_burst", REPO / "bench" / "prefill_burst.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prefill_burst_runs_both_schedules_and_writes_its_json(tmp_path):
    from agent.replica.synthetic import make_synthetic

    model = make_synthetic(tmp_path / "tiny", "tiny", seed=0)
    out = tmp_path / "burst.json"
    assert _bench().main(["--model-dir", str(model), "--eager", "--burst", "3",
                          "--prompt-tokens", "20", "--max-tokens", "3", "--running", "1",
                          "--rounds", "1", "--threads", "1", "--quiet-wait-s", "0",
                          "--shapes", "--shape-repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # the step target it plans by: 0.2 s less its steps' p99 overrun, by at most a quarter
    assert 0.15 <= data["replicas"]["chunked"]["itl_target_s"] <= 0.2
    assert data["config"]["itl_target_ms"] == 200.0
    assert data["replicas"]["whole"]["itl_target_s"] == 0.0
    for mode in ("chunked", "whole"):
        burst, running = data["modes"][mode]["burst"], data["modes"][mode]["running"]
        assert burst["served"] == 3 and len(burst["rounds"][0]["ttft_ms"]) == 3
        assert running["served"] == 2 and running["rounds"][0]["requests"] == 2
        assert all(t > 0 for t in burst["rounds"][0]["ttft_ms"])
    assert set(data["ratio"]) == {"burst", "running"}
    assert data["targets"]["served_all"] is True and "loadavg" in data["targets"]
    assert {"command", "machine", "loadavg", "date", "commit"} <= set(data["meta"])
    # the README's figures: chunked / whole for the burst's TTFT, its ITL and the running ones'
    assert data["title"] and len(data["headline"]) == 3
    assert all(" / " in value and "-" not in value for _label, value in data["headline"])
    # the forward's shapes, called as the engine calls them (each row's last logits)
    shapes = {row["call"]: row for row in data["shapes"]}
    assert shapes["[8,9]"]["tokens"] == 72 and shapes["[1,64]"]["tokens"] == 64
    assert {"padded [4,96]", "apart [3,1]+[1,96]"} <= set(shapes)
    assert all(row["ms"] > 0 for row in shapes.values())
