"""The HTTP port in Consul: rewarm-frontdoor-http with an HTTP check on /ready."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from http_harness import http_door, run  # noqa: E402

from agent.errors import ClusterError  # noqa: E402
from agent.frontdoor.announce import FRONTDOOR_HTTP_SERVICE, ConsulHttpAnnouncer  # noqa: E402
from agent.frontdoor.http_entrance import HttpConfig, start_http, stop_http  # noqa: E402


class FakeConsul:
    """py-consul's ``agent.service`` as far as the announcer calls it."""

    def __init__(self, fail=False):
        self.registered, self.deregistered, self.fail = [], [], fail
        self.agent = self
        self.service = self

    def register(self, name, **kw):
        if self.fail:
            raise ConnectionError("consul is down")
        self.registered.append((name, kw))

    def deregister(self, service_id):
        self.deregistered.append(service_id)


def test_start_http_registers_the_port_with_an_http_ready_check():
    consul = FakeConsul()

    async def main():
        async with http_door() as (fd, e, _):
            http = await start_http(fd, HttpConfig(port=0), announcer=ConsulHttpAnnouncer(
                consul, interval_s=2.0, deregister_after_s=30.0))
            url = http.url
            await stop_http(fd, http, grace_s=0.1)
            return url, http.instance_id, fd.instance_id

    url, instance_id, fd_id = run(main())
    (name, kw), = consul.registered
    assert name == FRONTDOOR_HTTP_SERVICE and kw["service_id"] == instance_id == f"{fd_id}-http"
    assert f"http://{kw['address']}:{kw['port']}" == url and kw["tags"] == ["protocol=http"]
    assert kw["check"]["http"] == url + "/ready" and kw["check"]["interval"] == "2s"
    assert kw["check"]["DeregisterCriticalServiceAfter"] == "30s"
    assert consul.deregistered == [instance_id]


def test_a_refused_registration_is_a_cluster_error():
    from agent.cluster.base import ServiceInstance

    with pytest.raises(ClusterError, match="consul is down"):
        ConsulHttpAnnouncer(FakeConsul(fail=True)).announce(
            ServiceInstance(FRONTDOOR_HTTP_SERVICE, "x", "127.0.0.1", 8000))
