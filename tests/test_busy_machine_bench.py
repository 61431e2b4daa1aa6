"""bench/busy_machine.py's pieces that need no stack: the targets' verdicts, the memory walk."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("busy_machine", REPO / "bench" / "busy_machine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def out(**kw):
    o = {"replicas_peak": 1, "replica_limit": 1, "max_tokens": 32, "rate_rps": 0.5,
         "loadavg": (1.5, 1.2, 1.0),
         "concurrent": [{"code": 200, "ttft_ms": 900.0}] * 8,
         "rate": {"tool": "guidellm", "served": 15, "requests": 15}}
    o.update(kw)
    return o


def test_a_run_that_meets_every_target(bench):
    assert all(t["met"] for t in bench.targets(out()))


@pytest.mark.parametrize("change,which", [
    ({"replicas_peak": 2}, 0),
    ({"replica_limit": None}, 0),
    ({"concurrent": [{"code": 200, "ttft_ms": 900.0}] * 7 + [{"code": 429, "ttft_ms": None}]}, 1),
    ({"concurrent": [{"code": 200, "ttft_ms": 4100.0}] * 8}, 1),
    ({"rate": {"tool": "guidellm", "served": 14, "requests": 15}}, 2),
])
def test_each_target_fails_alone(bench, change, which):
    met = [t["met"] for t in bench.targets(out(**change))]
    assert met == [i != which for i in range(3)]
    assert "load average 1.50" in bench.targets(out(**change))[0]["label"]


def test_the_memory_walk_finds_this_process_and_counts_its_pages(bench):
    m = bench.stack_memory(os.getpid())
    assert m["processes"][0]["pid"] == os.getpid()
    assert m["processes"][0]["rss_bytes"] > 0
    assert m["pss_bytes_sum"] <= m["rss_bytes_sum"]
