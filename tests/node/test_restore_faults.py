"""A restore that fails for a reason that is not the snapshot's keeps the snapshot.

Only a failed verification (checksum, golden tokens) marks a snapshot corrupt, and only pins
that differ mark it stale; running out of memory, a killed zygote or a timeout say nothing
about the bytes, so the snapshot stays ready, its local copy stays, and the next restore
uses it instead of cold-booting until a new capture exists.
"""

from __future__ import annotations

import pytest

from agent.errors import CudaCheckpointError, RewarmError


def first_boot(agent):
    info = agent.restore("tiny")
    row = agent.captures[agent.models["tiny"].key].result(timeout=120)
    return info, row


def failing_once(agent, exc):
    """The next zygote taken raises ``exc`` from its restore (then the real ones again)."""
    real_take = agent.zygotes.take
    state = {"left": 1}

    def take(device, model):
        z = real_take(device, model)
        if state["left"]:
            state["left"] -= 1

            def restore(snapshot, replica_id):
                raise exc
            z.restore = restore
        return z

    agent.zygotes.take = take


@pytest.mark.parametrize("exc", [
    MemoryError("cannot allocate 512 MiB"),
    RewarmError("zygote 4242 exited with signal 9 before answering"),
    CudaCheckpointError("restore did not finish within toggle_timeout_s=1", call="restore",
                        result=None, name="timeout", value=1, limit=1),
], ids=["memory", "killed_zygote", "timeout"])
def test_a_fault_that_is_not_the_snapshots_keeps_it_ready(make_agent, exc):
    agent = make_agent()
    _, row = first_boot(agent)
    failing_once(agent, exc)
    info = agent.restore("tiny")
    assert info["state"] == "warm"                       # served anyway (cold boot)
    assert info["attempts"][0]["status"] == "transient"
    assert info["attempts"][0]["error"] == type(exc).__name__
    assert agent.catalog.snapshot(row.snapshot_id).status == "ready"
    assert agent.store.has(row.snapshot_id)
    again = agent.restore("tiny")                        # the next one restores from it
    assert (again["path"], again["snapshot"]) == ("restore", row.snapshot_id)


@pytest.mark.parametrize("verify_exc", [
    MemoryError("cannot allocate the verification buffer"),
    OSError(24, "Too many open files"),
], ids=["memory", "emfile"])
def test_a_verification_that_cannot_run_keeps_the_snapshot_and_still_cold_boots(
        make_agent, monkeypatch, verify_exc):
    """The re-read that settles an unclear fault can itself fail for a reason that is not the
    snapshot's (the same memory shortage, no file descriptors left): that says nothing about
    the bytes, so the snapshot stays ready and the ladder goes on to a cold boot instead of
    failing the whole restore."""
    from agent.node import ladder

    agent = make_agent()
    _, row = first_boot(agent)
    failing_once(agent, MemoryError("cannot allocate 512 MiB"))

    def verify(*_a, **_k):
        raise verify_exc
    monkeypatch.setattr(ladder, "verify_chunks", verify)
    info = agent.restore("tiny")
    assert info["state"] == "warm" and info["path"] == "cold_boot"
    assert info["attempts"][0]["status"] == "transient"
    assert agent.catalog.snapshot(row.snapshot_id).status == "ready"
    assert agent.store.has(row.snapshot_id)


def test_a_local_copy_evicted_between_the_look_and_the_read_still_cold_boots(make_agent):
    """The ladder sees the local copy, then (another restore's staging made room) it is gone
    when the restore opens it: the zygote taken for it is not leaked and the ladder goes on
    (a cold boot here, with no remote copy) instead of failing the restore."""
    from agent.errors import SnapshotNotFound

    agent = make_agent()
    _, row = first_boot(agent)
    real_reading, killed = agent.store.reading, []
    real_take = agent.zygotes.take

    def take(device, model):
        z = real_take(device, model)
        real_kill = z.kill

        def kill():
            killed.append(z)
            real_kill()
        z.kill = kill
        return z

    def reading(snapshot_id):
        agent.store.reading = real_reading
        raise SnapshotNotFound(f"snapshot {snapshot_id!r} is not in the local tier")
    agent.zygotes.take = take
    agent.store.reading = reading
    info = agent.restore("tiny")
    assert info["state"] == "warm" and info["path"] == "cold_boot"
    assert info["attempts"][0]["error"] == "SnapshotNotFound"
    assert len(killed) == 1            # the zygote taken for the vanished copy is not leaked
