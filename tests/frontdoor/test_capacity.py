import pytest

from agent.errors import ConfigError
from agent.frontdoor.capacity import RestoreGate


def test_restores_are_capped_per_model_and_overall():
    gate = RestoreGate(per_model=2, overall=3, requests_per_restore=4)
    assert gate.wanted("a", 0) == 0
    assert gate.wanted("a", 1) == 1
    assert gate.wanted("a", 100) == 2          # per-model cap
    gate.started("a"), gate.started("a")
    assert gate.wanted("a", 100) == 0
    assert gate.wanted("b", 100) == 1          # overall cap leaves one
    gate.started("b")
    assert gate.wanted("c", 5) == 0 and gate.total == 3
    gate.finished("a")
    assert gate.in_flight == {"a": 1, "b": 1} and gate.wanted("c", 5) == 1


def test_queued_requests_share_a_restore():
    gate = RestoreGate(per_model=8, overall=8, requests_per_restore=4)
    assert gate.wanted("a", 4) == 1 and gate.wanted("a", 5) == 2
    gate.started("a")
    assert gate.wanted("a", 4) == 0


def test_gate_refuses_zero_caps():
    with pytest.raises(ConfigError):
        RestoreGate(per_model=0)


import asyncio  # noqa: E402

from agent.cluster.base import ServiceInstance  # noqa: E402
from agent.cluster.local import LocalRegistry  # noqa: E402
from agent.errors import NoCapacity  # noqa: E402
from agent.frontdoor.capacity import (NodeAgentCapacity, ScalerCapacity,  # noqa: E402
                                      nodes_from_registry)
from agent.protocol import Decoder, error_message, pack  # noqa: E402


async def fake_node(answer):
    """A node agent control API answering every ``restore`` with ``answer(msg)``."""
    async def serve(reader, writer):
        dec = Decoder()
        while data := await reader.read(4096):
            for msg in dec.feed(data):
                assert msg["op"] == "restore"
                writer.write(pack(answer(msg)))
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_node_agent_restore_moves_on_to_the_next_node_after_a_failure():
    async def main():
        bad, bad_port = await fake_node(lambda m: error_message(m["id"], 503, "no zygote"))
        good, good_port = await fake_node(lambda m: {
            "id": m["id"], "type": "result",
            "result": {"replica": "node2-r1", "path": "staged_restore", "restore_ms": 812.0}})
        cap = NodeAgentCapacity(lambda model: [("127.0.0.1", 1), ("127.0.0.1", bad_port),
                                               ("127.0.0.1", good_port)], timeout_s=5)
        result = await cap.request_restore("m")
        assert (result.replica, result.path, result.restore_ms) == (None, "snapshot_restore", 812.0)
        plain, plain_port = await fake_node(lambda m: {
            "id": m["id"], "type": "result", "result": {"replica": "n3-r1", "path": "cold_boot"}})
        result = await NodeAgentCapacity(lambda model: [("127.0.0.1", plain_port)]).request_restore("m")
        assert result.path == "cold_boot" and result.restore_ms > 0
        plain.close()
        cap_bad = NodeAgentCapacity(lambda model: [("127.0.0.1", bad_port)], timeout_s=5)
        with pytest.raises(NoCapacity, match="no zygote"):
            await cap_bad.request_restore("m")
        bad.close(), good.close()
    asyncio.run(main())


def test_nodes_caching_the_snapshot_come_first():
    reg = LocalRegistry()
    for nid, snaps in (("a", ""), ("b", "m@1,x@2"), ("c", "x@1")):
        reg.register(ServiceInstance("rewarm-agent", nid, "10.0.0." + str(ord(nid) - 96),
                                     7000, meta={"snapshots": snaps}), 60)
    assert nodes_from_registry(reg)("m") == [("10.0.0.2", 7000), ("10.0.0.1", 7000),
                                             ("10.0.0.3", 7000)]


class FakeScaler:
    def __init__(self):
        self.targets = {}

    def set_target(self, model, count, *, reason):
        self.targets[model] = count

    def target(self, model):
        return self.targets.get(model, 0)


def test_scaler_capacity_raises_the_target_and_waits_for_a_new_replica():
    async def main():
        warm = {"m": 1}
        scaler = FakeScaler()
        cap = ScalerCapacity(scaler, lambda m: warm[m], timeout_s=2, poll_s=0.01)
        asyncio.get_running_loop().call_later(0.05, warm.__setitem__, "m", 2)
        result = await cap.request_restore("m")
        assert scaler.targets == {"m": 2} and result.replica is None
        slow = ScalerCapacity(scaler, lambda m: 0, timeout_s=0.05, poll_s=0.01)
        with pytest.raises(NoCapacity, match="timeout_s"):
            await slow.request_restore("m")
    asyncio.run(main())


def test_restore_p99_is_the_nearest_rank_over_a_window():
    from agent.frontdoor.capacity import RestoreTimes
    times = RestoreTimes(window=100)
    assert times.p99_ms("m") is None
    for ms in range(1, 101):          # 1..100 ms
        times.record("m", ms)
    assert times.p99_ms("m") == 99.0
    times.record("m", 5000.0)         # window slides: 2..100 and 5000
    assert times.p99_ms("m") == 100.0
    times.record("other", 7.0)
    assert times.p99_ms("other") == 7.0


def test_a_node_answer_with_address_and_load_is_routable_at_once():
    from agent.frontdoor.capacity import _result

    r = _result({"replica": "up-r1", "model": "m", "address": "unix:/run/r1.sock",
                 "path": "cold_boot", "load": {"max_seqs": 4, "active_seqs": 1,
                                               "kv_capacity_tokens": 2048, "kv_used_tokens": 7}})
    assert r.path == "cold_boot"
    assert (r.replica.replica_id, r.replica.model, r.replica.address) == ("up-r1", "m",
                                                                           "/run/r1.sock")
    assert (r.replica.max_seqs, r.replica.active_seqs, r.replica.headroom_tokens) == (4, 1, 2041)
    reused = _result({"replica": "up-r1", "model": "m", "address": "127.0.0.1:9",
                      "path": "warm", "load": {"max_seqs": 4, "active_seqs": 4,
                                               "kv_capacity_tokens": 2048, "kv_used_tokens": 0}})
    assert reused.path == "warm_hit" and reused.replica.address == "127.0.0.1:9"
    assert _result({"replica": "up-r2", "path": "restore"}).replica is None   # via registry
    with pytest.raises(ValueError, match="'active_seqs'=None"):
        _result({"replica": "x", "model": "m", "address": "a:1", "load": {"max_seqs": 1}})


def test_node_agent_restores_carry_the_control_token():
    seen = []

    async def main():
        server, port = await fake_node(lambda m: seen.append(m.get("token")) or {
            "id": m["id"], "type": "result", "result": {"replica": "n-r1", "path": "restore"}})
        await NodeAgentCapacity(lambda model: [("127.0.0.1", port)], token="t0k").request_restore("m")
        await NodeAgentCapacity(lambda model: [("127.0.0.1", port)], token="").request_restore("m")
        server.close()
    asyncio.run(main())
    assert seen == ["t0k", None]
