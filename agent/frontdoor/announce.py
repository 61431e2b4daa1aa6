"""How a front door makes itself findable as ``rewarm-frontdoor`` (several run side by side).

:class:`RegistryAnnouncer` works with any :class:`~agent.cluster.base.Registry` (a TTL entry
kept passing by :meth:`heartbeat`); :class:`ConsulTcpAnnouncer` registers with Consul through
py-consul with a TCP check on the listening port, so Consul itself notices a dead front door.
"""

from __future__ import annotations

from typing import Protocol

from agent.cluster.base import Registry, ServiceInstance
from agent.errors import ClusterError

FRONTDOOR_SERVICE = "rewarm-frontdoor"


class Announcer(Protocol):
    def announce(self, instance: ServiceInstance) -> None: ...
    def heartbeat(self, instance_id: str) -> None: ...
    def withdraw(self, instance_id: str) -> None: ...


class RegistryAnnouncer:
    """TTL registration in any Registry; call :meth:`heartbeat` more often than ``ttl_s``."""

    def __init__(self, registry: Registry, ttl_s: float = 5.0) -> None:
        self.registry, self.ttl_s = registry, ttl_s

    def announce(self, instance: ServiceInstance) -> None:
        self.registry.register(instance, self.ttl_s)

    def heartbeat(self, instance_id: str) -> None:
        self.registry.pass_ttl(instance_id)

    def withdraw(self, instance_id: str) -> None:
        self.registry.deregister(instance_id)


class ConsulTcpAnnouncer:
    """Consul agent service with a TCP check every ``interval_s`` (deregistered by Consul
    after ``deregister_after_s`` critical).  ``client``: a ``consul.Consul``.  Raises
    :class:`ClusterError` when Consul refuses or cannot be reached."""

    def __init__(self, client, interval_s: float = 5.0, deregister_after_s: float = 60.0) -> None:
        self.client, self.interval_s, self.deregister_after_s = client, interval_s, deregister_after_s

    def check(self, instance: ServiceInstance):
        """The Consul check for ``instance``: TCP on its port."""
        import consul  # py-consul
        return consul.Check.tcp(instance.address, instance.port, f"{self.interval_s:g}s",
                                deregister=f"{self.deregister_after_s:g}s")

    def announce(self, instance: ServiceInstance) -> None:
        check = self.check(instance)
        try:
            self.client.agent.service.register(
                instance.name, service_id=instance.id, address=instance.address,
                port=instance.port, tags=list(instance.tags), meta=dict(instance.meta),
                check=check)
        except Exception as exc:  # py-consul / requests errors
            raise ClusterError(f"consul: registering {instance.id} failed: {exc}",
                               service="consul", status=None) from exc

    def heartbeat(self, instance_id: str) -> None:
        """Nothing to do: Consul probes the port."""

    def withdraw(self, instance_id: str) -> None:
        try:
            self.client.agent.service.deregister(instance_id)
        except Exception as exc:
            raise ClusterError(f"consul: deregistering {instance_id} failed: {exc}",
                               service="consul", status=None) from exc


FRONTDOOR_HTTP_SERVICE = "rewarm-frontdoor-http"


class ConsulHttpAnnouncer(ConsulTcpAnnouncer):
    """The HTTP entrance's port in Consul as ``rewarm-frontdoor-http``, with an HTTP check on
    ``/ready`` (Consul's HTTP check: passing on 2xx, warning on 429, critical otherwise; see
    developer.hashicorp.com/consul/docs/services/usage/checks), so a door that is shutting
    down or can neither serve nor restore leaves the catalog's passing list."""

    def check(self, instance: ServiceInstance):
        """The Consul check for ``instance``: HTTP GET of its ``/ready``."""
        import consul  # py-consul
        return consul.Check.http(f"http://{instance.address}:{instance.port}/ready",
                                 f"{self.interval_s:g}s",
                                 deregister=f"{self.deregister_after_s:g}s")
