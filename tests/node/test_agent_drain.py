"""The node agent's drain (agent/node/drain.py): out of routing first, then the wait for
in-flight requests up to its bound, then the stop; and the drain of everything at close.
The replica's handle is wrapped so that its in-flight count follows the agent's clock."""

from __future__ import annotations

import pytest

from agent.node.drain import Drainer, ScaleInBlocked


class Busy:
    """A running replica's handle whose ``in_flight()`` is ``count`` until the clock reaches
    ``until_s`` (None: never), then 0; it records what the drain saw on each poll."""

    def __init__(self, handle, clock, registry, count: int, until_s: float | None,
                 fail_shutdown: bool = False) -> None:
        self.handle, self.clock, self.registry = handle, clock, registry
        self.count, self.until_s, self.fail_shutdown = count, until_s, fail_shutdown
        self.routed_while_waiting: list[bool] = []
        self.shutdowns = 0
        self.address = handle.address

    def in_flight(self) -> int:
        ids = {i.id for i in self.registry.healthy("rewarm-replica")}
        self.routed_while_waiting.append(self.handle.replica_id in ids)
        if self.until_s is not None and self.clock.now() >= self.until_s:
            return 0
        return self.count

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.handle.shutdown()
        if self.fail_shutdown:
            raise OSError("the worker's socket is gone")


def _warm(make_agent, **cfg):
    agent = make_agent(**cfg)
    info = agent.restore("tiny")
    agent.captures[agent.models["tiny"].key].result(timeout=120)
    agent.tick()     # registered
    return agent, info["replica"]


def _busy(agent, rid, count, until_s, **kw):
    rec = agent.replicas[rid]
    rec.handle = Busy(rec.handle, agent.clock, agent.registrar.registry, count, until_s, **kw)
    return rec.handle


def test_a_drain_leaves_routing_first_and_stops_when_the_last_request_ends(make_agent):
    agent, rid = _warm(make_agent, drain_poll_s=0.05)
    assert rid in {i.id for i in agent.registrar.registry.healthy("rewarm-replica")}
    start = agent.clock.now()
    busy = _busy(agent, rid, 2, start + 0.5)
    done = agent.drain(rid)
    assert done["state"] == "dead" and done["in_flight_at_stop"] == 0
    assert busy.routed_while_waiting and not any(busy.routed_while_waiting)
    assert 0.5 <= agent.clock.now() - start < 0.5 + 2 * 0.05      # polled, not the bound
    assert busy.shutdowns == 1
    assert agent.catalog.replica(rid)["state"] == "dead"


def test_a_request_that_never_ends_is_cut_at_the_bound(make_agent):
    agent, rid = _warm(make_agent, drain_poll_s=0.1, drain_timeout_s=30.0)
    start = agent.clock.now()
    busy = _busy(agent, rid, 3, None)
    done = agent.drain(rid, timeout_s=1.0)          # the call's bound, not the config's
    assert done["in_flight_at_stop"] == 3 and done["state"] == "dead"
    assert 1.0 <= agent.clock.now() - start < 1.0 + 2 * 0.1
    assert busy.shutdowns == 1


def test_a_failed_shutdown_still_leaves_the_replica_dead(make_agent):
    agent, rid = _warm(make_agent)
    busy = _busy(agent, rid, 0, None, fail_shutdown=True)
    assert agent.drain(rid)["state"] == "dead"
    assert busy.shutdowns == 1 and agent.live_replicas("tiny") == []


def test_the_guard_refuses_before_anything_changes(make_agent):
    agent, rid = _warm(make_agent)
    drainer = Drainer(agent.state, durable=lambda model: False, sleep=agent.clock.advance)
    with pytest.raises(ScaleInBlocked, match="last of tiny") as err:
        drainer.drain(rid)
    assert (err.value.model, err.value.replica) == ("tiny", rid)
    assert agent.replicas[rid].lifecycle.state.value == "warm"
    assert rid in {i.id for i in agent.registrar.registry.healthy("rewarm-replica")}


def test_drain_all_stops_every_live_replica_past_the_guard(make_agent):
    # at close every replica goes, the last of a model without a durable snapshot included
    agent, first = _warm(make_agent, drain_poll_s=0.1, drain_timeout_s=2.0)
    second = agent.restore("tiny")["replica"]
    busy = [_busy(agent, rid, 1, None) for rid in (first, second)]
    Drainer(agent.state, durable=lambda model: False, sleep=agent.clock.advance).drain_all()
    assert agent.live_replicas_all() == []
    assert {agent.replicas[r].lifecycle.state.value for r in (first, second)} == {"dead"}
    assert [b.shutdowns for b in busy] == [1, 1]
