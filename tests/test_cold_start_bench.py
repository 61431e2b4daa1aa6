"""bench/cold_start.py's breakdown: the phases of every trial sum to its total (other_s closes it)."""

import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "cold_start.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cold_start", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_other_s_is_what_the_measured_phases_leave_of_the_total(bench):
    trial = {"total_s": 0.60, "tokens": [1],
             "phases": {"weights_s": 0.08, "package_s": 0.0, "golden_s": 0.33, "first_token_s": 0.10}}
    out = bench.closed(trial)
    assert out["phases"]["other_s"] == pytest.approx(0.09)
    assert sum(out["phases"].values()) == pytest.approx(out["total_s"])
    assert bench.closed(out)["phases"]["other_s"] == pytest.approx(0.09)   # not counted twice
    assert trial["phases"].get("other_s") is None                        # the input is left alone


def test_the_summary_takes_each_phase_median_over_the_trials(bench):
    trials = [bench.closed({"total_s": t, "tokens": [], "phases": {"golden_s": g}})
              for t, g in ((0.5, 0.3), (0.7, 0.4), (0.6, 0.2))]
    summary = bench.summarise(trials)
    assert summary["median_s"] == 0.6 and summary["trials_s"] == [0.5, 0.7, 0.6]
    assert summary["phases"] == {"golden_s": 0.3, "other_s": 0.3}
