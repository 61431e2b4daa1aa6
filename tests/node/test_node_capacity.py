"""A node runs no more replicas than its cores (CPU) or devices (GPU) serve at speed, and says
so in its capacity answer."""

from __future__ import annotations

import pytest

from agent.errors import ConfigError, NoCapacity
from agent.node.capacity import ReplicaLimit


def test_cpu_limit_is_cores_over_threads():
    assert ReplicaLimit.for_cpu(2, 1).limit == 2
    assert ReplicaLimit.for_cpu(16, 4).limit == 4
    assert ReplicaLimit.for_cpu(2, 4).limit == 1          # one replica still runs
    assert ReplicaLimit.for_cpu(8, None).limit == 1       # torch's default: every core
    assert "2 cores // 1 threads" in ReplicaLimit.for_cpu(2, 1).basis
    assert ReplicaLimit.for_devices(4).limit == 4
    for bad in (lambda: ReplicaLimit.for_cpu(0, 1), lambda: ReplicaLimit.for_cpu(2, 0),
                lambda: ReplicaLimit.for_devices(0)):
        with pytest.raises(ConfigError):
            bad()


def test_the_answer_counts_what_is_up():
    assert ReplicaLimit(2, "x").answer(3) == {"replica_limit": 2, "basis": "x", "replicas": 3,
                                             "free": 0}


def first_boot(agent):
    info = agent.restore("tiny")
    agent.captures[agent.models["tiny"].key].result(timeout=120)
    return info


def test_a_full_node_answers_with_its_warm_replica_and_says_why(make_agent, monkeypatch):
    monkeypatch.setattr("agent.node.capacity.usable_cores", lambda: 1)
    agent = make_agent(limit_to_node=True)
    info = first_boot(agent)
    assert info["capacity"] == {"replica_limit": 1, "replicas": 1, "free": 0,
                                "basis": "1 cores; replicas without --threads use them all"}
    again = agent.restore("tiny")                         # no second replica on one core
    assert again["path"] == "warm" and again["replica"] == info["replica"]
    assert len(agent.live_replicas_all()) == 1
    assert agent.status()["capacity"]["free"] == 0


def test_a_full_node_refuses_another_model_at_once(make_agent, monkeypatch):
    monkeypatch.setattr("agent.node.capacity.usable_cores", lambda: 1)
    agent = make_agent(limit_to_node=True)
    first_boot(agent)
    agent.models["other"] = agent.models["tiny"]           # a second model, nothing of it up
    with pytest.raises(NoCapacity) as err:
        agent.restore("other")
    assert "runs 1 replica(s) at speed" in str(err.value)
    assert err.value.capacity["free"] == 0


def test_without_the_limit_the_node_starts_what_it_is_asked(make_agent):
    agent = make_agent()
    first_boot(agent)
    assert agent.restore("tiny")["path"] == "restore"
    assert agent.capacity() is None and agent.status()["capacity"] is None


def test_zygotes_are_kept_for_every_replica_the_node_can_run(make_agent, monkeypatch):
    monkeypatch.setattr("agent.node.capacity.usable_cores", lambda: 4)
    agent = make_agent(limit_to_node=True, zygotes_per_device=1)
    agent.backend.threads = 2                               # 4 cores // 2 threads
    assert agent.replica_limit().limit == 2
    assert agent.pool_target("cpu") == 2                    # one ready per replica slot
    capped = make_agent(limit_to_node=True, zygotes_per_device=1, max_replicas_per_model=1)
    capped.backend.threads = 2
    assert capped.pool_target("cpu") == 1


def test_the_pool_is_refilled_as_soon_as_a_restore_takes_its_zygote(make_agent):
    agent = make_agent(zygotes_per_device=1)
    first_boot(agent)
    agent.refill_pool()
    order = []
    real_refill, real_take = agent.ladder._refill, agent.zygotes.take

    def take(device, model):
        z = real_take(device, model)
        real_restore = z.restore

        def restore(snapshot, replica_id):
            order.append("restore")
            return real_restore(snapshot, replica_id)
        z.restore = restore
        return z

    agent.zygotes.take = take
    agent.ladder._refill = lambda: (order.append("refill"), real_refill())
    assert agent.restore("tiny")["path"] == "restore"
    assert order[:2] == ["refill", "restore"]


def test_a_replica_draining_with_requests_in_flight_still_holds_its_cores(make_agent, monkeypatch):
    monkeypatch.setattr("agent.node.capacity.usable_cores", lambda: 1)
    agent = make_agent(limit_to_node=True)
    rid = first_boot(agent)["replica"]
    rec = agent.state.rec(rid)
    left = iter([2, 1, 0, 0])
    during_first_call = []

    def in_flight():          # a call to the worker: another thread may ask for room meanwhile
        if not during_first_call:
            during_first_call.append(agent.capacity()["replicas"])
        return next(left)

    rec.handle.in_flight = in_flight
    seen = []

    def poll(seconds):        # what a restore asking for room would see while the drain waits
        seen.append((agent.capacity()["replicas"], agent.status()["replicas"][0]["in_flight"]))
        agent.clock.advance(seconds)

    agent.draining._sleep = poll
    out = agent.drain(rid, force=True)
    assert during_first_call == [1]           # counted before its first answer, too
    assert seen == [(1, 2), (1, 1)]           # counted while it still serves; a restore waits
    assert out["in_flight_at_stop"] == 0 and agent.capacity()["replicas"] == 0
