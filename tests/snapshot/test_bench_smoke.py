"""bench/restore_throughput.py runs end to end on a tiny size and writes every JSON key.

No timing is asserted (speed targets live in the benchmark's own table)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KEYS = {"bytes", "odirect_limit_gbps", "memcpy_gbps", "rewarm_cold_gbps", "rewarm_warm_gbps",
        "rewarm_cold_noverify_gbps", "verify_overhead_pct", "safetensors_cold_gbps", "safetensors_warm_gbps",
        "torch_load_warm_gbps", "cache_drop_effective", "baseline_rss_bytes", "peak_rss_bytes",
        # the peers' comparison
        "peers", "rewarm_fresh_cold_gbps", "rewarm_fresh_warm_gbps", "rewarm_zygote_cold_gbps",
        "rewarm_zygote_warm_gbps", "first_touch_gbps"}
PEER_KEYS = {"cold_gbps", "warm_gbps", "verified", "peak_rss_delta_bytes"}


@pytest.fixture
def bench_module(repo_root, monkeypatch):
    monkeypatch.syspath_prepend(str(repo_root / "bench"))
    import restore_throughput
    return restore_throughput


def test_layer_mix_is_exact_and_llama_shaped(bench_module):
    m = bench_module
    for size in (8 << 20, 1 << 30, (1 << 30) + 4096 * 3):
        mix = m.layer_mix(size)
        assert sum(2 * m._numel(s) for _, s in mix) == size
        assert len({n for n, _ in mix}) == len(mix)
    mix = dict(m.layer_mix(1 << 30))
    assert mix["model.embed_tokens.weight"] == (m.VOCAB, m.HIDDEN)
    assert mix["model.layers.0.self_attn.k_proj.weight"] == (m.KV, m.HIDDEN)
    assert mix["model.layers.0.input_layernorm.weight"] == (m.HIDDEN,)
    assert mix["model.layers.3.mlp.down_proj.weight"] == (m.HIDDEN, m.INTER)
    assert list(m.layer_mix(8 << 20)) == [("model.embed_tokens.weight", (2048, m.HIDDEN))]


@pytest.mark.slow
def test_benchmark_runs_and_writes_its_keys(tmp_path, repo_root):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(repo_root / "bench" / "restore_throughput.py"), "--size-gib",
                           str(8 / 1024), "--repeat", "1", "--rounds", "1", "--peers", "--json", str(out),
                           "--dir", str(tmp_path / "d")],
                          capture_output=True, text=True, timeout=600, cwd=repo_root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert KEYS <= set(res)
    assert res["bytes"] == 8 << 20
    assert res["peak_rss_bytes"] >= res["baseline_rss_bytes"] > 0
    assert all(res[k] > 0 for k in KEYS - {"bytes", "cache_drop_effective", "verify_overhead_pct", "peers",
                                            "baseline_rss_bytes", "peak_rss_bytes"})
    assert res["odirect_used"]["warm"] is False
    assert "sllm_store" in res["peers_not_measured"]
    for name, p in res["peers"].items():          # whichever peers are installed here
        assert PEER_KEYS <= set(p) and p["cold_gbps"] > 0 and p["warm_gbps"] > 0, (name, p)
    assert res["fresh_process"]["rewarm_fresh/cold"]["mode"] == "map"
    assert res["fresh_process"]["rewarm_fresh_copy/cold"]["mode"] == "copy"
    assert res["fresh_process"]["rewarm_fresh_copy_huge/cold"]["mode"] == "copy huge"
    assert res["rewarm_fresh_copy_huge_cold_gbps"] > 0 and res["rewarm_fresh_copy_huge_warm_gbps"] > 0
    assert res["fresh_process"]["rewarm_zygote/cold"]["mode"] == "buffer"
    for name in ("rewarm_fresh", "rewarm_fresh_copy", "rewarm_zygote"):   # one round: min = median = max
        p = res["cold_over_round_limit"][name]
        assert p["median"] > 0 and p["min"] == p["median"] == p["max"], (name, p)
    assert "rewarm_fresh cold / same round's O_DIRECT" in proc.stdout
    assert "| rewarm_fresh [map]" in proc.stdout and "target:" in proc.stdout
    assert "fresh verified cold >= 1.5 x best peer cold" in proc.stdout
