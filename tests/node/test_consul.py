"""The agent registered through py-consul (ConsulRegistry) against the Consul HTTP stand-in,
with the per-model snapshot summary in Consul KV."""

from __future__ import annotations

from agent.cluster.consul_kv import SnapshotKV
from agent.cluster.consul_registry import ConsulRegistry, consul_client


def test_agent_through_consul(make_agent, consul_standin, monkeypatch):
    monkeypatch.setenv("CONSUL_HTTP_ADDR", f"127.0.0.1:{consul_standin.port}")
    registry = ConsulRegistry(consul_client())
    kv = SnapshotKV(consul_client())
    agent = make_agent(remote=True, registry=registry, summary=kv)
    info = agent.restore("tiny")
    row = agent.captures[agent.models["tiny"].key].result(timeout=120)
    replicas = registry.healthy("rewarm-replica", "model=tiny")
    assert [r.id for r in replicas] == [info["replica"]]
    assert f"version={agent.models['tiny'].version}" in replicas[0].tags
    assert "kv_capacity_tokens" in replicas[0].meta
    assert [a.id for a in registry.healthy("rewarm-agent")] == ["rewarm-agent-n1"]
    summary = kv.get("tiny")
    assert (summary["snapshot_id"], summary["status"], summary["durable"], summary["node"]) == (
        row.snapshot_id, "ready", True, "n1")
    assert kv.durable("tiny")
    agent.drain(info["replica"])
    assert registry.healthy("rewarm-replica") == []


def test_acl_denied_is_a_clear_error_not_a_loop(make_agent, consul_standin, caplog):
    from agent.clock import ManualClock

    consul_standin.fail_next(403, "/v1/agent/service/register", times=1, body="Permission denied")
    clock = ManualClock(1000.0)
    registry = ConsulRegistry(consul_client(f"127.0.0.1:{consul_standin.port}"), clock=clock,
                              acl_backoff_s=30.0)
    agent = make_agent(registry=registry, clock=clock)
    n = len(consul_standin.requests)
    for _ in range(10):                       # ticks inside the back-off: no request, no log
        clock.advance(1.0)
        agent.tick()
    assert len(consul_standin.requests) == n
    assert sum("refused the token" in r.getMessage() for r in caplog.records) == 1
    st = agent.registrar.state
    assert not st.healthy and "ACL" in st.last_error
    assert st.next_try_s - 1000.0 == agent.registrar.max_backoff_s
    assert any("refused the token" in r.getMessage() for r in caplog.records)
    agent.clock.advance(agent.registrar.max_backoff_s - 10.0)
    agent.tick()
    assert agent.registrar.state.healthy
    assert [a.id for a in agent.registrar.registry.healthy("rewarm-agent")] == ["rewarm-agent-n1"]
