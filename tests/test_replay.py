"""What a live replay's clients saw: outcome classes, SLA per path, fast refusals."""

import pytest

from agent.sim.replay import FAST_REFUSAL_MS, Outcome, _fit_line, prompt_tokens, summarise


def test_summarise_counts_classes_and_judges_each_path_by_its_slo():
    outcomes = [Outcome(200, "warm_hit", 150.0, 300.0), Outcome(200, "warm_hit", 2100.0, 2500.0),
                Outcome(200, "snapshot_restore", 3500.0, 4000.0),
                Outcome(200, "snapshot_restore", 4100.0, 4200.0),
                Outcome(429, answered_ms=3.0), Outcome(429, answered_ms=FAST_REFUSAL_MS + 1),
                Outcome(504, answered_ms=4000.0), Outcome(599, reason="reset")]
    s = summarise(outcomes, gpu_seconds=30.0, always_on_gpu_seconds=100.0, restores=2)
    assert (s["requests"], s["served"], s["shed_429"], s["shed_429_within_50ms"],
            s["expired_504"], s["lost"]) == (8, 4, 2, 1, 1, 1)
    # within SLO: the 150 ms warm hit and the 3.5 s restore; 2.1 s warm and 4.1 s restore miss
    assert s["sla_attainment"] == pytest.approx(2 / 8)
    assert s["ttft_ms"]["warm_hit"]["p50"] == 150.0 and s["ttft_ms"]["warm_hit"]["p99"] == 2100.0
    assert s["ttft_ms"]["snapshot_restore"]["count"] == 2
    assert s["ttft_ms"]["cold_boot"] == {"p50": None, "p99": None, "count": 0, "slo_ms": 4000.0,
                                         "within_slo": 0}
    # per path, the served requests that met that path's SLO
    assert s["ttft_ms"]["warm_hit"]["within_slo"] == 1
    assert s["ttft_ms"]["snapshot_restore"]["within_slo"] == 1
    assert s["gpu_ratio"] == pytest.approx(0.3) and s["restores"] == 2


def test_an_empty_replay_attains_trivially_and_has_no_ratio():
    s = summarise([], gpu_seconds=0.0, always_on_gpu_seconds=0.0, restores=0)
    assert s["sla_attainment"] == 1.0 and s["gpu_ratio"] is None


def test_prompts_are_distinct_per_request_and_sized():
    a, b = prompt_tokens(list(range(50)), 0, 6), prompt_tokens(list(range(50)), 1, 6)
    assert len(a) == len(b) == 6 and a != b


def test_fit_line_by_hand():
    slope, intercept = _fit_line([0.0, 10.0, 20.0], [1.0, 2.0, 3.0])
    assert slope == pytest.approx(0.1) and intercept == pytest.approx(1.0)
    assert _fit_line([5.0, 5.0], [1.0, 3.0]) == (0.0, 2.0)
    # relative weighting: the small points decide the intercept
    xs, ys = [1.0, 4.0, 128.0], [0.1, 0.13, 2.0]
    at_one = lambda fit: fit[1] + fit[0] * 1.0  # noqa: E731
    assert abs(at_one(_fit_line(xs, ys, relative=True)) - 0.1) < \
        abs(at_one(_fit_line(xs, ys)) - 0.1)
    assert _fit_line([1.0, 2.0], [0.5, 0.4]) == (0.0, pytest.approx(0.45))   # flat: no slope
