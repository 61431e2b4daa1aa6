"""bench/device_check.sh on a machine without a GPU, and its driver's planning and table."""

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


def test_steps_that_the_budget_cannot_hold_are_skipped_and_say_why(tmp_path, monkeypatch):
    monkeypatch.setattr(device_check, "WORK", tmp_path)
    ran = []
    monkeypatch.setattr(device_check.subprocess, "run", lambda argv, **kw: ran.append(argv))
    late = time.time() - (device_check.CHECK_BUDGET_S - device_check.MARGIN_S - 10)
    results = device_check.drive(GPU_INFO, late)
    assert ran == []            # 10 s left: no step's least fits
    for name, (_, least) in device_check.STEPS.items():
        assert results[name]["status"] == "skipped"
        assert f"it needs at least {least} s" in results[name]["reason"]


def test_a_failed_step_keeps_what_it_measured_and_the_exit_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(device_check, "WORK", tmp_path)

    def run(argv, **kw):
        name = argv[3]
        figs = device_check.Figures(name)
        figs.fig("h2d_pinned", 21.5, "GB/s", path="host")
        return subprocess.CompletedProcess(argv, 1, "", "Traceback ...\nRuntimeError: kvikio EOF\n")
    monkeypatch.setattr(device_check.subprocess, "run", run)
    results = device_check.drive(GPU_INFO, time.time())
    res = results["throughput_8gib"]
    assert res["status"] == "failed" and res["reason"] == "RuntimeError: kvikio EOF"
    assert res["figures"]["h2d_pinned"]["value"] == 21.5
    text = device_check.table({**GPU_INFO, "torch": "2.11"}, results)
    assert "reason: RuntimeError: kvikio EOF" in text and "h2d_pinned" in text


def test_a_step_over_its_limit_is_reported_not_hung(tmp_path, monkeypatch):
    monkeypatch.setattr(device_check, "WORK", tmp_path)

    def run(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])
    monkeypatch.setattr(device_check.subprocess, "run", run)
    results = device_check.drive(GPU_INFO, time.time())
    assert results["stack"]["status"] == "failed"
    assert results["stack"]["reason"] == f"over its {device_check.STEPS['stack'][0]} s limit"
