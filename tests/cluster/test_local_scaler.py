"""LocalScaler against fake node agents speaking the control API's ops."""

import pytest

from agent.cluster.local_scaler import LocalScaler
from agent.errors import ClusterError, ConfigError, RewarmError


class FakeAgent:
    def __init__(self, name, can_suspend=True):
        self.name, self.can_suspend = name, can_suspend
        self.replicas = {}
        self.calls = []
        self.n = 0
        self.down = False
        self.refuse_drain = False

    def __call__(self, op, **f):
        if self.down:
            raise ConnectionRefusedError(f"{self.name} down")
        self.calls.append((op, f))
        if op == "status":
            return {"replicas": [dict(r) for r in self.replicas.values()]}
        if op == "restore":
            self.n += 1
            rid = f"{self.name}-{self.n}"
            self.replicas[rid] = {"replica": rid, "model": f["model"], "state": "warm"}
            return self.replicas[rid]
        r = self.replicas[f["replica"]]
        if op == "resume":
            r["state"] = "warm"
        elif op == "suspend":
            if not self.can_suspend:
                err = RewarmError("not suspendable")
                err.code = 400
                raise err
            r["state"] = "suspended"
        elif op == "drain":
            if self.refuse_drain:
                err = RewarmError("last replica, snapshot not durable")
                err.code = 409
                raise err
            del self.replicas[f["replica"]]
        return r


def test_restores_spread_over_nodes_then_drains_newest():
    a, b = FakeAgent("a"), FakeAgent("b")
    s = LocalScaler({"a": a, "b": b})
    s.set_target("m", 3, reason="up")
    assert s.target("m") == 3
    assert sorted(len(x.replicas) for x in (a, b)) == [1, 2]
    s.set_target("m", 1, reason="low; release=stop")
    assert s.target("m") == 1
    assert [op for op, _ in a.calls + b.calls].count("drain") == 2


def test_release_suspend_parks_and_scale_up_resumes_first():
    a = FakeAgent("a")
    s = LocalScaler({"a": a})
    s.set_target("m", 2, reason="up")
    s.set_target("m", 1, reason="low; release=suspend")
    assert sorted(r["state"] for r in a.replicas.values()) == ["suspended", "warm"]
    restores = [op for op, _ in a.calls].count("restore")
    s.set_target("m", 2, reason="up")
    assert [op for op, _ in a.calls].count("restore") == restores     # resumed, not restored
    assert all(r["state"] == "warm" for r in a.replicas.values())


def test_suspend_unsupported_falls_back_to_drain():
    a = FakeAgent("a", can_suspend=False)
    s = LocalScaler({"a": a})
    s.set_target("m", 2, reason="up")
    s.set_target("m", 1, reason="low; release=suspend")
    assert len(a.replicas) == 1


def test_refusals_and_outages_are_retryable_cluster_errors():
    a = FakeAgent("a")
    s = LocalScaler({"a": a})
    s.set_target("m", 1, reason="up")
    a.refuse_drain = True
    with pytest.raises(ClusterError) as err:
        s.set_target("m", 0, reason="idle")
    assert err.value.status == 409 and err.value.retryable
    a.down = True
    with pytest.raises(ClusterError):
        s.set_target("m", 2, reason="up")
    assert s.target("m") == 1                 # last known while the agent is down


def test_bad_configuration():
    with pytest.raises(ConfigError):
        LocalScaler({})
    with pytest.raises(ConfigError):
        LocalScaler({"a": FakeAgent("a")}).set_target("m", -1, reason="x")


def test_parked_replicas_stop_after_the_suspended_stage():
    from agent.clock import ManualClock

    clock = ManualClock()
    a = FakeAgent("a")
    s = LocalScaler({"a": a}, clock=clock)
    s.set_target("m", 2, reason="up")
    s.set_target("m", 1, reason="low; release=suspend")
    assert s.expire_parked("m", 30.0) == []
    clock.advance(29.9)
    assert s.expire_parked("m", 30.0) == []
    clock.advance(0.1)
    assert s.expire_parked("m", 30.0) == ["a-2"]
    assert list(a.replicas) == ["a-1"]


def test_a_replica_still_cold_booting_counts_and_is_not_drained():
    a = FakeAgent("a")
    a.replicas["a-boot"] = {"replica": "a-boot", "model": "m", "state": "cold"}
    s = LocalScaler({"a": a})
    assert s.target("m") == 1
    s.set_target("m", 1, reason="up")
    assert [op for op, _ in a.calls].count("restore") == 0      # not a second cold boot
    s.set_target("m", 2, reason="up")
    assert [op for op, _ in a.calls].count("restore") == 1
    s.set_target("m", 0, reason="idle; release=stop")
    # Only the warm one can go now; the booting one is released at a later call once warm.
    assert list(a.replicas) == ["a-boot"]
    a.replicas["a-boot"]["state"] = "warm"
    s.set_target("m", 0, reason="idle; release=stop")
    assert a.replicas == {}


def test_a_node_at_its_cap_is_not_counted_twice():
    a, b = FakeAgent("a"), FakeAgent("b")
    original = a.__call__

    def capped(op, **f):
        if op == "restore" and a.replicas:            # a holds at most one replica
            a.calls.append((op, f))
            return {**next(iter(a.replicas.values())), "path": "warm"}
        return original(op, **f)
    s = LocalScaler({"a": capped, "b": b})
    s.set_target("m", 3, reason="up")
    assert (len(a.replicas), len(b.replicas)) == (1, 2)
    assert s.target("m") == 3
