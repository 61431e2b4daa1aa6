"""The front door's cached replica view follows Consul (blocking queries on the stand-in)
and any other Registry (polling), off the request path."""

import asyncio
import pathlib
import sys

import consul

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from stub_replica import StubReplica  # noqa: E402

from agent.client import AsyncClient  # noqa: E402
from agent.cluster.consul_registry import ConsulRegistry  # noqa: E402
from agent.cluster.local import LocalRegistry  # noqa: E402
from agent.frontdoor.server import FrontDoor, FrontDoorConfig  # noqa: E402
from tests.standins import consul_clock, consul_standin  # noqa: E402,F401


async def until(predicate, timeout_s=5.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.01)


def test_replicas_appear_and_leave_through_consul_blocking_queries(consul_standin):  # noqa: F811 (the fixture imported above)
    async def main():
        registry = ConsulRegistry(consul.Consul(host=consul_standin.host,
                                                port=consul_standin.port))
        fd = FrontDoor(FrontDoorConfig(registry_wait_s=2.0, registry_poll_s=0.05),
                       registry=registry)
        host, port = await fd.start()
        assert fd.router.warm("m") == []
        stub = await StubReplica("m", "c1").start()
        await asyncio.to_thread(registry.register, stub.instance(kv_used_tokens=7), 30)
        await until(lambda: fd.router.warm("m"))
        assert fd.router.get("c1").kv_used_tokens == 7
        watches = [q for m, p, q in consul_standin.requests
                   if p == "/v1/health/service/rewarm-replica" and "index" in q]
        assert watches, "the front door used blocking queries"
        c = await AsyncClient.connect(host, port)
        assert (await c.generate("m", tokens=[1], max_tokens=1)).done["replica"] == "c1"
        await asyncio.to_thread(registry.deregister, "c1")
        await until(lambda: not fd.router.warm("m"))
        await c.close()
        await fd.stop()
    asyncio.run(main())


def test_polled_registry_and_an_outage_keep_the_cached_view():
    class Flaky(LocalRegistry):
        down = False

        def healthy(self, name, tag=None):
            if self.down:
                raise ConnectionError("registry down")
            return super().healthy(name, tag)

    async def main():
        registry = Flaky()
        stub = await StubReplica("m", "p1").start()
        registry.register(stub.instance(), 60)
        fd = FrontDoor(FrontDoorConfig(registry_poll_s=0.02), registry=registry)
        host, port = await fd.start()
        registry.down = True
        await asyncio.sleep(0.1)
        c = await AsyncClient.connect(host, port)
        assert (await c.generate("m", tokens=[1], max_tokens=1)).done["replica"] == "p1"
        registry.down = False
        registry.deregister("p1")
        await until(lambda: not fd.router.warm("m"))
        await c.close()
        await fd.stop()
    asyncio.run(main())
