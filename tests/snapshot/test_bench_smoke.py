"""bench/restore_throughput.py runs end to end on a tiny size and writes every JSON key.

No timing is asserted (speed targets live in the benchmark's own table)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KEYS = {"bytes", "odirect_limit_gbps", "memcpy_gbps", "rewarm_cold_gbps", "rewarm_warm_gbps",
        "rewarm_cold_noverify_gbps", "verify_overhead_pct", "safetensors_cold_gbps", "safetensors_warm_gbps",
        "torch_load_warm_gbps", "cache_drop_effective", "baseline_rss_bytes", "peak_rss_bytes"}


@pytest.mark.slow
def test_benchmark_runs_and_writes_its_keys(tmp_path, repo_root):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(repo_root / "bench" / "restore_throughput.py"), "--size-gib",
                           str(8 / 1024), "--repeat", "1", "--json", str(out), "--dir", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=300, cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert KEYS <= set(res)
    assert res["bytes"] == 8 << 20
    assert res["peak_rss_bytes"] >= res["baseline_rss_bytes"] > 0
    assert all(res[k] > 0 for k in KEYS - {"bytes", "cache_drop_effective", "verify_overhead_pct",
                                            "baseline_rss_bytes", "peak_rss_bytes"})
    assert res["odirect_used"]["warm"] is False
    assert "| rewarm cold (verified)" in proc.stdout and "target:" in proc.stdout
