"""Client library: sync and async generate, typed errors, 429 retry, Consul discovery."""

import asyncio
import pathlib
import sys
import threading
import time

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent / "frontdoor"))
from stub_replica import StubReplica  # noqa: E402

from agent.client import AsyncClient, Client, _backoff_s, discover, error_from  # noqa: E402
from agent.cluster.local import LocalRegistry  # noqa: E402
from agent.errors import (ClusterError, DeadlineExceeded, MessageTooLarge,  # noqa: E402
                          ModelNotFound, NoCapacity, Overloaded, ProtocolError, Unauthorized)
from agent.frontdoor.announce import ConsulTcpAnnouncer  # noqa: E402
from agent.frontdoor.server import FrontDoor, FrontDoorConfig  # noqa: E402
from agent.protocol import pack  # noqa: E402
from tests.standins import consul_clock, consul_standin  # noqa: E402,F401


class Served:
    """A front door with one stub replica on its own event loop thread."""

    def __init__(self, **cfg):
        self.loop = asyncio.new_event_loop()
        self.cfg = cfg
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.call(self._start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _start(self):
        self.registry = LocalRegistry()
        self.stub = await StubReplica("m", "r0", **self.cfg.pop("stub", {})).start()
        self.registry.register(self.stub.instance(), 60)
        announcer = self.cfg.pop("announcer", None)
        self.fd = FrontDoor(FrontDoorConfig(models={"m": 5000.0}, **self.cfg),
                            registry=self.registry, announcer=announcer)
        self.host, self.port = await self.fd.start()

    def stop(self):
        self.call(self.fd.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def served():
    s = Served()
    yield s
    s.stop()


def test_sync_client_streams_and_generates(served):
    c = Client(served.host, served.port)
    msgs = list(c.stream("m", "hello", max_tokens=3))
    assert [m["type"] for m in msgs] == ["tokens", "done"]
    assert msgs[0]["tokens"] == [0, 1, 2]
    g = c.generate("m", tokens=[9, 9], max_tokens=2, seed=1)
    assert g.tokens == [2, 3] and g.done["replica"] == "r0"
    assert c.info("health")["status"] == "ok"
    with pytest.raises(ModelNotFound):
        c.generate("other", tokens=[1], max_tokens=1)
    c.close()


def test_async_client_multiplexes_requests(served):
    async def main():
        c = await AsyncClient.connect(served.host, served.port)
        gens = await asyncio.gather(*(c.generate("m", tokens=[1] * n, max_tokens=2)
                                      for n in range(1, 20)))
        await c.close()
        return gens
    gens = asyncio.run(main())
    assert [g.tokens for g in gens] == [[n, n + 1] for n in range(1, 20)]


def test_a_429_is_retried_and_succeeds_when_room_appears():
    s = Served(stub={"max_seqs": 1, "hold": True}, max_queue_depth=1)
    try:
        holder = Client(s.host, s.port, timeout_s=10)
        holder._sock.sendall(pack({"op": "generate", "id": 1, "model": "m", "tokens": [1],
                                   "max_tokens": 1}))  # sent, never read: holds the slot
        queued = Client(s.host, s.port, max_retries=0, timeout_s=10)
        t = threading.Thread(target=lambda: queued.generate("m", tokens=[1], max_tokens=1,
                                                            deadline_ms=3000),
                             daemon=True)  # never holds the test run open
        t.start()
        time.sleep(0.2)  # the replica's slot is held and the queue holds one
        with pytest.raises(Overloaded):
            Client(s.host, s.port, max_retries=0, timeout_s=10).generate("m", tokens=[1],
                                                                         max_tokens=1)
        retrying = Client(s.host, s.port, max_retries=20, max_retry_wait_ms=100, timeout_s=10)
        def free():
            s.stub.hold = False
            s.stub.release()
        threading.Timer(0.3, lambda: s.loop.call_soon_threadsafe(free)).start()
        assert retrying.generate("m", tokens=[1], max_tokens=2).tokens == [1, 2]
        t.join(5)
        refused = s.fd.telemetry.request_counts.get(("refused", 429), 0)
        assert refused >= 2  # the plain client's 429 and at least one the retrying one rode out
    finally:
        s.stop()


def test_backoff_has_bounded_jitter():
    err = Overloaded("full", retry_after_ms=200)
    waits = [_backoff_s(err, 10_000) for _ in range(200)]
    assert all(0.2 <= w <= 0.25 for w in waits) and len(set(waits)) > 1
    assert _backoff_s(Overloaded("full", retry_after_ms=9000), 1000) == 1.0


@pytest.mark.parametrize("code,cls", [(400, ProtocolError), (401, Unauthorized),
                                      (404, ModelNotFound), (413, MessageTooLarge),
                                      (429, Overloaded), (503, NoCapacity),
                                      (504, DeadlineExceeded)])
def test_each_code_maps_to_its_typed_error(code, cls):
    err = error_from({"type": "error", "code": code, "reason": "why", "retry_after_ms": 5})
    assert type(err) is cls and err.code == code and "why" in str(err)


def test_discovery_through_consul_standin(consul_standin):  # noqa: F811 (the fixture imported above)
    import consul
    client = consul.Consul(host=consul_standin.host, port=consul_standin.port)
    s = Served(announcer=ConsulTcpAnnouncer(client))
    try:
        import time

        # A TCP check starts critical (Consul's default) until the stand-in's first probe.
        deadline = time.monotonic() + 10
        while not (found := discover(consul_host=consul_standin.host,
                                     consul_port=consul_standin.port)):
            assert time.monotonic() < deadline, "never passing"
            time.sleep(0.05)
        assert found == [(s.host, s.port)]
        assert Client(*found[0]).info("health")["status"] == "ok"
        body = [r for r in consul_standin.requests if r[1] == "/v1/agent/service/register"]
        assert body, "the front door registered itself"
    finally:
        s.stop()
    assert discover(consul_host=consul_standin.host, consul_port=consul_standin.port) == []


def test_discovery_failure_is_a_cluster_error():
    with pytest.raises(ClusterError):
        discover(consul_host="127.0.0.1", consul_port=1)
