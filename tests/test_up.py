"""End to end: ``rewarm up --demo`` on a tiny synthetic model and a short trace, and
``rewarm up`` stopped by Ctrl-C (SIGINT) leaving no process behind.  Both run the real
command in a child process (replicas are its own children), so they are slow."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """The ``tiny`` preset with 512 positions: the engine's default KV length (512) must fit
    the model, else the snapshot the cold boot captures cannot be restored."""
    from agent.replica.synthetic import make_synthetic

    out = make_synthetic(tmp_path_factory.mktemp("up") / "tiny", "tiny")
    config = json.loads((out / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (out / "config.json").write_text(json.dumps(config))
    return out


def short_trace(path: Path, n: int = 24, rate_rps: float = 2.0) -> Path:
    rng = random.Random(3)
    t = 0.0
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for _ in range(n):
        t += rng.expovariate(rate_rps)
        lines.append(f"2023-11-16 18:17:{t:010.7f},{rng.randint(100, 3000)},{rng.randint(4, 40)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (the state directory names every replica's
    socket), this test process excluded."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(int(entry.name))
    return found


def wait_gone(text: str, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_mentioning(text)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_demo_end_to_end(tmp_path, tiny_model):
    state = tmp_path / "state"
    out = tmp_path / "demo.json"
    trace = short_trace(tmp_path / "trace.csv")
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli", "up", "--demo", "--model-dir", str(tiny_model),
         "--no-aot", "--port", "0", "--trace", str(trace), "--replay-s", "5", "--minutes", "1",
         "--state-dir", str(state), "--json", str(out), "--idle-timeout-s", "120"],
        cwd=REPO, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["requests_by_path"]["cold_boot"] >= 1
    assert s["requests_by_path"]["snapshot_restore"] >= 1
    assert s["golden_checks_failed"] == 0 and s["golden_checks_passed"] >= 1
    assert s["lost"] == 0
    assert s["probe_match"] is True
    served = sum(s["requests_by_path"].values())
    assert served + s["shed"] + s["expired"] + s["lost"] == s["requests"]
    from agent.sim.demo import replay_window
    assert s["window_requests"] == len(replay_window(trace, minutes=1))
    assert 1 <= s["replayed_requests"] <= s["window_requests"]
    assert s["requests"] == 2 + s["replayed_requests"]  # + 2 probes
    assert 0.0 <= s["sla_attainment"] <= 1.0 and s["sla_requests"] == s["requests"] - 1
    # scaled to at most the asked load, where one always-on replica can meet the SLO
    assert s["load_asked"] == 0.3 and 0 < s["load"] <= 0.3 + 1e-9
    assert s["profile"]["prefill_tokens_per_s"] and s["sustained"]["backlog_rps"] > 0
    # the same requests against one always-on replica, each side's GPU-seconds measured
    on = s["always_on"]
    assert on["requests"] == s["replayed_requests"] and on["lost"] == 0
    assert 0.0 <= on["sla_attainment"] <= 1.0
    assert s["gpu_seconds"] > 0 and on["gpu_seconds"] == s["always_on_gpu_seconds"] > 0
    assert s["ttft_ms"]["cold_boot"]["p50"] > 0
    assert any(r["path"] == "restore" and r["outcome"] == "ok" for r in s["restores"])
    assert "rewarm demo: requests as a client saw them" in proc.stdout
    assert "always-on" in proc.stdout and "one always-on replica:" in proc.stdout
    assert "scaled to zero after" in proc.stdout
    assert wait_gone(str(state)) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ctrl_c_leaves_no_process_behind(tmp_path, tiny_model):
    from agent.client import Client

    state = tmp_path / "state"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "up", "--model-dir", str(tiny_model), "--no-aot",
         "--port", "0", "--http-port", "0", "--agent-listen", "127.0.0.1:0",
         "--state-dir", str(state)], cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        address = None
        deadline = time.monotonic() + 120
        lines = []
        while address is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "front door listening on " in line:
                address = line.split("front door listening on ", 1)[1].split()[0]
        assert address, "".join(lines)
        url = lines[-1].split("OpenAI-compatible HTTP on ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:")          # the banner names the HTTP door
        import urllib.request
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        host, _, port = address.rpartition(":")
        client = Client(host, int(port))
        try:
            # the first request cold-boots, which no TTFT SLO allows for: it carries its own
            # deadline (admission refuses at once what its SLO cannot be met in)
            done = client.generate("tiny", tokens=[1, 2, 3, 4], max_tokens=4,
                                   deadline_ms=120_000)
        finally:
            client.close()
        assert done.done["path"] == "cold_boot" and len(done.tokens) == 4
        metrics = lines[-1].split("metrics on ", 1)[1].split()[0].rstrip(";")
        with urllib.request.urlopen(metrics, timeout=10) as r:   # every part on one port
            text = r.read().decode()
        assert 'rewarm_requests_total{code="200",model="tiny",path="cold_boot"} 1.0' in text
        assert "rewarm_node_restores_total" in text and text.count("# TYPE process_cpu") == 1
        assert processes_mentioning(str(state / "run")), "no replica process was started"
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, rest[-3000:]
        assert "stopping" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert wait_gone(str(state)) == []
