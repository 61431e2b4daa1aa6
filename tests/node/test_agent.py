"""The agent's restore ladder, capture, drain guard and registration on a tiny synthetic model,
with real snapshots, real restores and real golden checks (in-process backend)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agent.cluster.local import LocalRegistry
from agent.errors import ConfigError, ModelNotFound, ReplicaNotFound
from agent.node import capture as cap
from agent.node.agent import AgentConfig, NodeAgent, ScaleInBlocked
from agent.snapshot.format import ALIGN
from agent.snapshot.reader import read_manifest
from agent.snapshot.store import LocalStore

PROMPTS = [[1, 2, 3, 4], [9, 8, 7]]


def first_boot(agent):
    """Cold boot, then wait for the background capture; returns (replica info, snapshot row)."""
    info = agent.restore("tiny")
    row = agent.captures[agent.models["tiny"].key].result(timeout=120)
    return info, row


def tokens(agent, replica_id):
    return agent.replicas[replica_id].handle.generate(PROMPTS, 6, seed=5)


def test_first_boot_captures_then_restores_same_tokens(make_agent):
    agent = make_agent()
    info, row = first_boot(agent)
    assert info["path"] == "cold_boot" and info["state"] == "warm"
    assert row.status == "ready" and row.reason.startswith("verified")
    assert agent.backend.cold_boots == [agent.models["tiny"].key]
    again = agent.restore("tiny")
    assert (again["path"], again["snapshot"]) == ("restore", row.snapshot_id)
    assert tokens(agent, again["replica"]) == tokens(agent, info["replica"])
    assert agent.backend.cold_boots == [agent.models["tiny"].key]  # no second cold boot
    healthy = agent.registrar.registry.healthy("rewarm-replica", "model=tiny")
    assert sorted(i.id for i in healthy) == sorted([info["replica"], again["replica"]])
    events = agent.catalog.cold_starts("tiny")
    assert [e["path"] for e in events] == ["cold_boot", "restore"]
    assert agent.catalog.replica(again["replica"])["snapshot_id"] == row.snapshot_id


def test_flipped_byte_fails_closed_to_cold_boot(make_agent):
    agent = make_agent()
    _, row = first_boot(agent)
    data = Path(row.path) / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[ALIGN + 17] ^= 0x01
    data.write_bytes(bytes(raw))
    info = agent.restore("tiny")
    assert info["path"] == "cold_boot"
    assert info["attempts"][0]["status"] == "corrupt"
    assert info["attempts"][0]["error"] == "SnapshotCorrupt"
    assert agent.catalog.snapshot(row.snapshot_id).status == "corrupt"
    assert not agent.store.has(row.snapshot_id)
    fresh = agent.captures[agent.models["tiny"].key].result(timeout=120)
    assert fresh.status == "ready" and fresh.snapshot_id != row.snapshot_id


def _foreign_snapshot(agent, base_row, *, pins=None, golden=None):
    """A snapshot of the same weights written with other pins or other golden tokens."""
    from agent.snapshot.reader import restore_snapshot
    from agent.snapshot.writer import write_snapshot

    restored = restore_snapshot(base_row.path)
    m = restored.manifest
    sid = base_row.snapshot_id + "-x"
    write_snapshot(agent.store.path(sid), restored.tensors, model=m.model,
                   golden=golden or m.golden, extra=m.extra, pins=pins or m.pins)
    spec = agent.models["tiny"]
    agent.catalog.set_status(base_row.snapshot_id, "stale", "test: superseded")
    agent.store.remove(base_row.snapshot_id)
    cap.register_snapshot(agent.catalog, agent.store, sid, spec)
    agent.catalog.set_status(sid, "ready")
    return sid


def test_pin_mismatch_marks_stale_and_cold_boots(make_agent):
    agent = make_agent()
    _, row = first_boot(agent)
    m = read_manifest(row.path)
    sid = _foreign_snapshot(agent, row, pins=dataclasses.replace(m.pins, torch="0.0.1"))
    info = agent.restore("tiny")
    assert info["path"] == "cold_boot"
    assert info["attempts"][0]["error"] == "SnapshotIncompatible"
    assert "torch" in info["attempts"][0]["reason"]
    assert agent.catalog.snapshot(sid).status == "stale"


def test_golden_mismatch_marks_corrupt(make_agent):
    agent = make_agent()
    _, row = first_boot(agent)
    g = read_manifest(row.path).golden
    wrong = [list(t) for t in g.expected]
    wrong[0][2] = (wrong[0][2] + 1) % 50
    sid = _foreign_snapshot(agent, row, golden=dataclasses.replace(g, expected=wrong))
    info = agent.restore("tiny")
    assert info["path"] == "cold_boot"
    assert info["attempts"][0]["error"] == "GoldenMismatch"
    assert agent.catalog.snapshot(sid).status == "corrupt"


def test_drain_guard_until_snapshot_ready(make_agent, tiny_dir):
    agent = make_agent()
    info, row = first_boot(agent)
    rid = info["replica"]
    # Its only snapshot goes stale: the last replica may not be drained any more.
    agent.catalog.set_status(row.snapshot_id, "stale", "test")
    assert not agent.snapshot_durable("tiny")
    with pytest.raises(ScaleInBlocked) as err:
        agent.drain(rid)
    assert err.value.model == "tiny"
    assert agent.replicas[rid].lifecycle.state.value == "warm"
    done = agent.drain(rid, force=True)
    assert done["state"] == "dead" and done["in_flight_at_stop"] == 0
    assert agent.registrar.registry.healthy("rewarm-replica") == []


def test_drain_allowed_with_ready_snapshot(make_agent):
    agent = make_agent()
    info, row = first_boot(agent)
    assert agent.snapshot_durable("tiny")
    done = agent.drain(info["replica"])
    assert done["state"] == "dead"
    assert [r["state"] for r in agent.catalog.replicas("tiny")] == ["dead"]


def test_registry_down_keeps_serving_and_reregisters(make_agent):
    agent = make_agent()
    reg = agent.registrar.registry
    reg.down = True
    info, _ = first_boot(agent)
    assert info["state"] == "warm"               # served without the registry
    assert not agent.registrar.state.healthy
    assert tokens(agent, info["replica"])
    calls = reg.calls
    agent.tick()                                 # inside the backoff: no call
    assert reg.calls == calls
    reg.down = False
    agent.clock.advance(agent.registrar.max_backoff_s)
    agent.tick()
    assert agent.registrar.state.healthy
    assert [i.id for i in reg.healthy("rewarm-replica")] == [info["replica"]]
    assert reg.healthy("rewarm-agent")[0].meta["snapshots"].startswith("tiny@")


def test_status_snapshot_ops(make_agent):
    agent = make_agent()
    _, row = first_boot(agent)
    st = agent.status()
    assert st["node"] == "n1" and st["inventory"]["devices"] == ["cpu"]
    assert [r["state"] for r in st["replicas"]] == ["warm"]
    listed = agent.snapshot_list("tiny")
    assert [(s["snapshot"], s["status"], s["local"]) for s in listed] == [
        (row.snapshot_id, "ready", True)]
    ok = agent.snapshot_verify(row.snapshot_id)
    assert ok["ok"] and ok["bytes"] == read_manifest(row.path).total_bytes
    assert agent.snapshot_evict(row.snapshot_id) == {"snapshot": row.snapshot_id, "evicted": True}
    after = agent.snapshot_list("tiny")  # no remote copy: the row stays, as stale
    assert [(s["status"], s["local"]) for s in after] == [("stale", False)]
    assert after[0]["reason"] == "evicted from the local tier; no remote copy"


def test_bad_requests(make_agent):
    agent = make_agent()
    with pytest.raises(ModelNotFound):
        agent.restore("nope")
    with pytest.raises(ConfigError):
        agent.restore("tiny", device="cuda:3")
    with pytest.raises(ReplicaNotFound) as err:
        agent.drain("no-such-replica")
    assert (err.value.code, err.value.replica, err.value.node) == (404, "no-such-replica", "n1")
    with pytest.raises(ConfigError):
        AgentConfig(node_id="x", restore_timeout_s=0)


def test_pool_refill(make_agent):
    agent = make_agent(zygotes_per_device=2)
    assert agent.refill_pool() == 2
    assert agent.refill_pool() == 0
    assert agent.status()["zygotes"] == {"cpu": 2}


def test_zygotes_warm_for_the_snapshot_they_will_restore(make_agent):
    agent = make_agent(zygotes_per_device=2)
    assert agent.warm_for("cpu") is None                 # nothing captured yet
    assert agent.refill_pool() == 2
    unwarmed = list(agent.pool["cpu"])
    assert [z.warm for z in unwarmed] == [None, None]
    _, row = first_boot(agent)                           # the capture refills too
    snap = agent.store.path(row.snapshot_id)
    assert agent.warm_for("cpu") == snap
    agent.refill_pool()
    assert [z.warm for z in agent.pool["cpu"]] == [snap, snap]
    assert all(z.spent for z in unwarmed)                # the replaced ones were killed
    assert agent.refill_pool() == 0                      # warmed for it already: none again
    taken = agent.zygotes.take("cpu", "tiny")
    assert taken.warm == snap and len(agent.pool["cpu"]) == 1


def test_a_zygote_that_died_while_it_waited_is_not_used(make_agent):
    # a dead zygote (OOM-killed, crashed) says nothing about the snapshot: a restore must not
    # take it, fail, and mark a sound local snapshot stale; a refill replaces it
    agent = make_agent(zygotes_per_device=2)
    _, row = first_boot(agent)
    agent.refill_pool()
    dead, alive = agent.pool["cpu"]
    dead.kill()                                          # died while it waited
    assert agent.refill_pool() == 1                      # replaced, not counted as ready
    assert dead not in agent.pool["cpu"] and len(agent.pool["cpu"]) == 2
    agent.pool["cpu"].insert(0, dead)                    # and one that dies after the refill
    info = agent.restore("tiny")
    assert (info["path"], info["snapshot"]) == ("restore", row.snapshot_id)
    assert info["attempts"] == []                        # no failed attempt before it
    assert agent.store.has(row.snapshot_id)
    assert agent.catalog.snapshot(row.snapshot_id).status == "ready"
    assert dead not in agent.pool["cpu"]


def test_a_restore_racing_close_leaves_no_replica_behind(make_agent):
    # close() drained the replicas warm when it began; one restoring then came up warm
    # after it returned, with nobody left to stop it (a process left behind)
    import threading

    from agent.errors import NoCapacity

    agent = make_agent(zygotes_per_device=1)
    first, _ = first_boot(agent)
    agent.refill_pool()
    zygote = agent.pool["cpu"][0]
    real_restore, closer = zygote.restore, []

    def restore_while_closing(snapshot, replica_id):
        closer.append(threading.Thread(target=agent.close))
        closer[0].start()
        while not agent.closing:                 # close() has begun (it sets this first)
            threading.Event().wait(0.01)
        return real_restore(snapshot, replica_id)
    zygote.restore = restore_while_closing
    with pytest.raises(NoCapacity) as err:
        agent.restore("tiny")
    closer[0].join(timeout=120)
    assert not closer[0].is_alive()
    assert "closing" in str(err.value) and "n1" in str(err.value)
    assert [r.lifecycle.replica_id for r in agent.live_replicas_all()] == []
    assert agent.replicas[first["replica"]].lifecycle.state.value == "dead"
    with pytest.raises(NoCapacity):             # and none starts after close
        agent.restore("tiny")
    assert agent.live_replicas_all() == [] and agent.status()["zygotes"] == {"cpu": 0}


def test_the_cpu_device_keeps_a_zygote_per_replica_slot(make_agent):
    agent = make_agent(max_replicas_per_model=3)          # a CPU-only node: three core groups
    assert agent.pool_target("cpu") == 3 and agent.pool_target("cuda:0") == 1
    assert agent.refill_pool() == 3
    assert agent.status()["zygotes"] == {"cpu": 3}


def test_restart_reconciles_pending(make_agent, tmp_path):
    agent = make_agent()
    _, row = first_boot(agent)
    spec = agent.models["tiny"]
    agent.catalog.add_snapshot("half", model_name="tiny", model_version=spec.version,
                               path="x", pins={}, size_bytes=0, digest="")
    again = NodeAgent(agent.config, models=[spec], backend=agent.backend, catalog=agent.catalog,
                      store=LocalStore(agent.store.root, 1 << 30, clock=agent.clock),
                      registry=LocalRegistry(agent.clock), inventory=agent.inventory,
                      clock=agent.clock, executor=agent.executor)
    assert {s["snapshot"]: s["status"] for s in again.snapshot_list("tiny")} == {
        row.snapshot_id: "ready", "half": "stale"}
    assert again.store.has(row.snapshot_id)


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_capture_is_pushed_and_corrupt_local_copy_restages(make_agent):
    agent = make_agent(remote=True)
    first, row = first_boot(agent)
    assert row.remote_uri is not None and Path(row.remote_uri).is_dir()
    assert agent.catalog.durable_ready("tiny")
    _flip(Path(row.path) / "data-00000.bin", ALIGN + 5)
    info = agent.restore("tiny")
    assert info["path"] == "staged_restore"
    assert info["snapshot"] == row.snapshot_id + ".s0"
    assert [a["status"] for a in info["attempts"]] == ["corrupt"]
    assert agent.catalog.snapshot(row.snapshot_id).status == "corrupt"
    assert agent.catalog.snapshot(row.snapshot_id + ".s0").status == "ready"
    assert tokens(agent, info["replica"]) == tokens(agent, first["replica"])
    assert agent.backend.cold_boots == [agent.models["tiny"].key]
    assert agent.status()["staging"] == {}


def test_remote_unavailable_falls_back_to_cold_boot(make_agent):
    import shutil

    agent = make_agent(remote=True)
    _, row = first_boot(agent)
    shutil.rmtree(row.remote_uri)                 # the shared mount is gone
    _flip(Path(row.path) / "data-00000.bin", ALIGN + 5)
    info = agent.restore("tiny")
    assert info["path"] == "cold_boot"
    assert [(a["path"], a["status"]) for a in info["attempts"]] == [
        ("restore", "corrupt"), ("stage", "failed")]
    assert len(agent.backend.cold_boots) == 2


def test_evicted_local_copy_restages_from_remote(make_agent):
    agent = make_agent(remote=True)
    _, row = first_boot(agent)
    assert agent.snapshot_evict(row.snapshot_id)["evicted"]
    assert agent.catalog.snapshot(row.snapshot_id).status == "ready"  # still held remotely
    info = agent.restore("tiny")
    assert (info["path"], info["attempts"]) == ("staged_restore", [])


def test_in_process_replica_cannot_be_suspended(make_agent):
    agent = make_agent()
    info = agent.restore("tiny")
    with pytest.raises(ConfigError) as err:
        agent.suspend(info["replica"])
    assert "no CUDA checkpoint support" in str(err.value)
    agent.captures[agent.models["tiny"].key].result(timeout=120)


def test_restore_answer_carries_the_load_and_the_cap_reuses_the_warm_replica(make_agent):
    from agent.errors import NoCapacity
    from agent.speed import QUEUE_META_KEYS, SPEED_META_KEYS
    from agent.node.lifecycle import Lifecycle
    from agent.node.state import ReplicaRecord

    agent = make_agent(max_replicas_per_model=1, restore_timeout_s=5.0)
    first = agent.restore("tiny")
    assert first["path"] == "cold_boot" and first["address"]
    assert set(first["load"]) == {"max_seqs", "active_seqs", "kv_capacity_tokens",
                                  "kv_used_tokens", *QUEUE_META_KEYS, *SPEED_META_KEYS}
    assert all(isinstance(first["load"][k], float) for k in SPEED_META_KEYS)
    assert first["load"]["kv_capacity_tokens"] > 0 and first["load"]["active_seqs"] == 0
    again = agent.restore("tiny")
    assert (again["replica"], again["path"]) == (first["replica"], "warm")
    assert len(agent.replicas) == 1 and len(agent.backend.cold_boots) == 1
    # At the cap with the only replica still coming up: wait for it, then give up typed.
    agent.drain(first["replica"], force=True)
    booting = ReplicaRecord(Lifecycle("n1-booting", clock=agent.clock), agent.models["tiny"], "cpu")
    agent.replicas["n1-booting"] = booting
    before = agent.clock.now()
    with pytest.raises(NoCapacity, match="max_replicas_per_model"):
        agent.restore("tiny")
    assert agent.clock.now() - before >= 5.0
    with pytest.raises(ConfigError, match="max_replicas_per_model"):
        AgentConfig(node_id="x", max_replicas_per_model=0)
