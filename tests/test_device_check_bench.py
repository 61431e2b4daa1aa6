"""bench/device_check.sh on a machine without a GPU, and its driver's planning, phases,
limits, errors and table (step processes stood in by small Python programs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import device_check  # noqa: E402

GPU_INFO = {"why_not": None, "gpu": "NVIDIA H200", "kvikio": "26.10.00 (compat)"}


@pytest.mark.skipif(device_check.probe()["why_not"] is None, reason="a GPU is here")
def test_without_a_gpu_it_prints_its_skip_table_and_exits_0(tmp_path):
    env = {**os.environ, "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"),
           "CARRY": str(tmp_path / "no-carry"), "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(REPO / "bench" / "device_check.sh")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    why = device_check.probe()["why_not"]
    for step in device_check.STEPS:
        assert f"{step:<16}skipped  {why}" in p.stdout
    assert "skipped: aot_build (" in p.stdout
    doc = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert {r["status"] for r in doc["steps"].values()} == {"skipped"}
    assert set(doc["meta"]) == {"command", "machine", "loadavg", "date", "commit"}


def test_every_step_is_planned_once_and_the_plan_fits_the_check():
    planned = [name for phase in device_check.PHASES for name in phase]
    assert sorted(planned) == sorted(device_check.STEPS) and len(set(planned)) == len(planned)
    # the steps that hold the targets never share the node: only phase 1 runs side by side
    assert all(len(phase) == 1 for phase in device_check.PHASES[1:])
    setup_s = 30
    walls = [max(device_check.STEPS[n][0] for n in phase) for phase in device_check.PHASES[:3]]
    assert setup_s + sum(walls) <= device_check.CHECK_BUDGET_S - device_check.MARGIN_S
    for name, need in device_check.NEEDS.items():
        assert planned.index(need) < planned.index(name)


@pytest.fixture
def fake_steps(tmp_path, monkeypatch):
    """Steps stood in by ``python -c PROGRAM`` (``programs[name]``), in WORK=tmp_path."""
    monkeypatch.setattr(device_check, "WORK", tmp_path)
    programs: dict[str, str] = {}

    def argv(name, limit):
        prelude = (f"import sys, time, json, pathlib; sys.path[:0] = {[str(REPO), str(REPO / 'bench')]!r}; "
                   f"import os; os.environ['WORK'] = {str(tmp_path)!r}; import device_check; ")
        return [sys.executable, "-c", prelude + programs.get(name, "pass")]
    monkeypatch.setattr(device_check, "step_argv", argv)
    return programs


def test_steps_that_the_budget_cannot_hold_are_skipped_and_say_why(fake_steps, monkeypatch):
    started = []
    monkeypatch.setattr(device_check, "run_phase", lambda names, limits: started.append(names))
    late = time.time() - (device_check.CHECK_BUDGET_S - device_check.MARGIN_S - 10)
    results = device_check.drive(GPU_INFO, late)
    assert started == []            # 10 s left: no step's least fits
    for name, (_, least) in device_check.STEPS.items():
        if name in device_check.NEEDS:
            assert results[name]["reason"].startswith(f"needs {device_check.NEEDS[name]}")
        else:
            assert results[name]["status"] == "skipped"
            assert f"it needs at least {least} s" in results[name]["reason"]


def test_a_failed_step_keeps_what_it_measured_and_its_traceback(fake_steps, monkeypatch):
    monkeypatch.setattr(device_check, "PHASES", [("throughput_8gib",)])
    fake_steps["throughput_8gib"] = (
        "\ndef fail(figs, size):\n"
        "    figs.fig('h2d_pinned', 21.5, 'GB/s', path='host')\n"
        "    raise RuntimeError('kvikio EOF at chunk 3')\n"
        "device_check.step_throughput = fail\n"
        "sys.exit(device_check.run_step('throughput_8gib', 60))")
    results = device_check.drive(GPU_INFO, time.time())
    res = results["throughput_8gib"]
    assert res["status"] == "failed" and res["reason"] == "RuntimeError: kvikio EOF at chunk 3"
    assert res["error"]["type"] == "RuntimeError"
    assert res["error"]["traceback"][0] == "Traceback (most recent call last):"
    assert res["error"]["traceback"][-1] == "RuntimeError: kvikio EOF at chunk 3"
    assert res["figures"]["h2d_pinned"]["value"] == 21.5      # measured before it failed
    text = device_check.table({**GPU_INFO, "torch": "2.11"}, results)
    assert "reason: RuntimeError: kvikio EOF at chunk 3" in text and "h2d_pinned" in text
    assert "| RuntimeError: kvikio EOF at chunk 3" in text and "took " in text


def test_a_crashed_step_reports_its_last_traceback_not_its_last_line(fake_steps, monkeypatch):
    monkeypatch.setattr(device_check, "PHASES", [("aot_build",)])
    fake_steps["aot_build"] = (
        "print('Traceback (most recent call last):\\n  File \"x\"\\nValueError: first'); "
        "print('Traceback (most recent call last):\\n  File \"inductor.py\", line 9\\n"
        "torch._inductor.exc.InductorError: CompilationError: ptxas fatal', flush=True); "
        "print('autotune: 12 choices benchmarked', flush=True); os._exit(3)")
    res = device_check.drive(GPU_INFO, time.time())["aot_build"]
    assert res["status"] == "failed"
    assert res["error"]["traceback"][0] == "Traceback (most recent call last):"
    assert "InductorError: CompilationError: ptxas fatal" in "\n".join(res["error"]["traceback"])
    assert "ValueError: first" not in "\n".join(res["error"]["traceback"])
    assert res["reason"].startswith("StepProcess: exit status 3")


def test_a_step_over_its_limit_is_stopped_and_says_where_it_was(fake_steps, monkeypatch):
    monkeypatch.setattr(device_check, "PHASES", [("stack",)])
    monkeypatch.setattr(device_check, "STEPS", {**device_check.STEPS, "stack": (1, 1)})
    monkeypatch.setattr(device_check, "TERM_GRACE_S", 10.0)
    fake_steps["stack"] = ("device_check.step_stack = lambda f, b: time.sleep(60); "
                           "sys.exit(device_check.run_step('stack', 1))")
    t = time.time()
    res = device_check.drive(GPU_INFO, time.time())["stack"]
    assert time.time() - t < 10            # SIGTERM ended it: no wait for the 60 s
    assert res["status"] == "failed" and res["reason"] == "over its 1 s limit"
    assert res["error"]["type"] == "StepStopped"
    assert any("time.sleep(60)" in line or "<lambda>" in line for line in res["error"]["traceback"])


def test_a_step_that_ignores_sigterm_is_killed_after_the_grace(fake_steps, monkeypatch):
    monkeypatch.setattr(device_check, "PHASES", [("stack",)])
    monkeypatch.setattr(device_check, "STEPS", {**device_check.STEPS, "stack": (1, 1)})
    monkeypatch.setattr(device_check, "TERM_GRACE_S", 1.0)
    fake_steps["stack"] = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                           "time.sleep(60)")
    res = device_check.drive(GPU_INFO, time.time())["stack"]
    assert res["status"] == "failed" and res["error"]["message"].startswith(
        "over its 1 s limit; killed by SIGKILL")


def test_phase_one_runs_side_by_side_and_a_step_without_its_input_is_skipped(
        fake_steps, monkeypatch, tmp_path):
    monkeypatch.setattr(device_check, "PHASES", [("aot_build", "prep_8b", "gpu_tests"),
                                                 ("stack_8b",)])
    for name in ("aot_build", "gpu_tests"):
        fake_steps[name] = f"time.sleep(1.5); device_check.Figures({name!r})"
    fake_steps["prep_8b"] = "time.sleep(1.5); sys.exit(1)"
    t = time.time()
    results = device_check.drive(GPU_INFO, time.time())
    assert time.time() - t < 4.0            # together, not 4.5 s one after another
    assert results["aot_build"]["status"] == results["gpu_tests"]["status"] == "ok"
    assert results["aot_build"]["beside"] == ["prep_8b", "gpu_tests"]
    assert results["stack_8b"] == {"status": "skipped",
                                   "reason": "needs prep_8b, which did not finish (failed)"}


def test_what_a_step_leaves_for_no_one_is_removed_before_the_next_phase(fake_steps, monkeypatch,
                                                                       tmp_path):
    monkeypatch.setattr(device_check, "PHASES", [("stack_8b",), ("throughput_8b",)])
    monkeypatch.setattr(device_check, "NEEDS", {})
    for keep, gone in (("stack-8b-state/run", "stack-8b-state/snapshots"),
                       ("smollm2-shaped", "llama3-8b-shaped")):
        (tmp_path / keep).mkdir(parents=True)
        (tmp_path / gone).mkdir(parents=True)
    fake_steps["throughput_8b"] = ("assert not (pathlib.Path(os.environ['WORK']) / "
                                   "'llama3-8b-shaped').exists(); "
                                   "pathlib.Path(os.environ['WORK'], 'tp-1').mkdir()")
    results = device_check.drive(GPU_INFO, time.time())
    assert results["throughput_8b"]["status"] == "ok"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["smollm2-shaped",
                                                                         "stack-8b-state"]
    assert [p.name for p in (tmp_path / "stack-8b-state").iterdir()] == ["run"]


def test_failure_of_a_killed_process_without_a_traceback_keeps_its_last_lines():
    err = device_check.failure_of("building...\nstep 2 of 2\n", -9)
    assert err["message"] == "killed by SIGKILL: step 2 of 2"
    assert err["traceback"] == ["building...", "step 2 of 2"]
