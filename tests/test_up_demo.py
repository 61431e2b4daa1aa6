"""Unit tests of the demo's pieces: trace window, length scaling, summary and table, and the
registry adapter of ``rewarm up`` (no processes, no model)."""

from __future__ import annotations

import argparse
import json

import pytest

from agent.sim.demo import format_table, gpu_line, replay_window, summarise
from agent.sim.replay import Outcome, percentile
from agent.errors import ConfigError, InvalidTrace
from agent.up_cli import register

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write_trace(path, rows):
    path.write_text(HEADER + "".join(f"2023-11-16 18:17:{s:010.7f},{c},{g}\n" for s, c, g in rows))
    return path


def test_replay_window_is_the_first_minutes(tmp_path):
    trace = write_trace(tmp_path / "t.csv", [(0.0, 640, 8), (1.0, 64, 4), (30.0, 6400, 400),
                                             (59.0, 100, 4)])
    rows = replay_window(trace, minutes=0.5)            # trace seconds [0, 30)
    assert rows.arrival_s.tolist() == [0.0, 1.0]
    assert rows.context_tokens.tolist() == [640, 64]


def test_replay_window_request_limit_at_and_over(tmp_path):
    trace = write_trace(tmp_path / "t.csv", [(i * 0.1, 100, 4) for i in range(5)])
    assert len(replay_window(trace, minutes=1, max_requests=5)) == 5
    with pytest.raises(ConfigError) as err:
        replay_window(trace, minutes=1, max_requests=4)
    assert err.value.limit == 4


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_replay_window_refuses_bad_minutes(tmp_path, value):
    trace = write_trace(tmp_path / "t.csv", [(0.0, 100, 4)])
    with pytest.raises(ConfigError) as err:
        replay_window(trace, minutes=value)
    assert err.value.name == "minutes"


def test_replay_window_bad_trace_is_typed(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text(HEADER + "2023-11-16 18:17:00.0,lots,4\n")
    with pytest.raises(InvalidTrace) as err:
        replay_window(bad, minutes=1)
    assert err.value.field == "ContextTokens" and err.value.line == 2


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0


def sample_summary():
    outcomes = [Outcome(200, "cold_boot", 900.0), Outcome(200, "snapshot_restore", 300.0),
                Outcome(200, "warm_hit", 10.0), Outcome(200, "warm_hit", 30.0),
                Outcome(429), Outcome(504), Outcome(503)]
    restores = [{"path": "cold_boot", "outcome": "ok", "duration_s": 2.5},
                {"path": "restore", "outcome": "ok", "duration_s": 0.4,
                 "phases_s": {"weights_s": 0.1, "golden_s": 0.2}}]
    return summarise(outcomes, restores=restores, golden={"passed": 1, "failed": 0},
                     gpu_seconds=12.345, always_on_gpu_seconds=40.0,
                     example_completion="Paris", extra={"probe_match": True, "forward": "eager"})


def test_summarise_counts_every_outcome_class():
    s = sample_summary()
    assert s["requests"] == 7
    assert s["requests_by_path"] == {"cold_boot": 1, "snapshot_restore": 1,
                                     "suspended_resume": 0, "warm_hit": 2}
    assert (s["shed"], s["expired"], s["lost"]) == (1, 1, 1)
    assert s["ttft_ms"]["warm_hit"] == {"p50": 10.0, "p99": 30.0}
    assert s["ttft_ms"]["suspended_resume"] == {"p50": None, "p99": None}
    # 200s within their path's SLO (all four here) over all seven requests
    assert s["sla_attainment"] == pytest.approx(4 / 7) and s["sla_requests"] == 7
    assert (s["golden_checks_passed"], s["golden_checks_failed"]) == (1, 0)
    assert s["gpu_seconds"] == 12.35 and s["always_on_gpu_seconds"] == 40.0
    # the keys, and the document is JSON
    for key in ("requests_by_path", "ttft_ms", "golden_checks_passed", "golden_checks_failed",
                "shed", "expired", "lost", "gpu_seconds", "always_on_gpu_seconds",
                "example_completion"):
        assert key in s
    assert json.loads(json.dumps(s)) == s


def test_unknown_path_counts_as_warm_hit():
    s = summarise([Outcome(200, None, 5.0)], restores=[], golden={}, gpu_seconds=0,
                  always_on_gpu_seconds=0, example_completion="")
    assert s["requests_by_path"]["warm_hit"] == 1


def test_format_table_shows_paths_phases_and_lost():
    text = format_table(sample_summary())
    assert "cold_boot                 1          900          900" in text
    assert "restore            0.40 s  (weights 0.10s golden 0.20s)" in text
    assert "lost                1" in text
    assert "1 passed, 0 failed" in text
    assert "identical after restore" in text
    assert "'Paris'" in text
    assert "SLA attainment      57.1 % of 7 requests (the probe after scale-to-zero and the replay" in text
    assert "12.3 used vs 40.0 for one always-on replica (27.6 saved, 69 %" in text


def test_gpu_line_says_when_scale_to_zero_cost_more():
    line = gpu_line({"gpu_seconds": 176.6, "always_on_gpu_seconds": 172.1})
    assert "4.5 MORE than always-on" in line


def test_sla_counts_slow_warm_hits_as_misses():
    s = summarise([Outcome(200, "warm_hit", 2500.0), Outcome(200, "snapshot_restore", 3900.0)],
                  restores=[], golden={}, gpu_seconds=0, always_on_gpu_seconds=0,
                  example_completion="")
    assert s["sla_attainment"] == 0.5


def test_up_parser_defaults():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["up", "--demo", "--json", "x.json"])
    assert args.demo and args.json == "x.json" and not args.no_aot
    assert args.replay_s == 120.0 and args.minutes == 4.0 and args.load == 0.3
    assert args.port is None


