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


def test_a_replica_that_answers_slowly_gets_a_bound_from_its_probe_history(make_agent):
    """On a loaded host a replica answers its probes late without being stopped: the probe
    timeout and the silence bound grow with its round trips (agent/node/silence.py:
    4 x p99 round trip, 3 probes), never below the configured floors."""
    agent = make_agent(unresponsive_after_s=5.0, probe_timeout_s=1.0)
    rid = first_boot(agent)["replica"]
    handle = agent.replicas[rid].handle
    real_stats = handle.stats
    timeouts = []

    def slow(timeout_s=None):            # answers, 1.5 s after each probe
        timeouts.append(timeout_s)
        agent.clock.advance(1.5)
        return real_stats()
    handle.stats = slow
    for _ in range(4):
        agent.tick()
    assert timeouts[0] == 1.0                        # nothing measured yet: the floor
    assert timeouts[-1] == 4 * 1.5                   # then 4 x its p99 round trip

    def silent(timeout_s=None):
        timeouts.append(timeout_s)
        raise TimeoutError("timed out")
    handle.stats = silent
    agent.tick()                                     # the silence starts
    agent.clock.advance(6.0)
    agent.tick()
    assert rid in routed(agent)                      # past the 5 s floor, within 3 x 6 s
    agent.clock.advance(12.5)
    agent.tick()
    assert rid not in routed(agent) and agent.replicas[rid].unrouted


def test_the_bounds_grow_with_the_replicas_measured_step_and_keep_their_floors():
    from agent.node.silence import probe_answered, probe_timeout_s, unresponsive_after_s
    from agent.node.state import AgentConfig, ReplicaRecord

    config = AgentConfig("n", probe_timeout_s=2.0, unresponsive_after_s=5.0)
    rec = ReplicaRecord.__new__(ReplicaRecord)
    rec.probe_rtts_s, rec.last_stats = None, {}
    assert probe_timeout_s(config, rec) == 2.0 and unresponsive_after_s(config, rec) == 5.0
    probe_answered(rec, 0.01)                        # fast answers: the floors hold
    assert probe_timeout_s(config, rec) == 2.0 and unresponsive_after_s(config, rec) == 5.0
    # a replica whose decode step at its full batch is 1.5 s (a long batch on a busy CPU)
    rec.last_stats = {"max_seqs": 8, "active_ctx_tokens": 0, "prefill_tokens_per_s": 100.0,
                      "prefill_overhead_s": 0.1, "decode_base_s": 1.15,
                      "decode_per_seq_s": 0.05, "decode_per_ctx_token_s": 0.0}
    assert abs(probe_timeout_s(config, rec) - 2 * 1.5) < 1e-9
    assert abs(unresponsive_after_s(config, rec) - 3 * 2 * 1.5) < 1e-9


def test_one_slow_answer_or_a_replicas_own_stats_cannot_lift_the_bounds_past_their_ceiling():
    from agent.node.silence import (CEILING, probe_answered, probe_timeout_s,
                                    unresponsive_after_s)
    from agent.node.state import AgentConfig, ReplicaRecord

    config = AgentConfig("n", probe_timeout_s=2.0, unresponsive_after_s=5.0)
    rec = ReplicaRecord.__new__(ReplicaRecord)
    rec.probe_rtts_s, rec.last_stats = None, {}
    probe_answered(rec, 30.0)                        # one answer after a 30 s swap storm
    assert probe_timeout_s(config, rec) == CEILING * 2.0
    assert unresponsive_after_s(config, rec) == CEILING * 5.0
    rec.probe_rtts_s = None                          # stats that claim an endless step
    for huge in ({"active_ctx_tokens": 10**12, "decode_per_ctx_token_s": 1e-6},
                 {"active_ctx_tokens": 0, "decode_per_ctx_token_s": 0.0, "decode_base_s": 1e300}):
        rec.last_stats = {"max_seqs": 8, "prefill_tokens_per_s": 100.0,
                          "prefill_overhead_s": 0.1, "decode_base_s": 0.02,
                          "decode_per_seq_s": 0.002, **huge}
        assert probe_timeout_s(config, rec) <= CEILING * 2.0
        assert unresponsive_after_s(config, rec) <= CEILING * 5.0
