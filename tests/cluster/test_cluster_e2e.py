"""The cluster path end to end, as bench/cluster_e2e.py runs it: three hosts (network
namespaces, or 127.0.0.x where they are unavailable), the four jobs in jobs/ submitted to the
Nomad stand-in, which runs them; every step of the scenario is asserted by the script and
again here.  Speed targets (first token against restore time) are the benchmark's to report;
this test checks that each step happened and that no request was lost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

KEYS = {"steps", "first_token_via_nomad_s", "restore_s", "requests", "lost",
        "leader_failover_s", "watch_requests_per_s_at_index_0", "hosts", "jobspec_check",
        "second_scale_during_deployment_s", "acl_enforced", "meta"}
STEPS = ["every job parses with HashiCorp's HCL2, 0 unknown arguments, 0 validation errors",
         "an invalid job's registration is answered once, clearly, no retry loop",
         "job submitted at count 0", "first request scales from zero through Nomad",
         "served by a Nomad allocation", "snapshot durable",
         "caching node publishes the snapshot in Nomad node metadata",
         "idle: the predictor scales in after the snapshot is durable",
         "burst: a second replica within 5 s of the first scale-up",
         "next request restores on the caching node",
         "node agent killed: allocation rescheduled, traffic moves",
         "leader predictor killed: a new leader within 12 s (Consul's 2 x TTL is 20 s)",
         "watch at index 0 stays slow"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_whole_scenario_on_three_hosts(tmp_path, repo_root):
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, str(repo_root / "bench" / "cluster_e2e.py"),
                           "--json", str(out), "--work", str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=400, cwd=repo_root)
    res = json.loads(out.read_text())
    failed = [s for s in res["steps"] if not s["ok"]]
    assert proc.returncode == 0 and not failed, (failed, res.get("error"), proc.stdout[-3000:])
    assert KEYS <= set(res)
    assert [s["name"] for s in res["steps"] if not s["name"].startswith("cast")] == STEPS
    assert all(isinstance(s["at_s"], float) for s in res["steps"])
    assert res["hosts"]["kind"] in ("netns", "loopback") and len(res["hosts"]["addresses"]) == 3
    assert res["acl_enforced"] is True and res["lost"] == 0
    assert all(c == {"parsed": True, "unknown_arguments": [], "validation_errors": []}
               for c in res["jobspec_check"].values()) and len(res["jobspec_check"]) == 4
    assert res["invalid_job_registration"]["register_requests"] == 1
    assert res["lost"] == 0 and res["requests"] > 0
    assert res["restore_s"] > 0 and res["first_token_via_nomad_s"] > 0
    assert res["total_s"] <= res["limit_s"]
    assert "timeline" not in proc.stderr and "at_s" in proc.stdout     # the table is printed


def test_a_refused_request_fails_the_scenario_with_the_json_written(repo_root, monkeypatch):
    """A 429 in a step (seen on a loaded machine at 'next request restores on the caching
    node') ended the bench with a traceback and no JSON; it is a failed scenario step."""
    import importlib.util

    from agent.errors import Overloaded

    spec = importlib.util.spec_from_file_location("cluster_e2e_bench",
                                                  repo_root / "bench" / "cluster_e2e.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)   # its dataclasses look it up
    spec.loader.exec_module(bench)
    closed = []
    monkeypatch.setattr(bench, "standin_cast", lambda run, work, netns, tick_s: (
        None, None, "t", [lambda: closed.append(True)], None, None))

    def refused(run, cluster, door, token, **kw):
        run.step("job submitted at count 0", True)
        raise Overloaded("429: model 'tiny': cannot start within 4000 ms")

    monkeypatch.setattr(bench, "scenario", refused)
    out = bench.run_scenario(real=False, prefer_netns=False, work=None)
    assert out["ok"] is False and out["error"].startswith("Overloaded: 429")
    assert [(s["name"], s["ok"]) for s in out["steps"]] == [
        ("job submitted at count 0", True), ("scenario", False)]
    assert closed == [True]      # the cast is still torn down
