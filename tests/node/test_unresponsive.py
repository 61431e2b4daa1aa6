"""A replica that stops answering (SIGSTOP, a livelock) leaves routing within a bounded time,
and comes back when it answers again."""

from __future__ import annotations

from agent.node.processes import ProcessReplica


def first_boot(agent):
    info = agent.restore("tiny")
    agent.captures[agent.models["tiny"].key].result(timeout=120)
    return info


def routed(agent):
    return {i.id for i in agent.registrar.registry.healthy("rewarm-replica", "model=tiny")}


def test_a_silent_replica_leaves_routing_after_the_bound_and_returns(make_agent):
    agent = make_agent(unresponsive_after_s=5.0, probe_timeout_s=1.0)
    rid = first_boot(agent)["replica"]
    agent.tick()
    assert rid in routed(agent)
    handle = agent.replicas[rid].handle
    real_stats = handle.stats

    def silent(timeout_s=None):
        assert timeout_s == 1.0                      # every probe is bounded
        raise TimeoutError("timed out")              # socket.timeout: what a stopped worker gives
    handle.stats = silent
    agent.tick()                                     # the first silence starts the count
    agent.clock.advance(4.0)
    agent.tick()
    assert rid in routed(agent)                      # within the bound: still routed
    agent.clock.advance(1.5)
    agent.tick()
    assert rid not in routed(agent)                  # past it: out of routing
    assert agent.replicas[rid].unrouted
    handle.stats = real_stats                        # SIGCONT
    agent.tick()
    assert rid in routed(agent) and not agent.replicas[rid].unrouted


def test_the_process_replicas_probe_uses_the_short_timeout():
    class Worker:
        address = data_address = "x"
        pid = 1

        def __init__(self):
            self.timeouts = []

        def call(self, message, timeout_s):
            self.timeouts.append(timeout_s)
            return {"answers": [], "model": "m"}

    w = Worker()
    r = ProcessReplica("r", w, 600.0)
    assert r.stats(timeout_s=2.0) == {"model": "m"}
    r.stats()
    assert w.timeouts == [2.0, 600.0]
