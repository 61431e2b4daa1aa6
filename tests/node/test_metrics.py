"""agent/node/metrics.py: the agent's exposition read back through prometheus-client's
parser after a real cold boot, a restore and a fail-closed restore; readiness and the status
port's paths; ``status`` showing restores in flight with their phase."""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.health import serve_status
from agent.node.lifecycle import ReplicaState
from agent.node.metrics import FAILURE_KINDS, failure_kind, readiness
from agent.snapshot.format import ALIGN
from agent.telemetry import BUCKETS_S


def scrape(agent) -> dict:
    text = generate_latest(agent.metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def values(fam, suffix="", **match):
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples
            if s.name == fam.name + suffix and all(s.labels.get(k) == v for k, v in match.items())}


def test_restore_metrics_after_cold_boot_restore_and_a_corrupt_copy(make_agent):
    agent = make_agent()
    agent.restore("tiny")                                    # cold boot, capture behind it
    row = agent.captures[agent.models["tiny"].key].result(timeout=120)
    again = agent.restore("tiny")                            # local snapshot restore
    assert again["path"] == "restore"
    raw = bytearray((Path(row.path) / "data-00000.bin").read_bytes())
    raw[ALIGN + 17] ^= 0x01
    (Path(row.path) / "data-00000.bin").write_bytes(bytes(raw))
    third = agent.restore("tiny")                            # checksum fails closed -> cold
    assert third["path"] == "cold_boot"
    # the cold boot captures anew behind it: let that write land before the scrape, so the
    # cache gauges and the store are read in one state
    agent.captures[agent.models["tiny"].key].result(timeout=120)
    f = scrape(agent)

    hist = f["rewarm_node_restore_seconds"]
    counts = values(hist, "_count")
    assert counts == {(("model", "tiny"), ("node", "n1"), ("tier", "cold")): 2,
                      (("model", "tiny"), ("node", "n1"), ("tier", "local")): 1}
    bounds = [float(s.labels["le"]) for s in hist.samples
              if s.name.endswith("_bucket") and s.labels["tier"] == "local"]
    assert bounds == [*map(float, BUCKETS_S), math.inf]
    phases = values(f["rewarm_node_restore_phase_seconds"], "_count", tier="local")
    assert {dict(k)["phase"] for k in phases} == {"weights", "package", "golden"}
    assert set(values(f["rewarm_node_restored_bytes"], "_total")) == {
        (("node", "n1"), ("tier", "local"))}
    assert values(f["rewarm_node_restored_bytes"], "_total")[(("node", "n1"), ("tier", "local"))] \
        == row.size_bytes
    fails = {dict(k)["kind"]: v for k, v in
             values(f["rewarm_node_verification_failures"], "_total").items()}
    assert set(fails) == set(FAILURE_KINDS) and fails["checksum"] == 1
    assert sum(fails.values()) == 1
    golden = {dict(k)["result"]: v for k, v in values(f["rewarm_node_golden_checks"], "_total").items()}
    assert golden == {"pass": 3, "fail": 0}
    lookups = {dict(k)["result"]: v for k, v in
               values(f["rewarm_node_snapshot_cache_lookups"], "_total").items()}
    assert lookups == {"hit": 2, "miss": 1}                  # the corrupt copy was present
    assert "rewarm_node_snapshot_cache_hit_ratio" not in f   # rate() of the lookups instead
    assert values(f["rewarm_node_snapshot_evictions"], "_total")[(("node", "n1"),)] == 1
    cache = {dict(k)["kind"]: v for k, v in values(f["rewarm_node_snapshot_cache_bytes"]).items()}
    assert cache["used"] == agent.store.used_bytes
    assert cache["free"] == agent.store.capacity_bytes - agent.store.used_bytes
    states = {dict(k)["state"]: v for k, v in values(f["rewarm_node_replicas"]).items()}
    assert set(states) == {s.value for s in ReplicaState} and states["warm"] == 3
    assert values(f["rewarm_node_suspended_replicas"])[(("node", "n1"),)] == 0
    assert values(f["rewarm_node_zygotes_ready"])[(("node", "n1"),)] == sum(
        len(z) for z in agent.pool.values())
    assert set(values(f["rewarm_node_restores_in_flight"]).values()) == {0}
    assert any(name.startswith("process_") for name in f)
    agent.tick()                                             # polls each warm replica's stats
    # one exporter per name: a replica's load is on the replica's own status port only
    assert not [name for name in scrape(agent) if name.startswith("rewarm_replica_")]


def test_failure_kinds():
    assert failure_kind({"path": "stage", "error": "OSError"}) == "stage"
    assert failure_kind({"path": "restore", "status": "stale-pins",
                         "error": "SnapshotIncompatible"}) == "pins"
    assert failure_kind({"path": "restore", "error": "SnapshotTampered"}) == "signature"
    assert failure_kind({"path": "restore", "error": "GoldenMismatch"}) == "golden"
    assert failure_kind({"path": "restore", "error": "RuntimeError"}) == "other"


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_readiness_and_status_port(make_agent, tiny_dir):
    agent = make_agent()
    server = serve_status(agent.metrics.registry, ready=lambda: readiness(agent),
                          component="agent")
    try:
        code, body = _get(server.url + "/readyz")
        assert code == 503 and "agent loop has not run" in body
        agent.tick()
        assert _get(server.url + "/readyz") == (200, "ready\n")
        # every restore fails: not ready, with the reason
        def no_nodes(spec, device, rid):
            raise OSError("no candidate nodes")

        agent.backend.cold_boot = no_nodes
        with pytest.raises(OSError):
            agent.restore("tiny")
        agent.tick()
        code, body = _get(server.url + "/readyz")
        assert code == 503 and "every restore fails: tiny: OSError: no candidate nodes" in body
        assert _get(server.url + "/healthz") == (200, "ok\n")
        code, body = _get(server.url + "/metrics")
        assert code == 200 and 'rewarm_node_restores_total{node="n1",result="failed",tier="none"} 1.0' in body
        assert _get(server.url + "/nope")[0] == 404
        agent.closing = True
        assert "shutting down" in _get(server.url + "/readyz")[1]
    finally:
        server.close()


def test_status_shows_restores_in_flight_with_phase(make_agent):
    agent = make_agent()
    seen = {}
    real = agent.backend.cold_boot

    def cold_boot(spec, device, rid):
        seen.update(agent.status())
        return real(spec, device, rid)

    agent.backend.cold_boot = cold_boot
    agent.restore("tiny")
    [flight] = seen["restores_in_flight"]
    assert (flight["model"], flight["phase"]) == ("tiny", "cold_boot")
    assert [r.get("phase") for r in seen["replicas"]] == ["cold_boot"]
    assert agent.status()["restores_in_flight"] == []
    agent.captures[agent.models["tiny"].key].result(timeout=120)
