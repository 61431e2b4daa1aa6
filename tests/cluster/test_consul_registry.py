"""ConsulRegistry and the snapshot KV summary (py-consul) against the Consul stand-in."""

import threading

import pytest

from agent.cluster.base import ServiceInstance
from agent.cluster.consul_kv import SnapshotKV, snapshot_durable
from agent.cluster.consul_registry import ConsulRegistry, consul_client
from agent.errors import AclDenied, ClusterError, ConfigError


def client(standin, token=None):
    return consul_client(f"{standin.host}:{standin.port}", token=token)


def inst(i, model="m"):
    return ServiceInstance("rewarm-replica", f"r{i}", "10.0.0.1", 9000 + i,
                           tags=[f"model={model}"], meta={"kv_used_tokens": "0"})


def test_register_heartbeat_expire_deregister(consul_standin, consul_clock):
    reg = ConsulRegistry(client(consul_standin))
    reg.register(inst(1), ttl_s=5)
    reg.register(inst(2, "other"), ttl_s=5)
    assert [i.id for i in reg.healthy("rewarm-replica")] == ["r1", "r2"]
    assert [i.id for i in reg.healthy("rewarm-replica", tag="model=m")] == ["r1"]
    consul_clock.advance(4)
    reg.pass_ttl("r1", {"kv_used_tokens": "512"})
    consul_clock.advance(2)                   # r2 missed its TTL
    healthy = reg.healthy("rewarm-replica")
    assert [i.id for i in healthy] == ["r1"] and healthy[0].meta["kv_used_tokens"] == "512"
    assert healthy[0].port == 9001 and healthy[0].tag("model") == "m"
    reg.deregister("r1")
    reg.deregister("r1")                      # idempotent
    assert reg.healthy("rewarm-replica") == []
    with pytest.raises(KeyError):
        reg.pass_ttl("nope")


def test_blocking_query_returns_on_change(consul_standin):
    reg = ConsulRegistry(client(consul_standin))
    index, _ = reg.watch("rewarm-replica")
    timer = threading.Timer(0.2, lambda: ConsulRegistry(client(consul_standin))
                            .register(inst(3), ttl_s=5))
    timer.start()
    new_index, found = index, []
    for _ in range(3):                        # register, then its first pass: two changes
        new_index, found = reg.watch("rewarm-replica", index=new_index, wait_s=5)
        if found:
            break
    timer.join()
    assert new_index > index and [i.id for i in found] == ["r3"]


def test_blocking_query_times_out_unchanged(consul_standin):
    reg = ConsulRegistry(client(consul_standin))
    index, _ = reg.watch("rewarm-replica")
    again, found = reg.watch("rewarm-replica", index=index, wait_s=1)
    assert again == index and found == []


def test_errors_are_typed(consul_standin):
    consul_standin.acl_token = "secret"
    with pytest.raises(AclDenied):
        ConsulRegistry(client(consul_standin, token="bad")).register(inst(1), ttl_s=5)
    consul_standin.acl_token = None
    consul_standin.down = True
    with pytest.raises(ClusterError):
        ConsulRegistry(client(consul_standin)).healthy("rewarm-replica")


def test_snapshot_status_only_moves_forward(consul_standin):
    kv = SnapshotKV(client(consul_standin))
    assert kv.get("m") is None and kv.durable("m") is False
    assert kv.publish("m", "s1", "pending", durable=False)
    assert kv.durable("m") is False
    assert kv.publish("m", "s1", "ready", durable=False)
    assert kv.durable("m") is False           # ready but only on one node
    assert kv.publish("m", "s1", "ready", durable=True)
    assert kv.durable("m") is True
    assert kv.publish("m", "s1", "pending", durable=False) is False   # backwards: refused
    assert kv.publish("m", "s1", "ready", durable=False) is False     # durability kept
    assert kv.get("m")["status"] == "ready"
    assert kv.publish("m", "s1", "stale", durable=True)
    assert kv.publish("m", "s1", "ready", durable=True) is False      # stale is final
    assert kv.publish("m", "s2", "pending", durable=False)            # a newer snapshot
    with pytest.raises(ConfigError):
        kv.publish("m", "s2", "bogus", durable=False)
    with pytest.raises(ConfigError):
        kv.get("a/b")


def test_cas_race_is_retried(consul_standin):
    kv = SnapshotKV(client(consul_standin))
    kv.publish("m", "s1", "pending", durable=False)
    real_put = kv._c.kv.put
    raced = {"n": 0}

    def racing_put(key, value, **kw):
        if raced["n"] == 0:                   # another agent writes between read and write
            raced["n"] += 1
            real_put(key, value.replace("ready", "pending"))
        return real_put(key, value, **kw)

    kv._c.kv.put = racing_put
    assert kv.publish("m", "s1", "ready", durable=True)
    assert kv.durable("m") and raced["n"] == 1


class FakeCatalog:
    def __init__(self, ready):
        self.ready = ready

    def durable_ready(self, model_name):
        return self.ready


def test_snapshot_durable_needs_catalog_and_consul(consul_standin):
    kv = SnapshotKV(client(consul_standin))
    kv.publish("m", "s1", "ready", durable=True)
    assert snapshot_durable(FakeCatalog(True), kv)("m") is True
    assert snapshot_durable(FakeCatalog(False), kv)("m") is False
    assert snapshot_durable(FakeCatalog(True), kv)("other") is False
    consul_standin.down = True
    assert snapshot_durable(FakeCatalog(True), kv)("m") is False       # no Consul: no
    assert snapshot_durable(None, None)("m") is False


def test_a_refused_connection_is_said_in_one_short_line():
    from agent.cluster.consul_registry import ConsulRegistry, consul_client
    from agent.errors import ClusterError

    with pytest.raises(ClusterError) as err:
        ConsulRegistry(consul_client("127.0.0.1:1")).healthy("rewarm-replica")
    text = str(err.value)
    assert "cannot connect to 127.0.0.1:1: [Errno 111] Connection refused" in text
    assert len(text) < 200 and "HTTPConnectionPool" not in text