def test_replay_window_missing_trace_is_typed(tmp_path):
    with pytest.raises(InvalidTrace) as err:
        replay_window(tmp_path / "nope.csv", minutes=1)
    assert err.value.field == "path"


def test_a_port_in_use_is_a_config_error_naming_it_before_any_preparation():
    import socket

    from agent.up import check_port

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError) as err:
            check_port("127.0.0.1", port)
        with pytest.raises(ConfigError, match="node agent control API .* --agent-listen"):
            check_port("127.0.0.1", port, what="node agent control API")
    assert err.value.value == port and f"127.0.0.1:{port}" in str(err.value)
    assert "--port" in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_port("203.0.113.7", 7400)          # not an address of this machine
    assert err.value.value == "203.0.113.7:7400"
    check_port("127.0.0.1", 0)                    # any free port: nothing to check


def test_json_without_demo_is_refused(capsys):
    from agent.cli import main

    assert main(["up", "--json", "out.json"]) == 2
    assert "--json" in capsys.readouterr().err and not __import__("os").path.exists("out.json")


def test_the_demo_front_door_holds_the_first_request_through_a_cold_boot(tmp_path):
    """The first request carries COLD_BOOT_DEADLINE_MS; the front door's max_wait_s caps any
    wait, so the demo's stack must not cap it below that (it did at 60 s: the demo's first
    request got a 429 on a loaded machine whose cold boot took longer)."""
    from agent.sim.demo import COLD_BOOT_DEADLINE_MS, demo_stack_options
    from agent.up import Stack

    options = demo_stack_options()
    assert options["max_wait_s"] * 1000.0 >= COLD_BOOT_DEADLINE_MS
    stack = Stack(tmp_path, tmp_path, **options)
    stack.model = "m"     # set by start() from the model directory
    config = stack.frontdoor_config()
    assert config.max_wait_s == COLD_BOOT_DEADLINE_MS / 1000.0
    assert config.models == {"m": stack.deadline_ms} and config.restores_per_model == 1
    assert Stack(tmp_path, tmp_path).max_wait_s == 60.0   # `rewarm up` keeps the default


