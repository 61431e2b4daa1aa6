"""bench/throughput_check.py end to end on a CPU "device" (its --cpu-smoke), so the device
check's throughput step cannot break unseen: every figure, its limit, target and verdict."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import throughput_check  # noqa: E402

from tests.fake_kvikio import FakeKvikio  # noqa: E402


def _check_verdicts(figures: dict) -> None:
    """Every figure with a target says whether its value meets it, by its own limit."""
    for name, f in figures.items():
        if f["target"] is None:
            assert f["met"] is None, name
            continue
        assert isinstance(f["met"], bool), name
        if f["target"].startswith(">="):
            factor = float(f["target"].split()[1])
            (limit,) = f["limit"].values()
            assert f["met"] == (f["value"] >= factor * limit), name


def test_every_figure_is_measured_with_its_limit_and_verdict(tmp_path):
    table = throughput_check.Table()
    fake = FakeKvikio()
    root = tmp_path / "tp-smoke"
    throughput_check.run_throughput(table, 8 << 20, root, device="cpu", kvikio=fake)
    figs = table.data["figures"]
    want = {"bytes", "write_s", "h2d_pinned", "h2d_pinned_4streams", "safetensors_warm",
            "raw_read_cold", "default_cold_verified", "safetensors_cold",
            "default_cold_verified_vs_safetensors", "staged_warm_verified",
            "staged_warm_unverified", "kvikio_warm_verified", "kvikio_warm_unverified",
            "default_warm_verified_vs_safetensors", "default_warm_verified_s",
            "staged_host_side_warm_verified", "host_warm_verified", "host_cold_verified", "step_s"}
    assert set(figs) == want
    assert figs["bytes"]["value"] == 8 << 20
    for name in want - {"bytes", "write_s", "step_s", "default_warm_verified_s"}:
        assert figs[name]["value"] > 0, name
    # the CPU stand-in's default is kvikio (gpu.choose_strategy); each strategy names its path
    assert figs["default_cold_verified"]["path"] == "compat"
    assert figs["staged_warm_verified"]["path"] == "staged"
    assert figs["kvikio_warm_unverified"]["path"] == "compat"
    assert figs["default_cold_verified"]["limit"] == {"raw_read_cold": figs["raw_read_cold"]["value"]}
    assert figs["staged_warm_verified"]["limit"] == {"h2d_pinned": figs["h2d_pinned"]["value"]}
    assert figs["default_warm_verified_s"]["target"] is None      # only the 8B shape has one
    _check_verdicts(figs)
    assert fake.reads and all(h.closed for h in fake.opened)
    assert not root.exists()
    notes = table.data["notes"]
    assert any(n.startswith("staged_warm_verified: ") and "'hash_s'" in n for n in notes)
    assert "warm runs: page-cache share of the snapshot before them 1.00" in notes
    assert "default_cold_verified: page-cache share before it 0.00" in notes
    text = table.render()
    assert "default_cold_verified" in text and "note: no GPU" in text


def test_without_kvikio_and_without_budget_the_step_says_what_it_skipped(tmp_path, monkeypatch):
    from agent.snapshot import gpu

    def no_kvikio():
        raise gpu.DriverUnavailable("libcuda.so.1 not found", call="dlopen", result=None,
                                    name="libcuda.so.1", missing=["libcuda.so.1"])
    monkeypatch.setattr(gpu, "load_kvikio", no_kvikio)
    table = throughput_check.Table()
    throughput_check.run_throughput(table, 4 << 20, tmp_path / "tp-x", device="cpu", budget_s=0.0)
    figs, notes = table.data["figures"], table.data["notes"]
    assert "kvikio_warm_verified" not in figs and "host_cold_verified" not in figs
    assert "kvikio strategy skipped: libcuda.so.1 not found" in notes
    assert any(n.startswith("host_cold_verified skipped: ") for n in notes)
    assert figs["default_cold_verified"]["path"] == "staged"
    _check_verdicts(figs)


def test_the_cli_runs_only_as_the_cpu_smoke(capsys):
    with pytest.raises(SystemExit):
        throughput_check.main([])
    assert "--cpu-smoke" in capsys.readouterr().err