def test_a_bad_http_port_in_the_environment_exits_78_as_rewarm_frontdoor_does(
        tmp_path, monkeypatch, capsys):
    from agent import exitcodes
    from agent.cli import main

    monkeypatch.setenv("REWARM_HTTP_PORT", "abc")
    assert main(["up", "--state-dir", str(tmp_path)]) == exitcodes.EX_CONFIG
    assert "REWARM_HTTP_PORT='abc'" in capsys.readouterr().err
    assert main(["frontdoor", "--port", "0"]) == exitcodes.EX_CONFIG
    assert "REWARM_HTTP_PORT='abc'" in capsys.readouterr().err


def test_an_interrupted_demo_exits_130_after_closing(tmp_path, monkeypatch, capsys):
    import signal

    from agent import exitcodes, up_cli
    from agent.cli import main
    from agent.sim import demo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(up_cli, "check_port", lambda *a, **k: None)
    monkeypatch.setattr(up_cli, "prepare_model", lambda args: (tmp_path, None, "eager"))
    monkeypatch.setattr(demo, "replay_window", lambda *a, **k: None)
    monkeypatch.setattr(demo, "run_demo", interrupted)
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["up", "--demo", "--state-dir", str(tmp_path)]) == exitcodes.INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    captured = capsys.readouterr()
    assert "stopping" in captured.out + captured.err


class _Catalog:
    def __init__(self, ready_after_s):
        self.ready_at = __import__("time").monotonic() + ready_after_s

    def snapshots(self, model, status):
        return ["s"] if __import__("time").monotonic() >= self.ready_at else []


class _Stack:
    """What wait_scaled_to_zero reads: the catalog, the agent's replicas, the predictor."""

    def __init__(self, ready_after_s, gone_after_predicting_s):
        self.model, self.predicting_at, self.gone_after = "m", None, gone_after_predicting_s
        catalog, stack = _Catalog(ready_after_s), self

        class Agent:
            def __init__(self):
                self.catalog = catalog

            def status(self):
                import time
                gone = (stack.predicting_at is not None
                        and time.monotonic() - stack.predicting_at >= stack.gone_after)
                return {"replicas": [] if gone else [{"model": "m", "state": "warm"}]}

        self.agent = Agent()

    def start_predicting(self):
        self.predicting_at = __import__("time").monotonic()


def test_the_scale_to_zero_limit_counts_from_the_predictor_not_the_measurement():
    """Measuring the warm replica takes minutes on a loaded machine; it happens before the
    predictor starts and must not use up --idle-timeout-s."""
    import time

    from agent.sim.demo import wait_scaled_to_zero

    stack = _Stack(ready_after_s=0.3, gone_after_predicting_s=0.6)
    waited = wait_scaled_to_zero(stack, 0.8, lambda text: None,
                                 on_ready=lambda: time.sleep(1.0))   # longer than the limit
    assert 0.6 <= waited < 0.8 + 0.3

    stack = _Stack(ready_after_s=0.0, gone_after_predicting_s=60.0)
    with pytest.raises(TimeoutError, match="of the predictor starting"):
        wait_scaled_to_zero(stack, 0.5, lambda text: None)

    stack = _Stack(ready_after_s=60.0, gone_after_predicting_s=0.0)
    with pytest.raises(TimeoutError, match="no ready snapshot"):
        wait_scaled_to_zero(stack, 0.5, lambda text: None)


def test_the_table_puts_rewarm_beside_the_always_on_replica():
    s = sample_summary()
    s.update(load=0.21, always_on_bound=0.995, sla_requests=7,
             always_on={"requests": 6, "served": 5, "shed_429": 1, "expired_504": 0, "lost": 0,
                        "sla_attainment": 5 / 6, "gpu_seconds": 40.0,
                        "ttft_ms": {"warm_hit": {"p50": 20.0, "p99": 35.0}}})
    text = format_table(s)
    assert "the same requests, load 0.21; one always-on replica can meet the SLO for 99.5 %" in text
    assert "SLA attainment                            57.1 %              83.3 %" in text
    assert "requests (429 / 504 / lost)        6 (1 / 1 / 1)       6 (1 / 0 / 0)" in text
    assert "GPU-seconds                                 12.3                40.0" in text
    # a document without the always-on replay (an older one) shows no comparison
    assert "always-on" not in format_table(sample_summary()).split("GPU-seconds")[0]
