"""Service discovery through Consul (py-consul): a :class:`agent.cluster.base.Registry`.

Each instance is an agent service with one TTL check (check id ``service:<id>``, Consul's
naming for a service's single check). ``healthy`` reads ``/v1/health/service/:name?passing``;
``watch`` is the same read as a blocking query (``index``/``wait``, ``X-Consul-Index``).
Errors from Consul become :class:`~agent.errors.ClusterError` (403:
:class:`~agent.errors.AclDenied`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace

import consul
import consul.exceptions

from agent.cluster.base import ServiceInstance
from agent.errors import AclDenied, ClusterError


def consul_client(address: str | None = None, token: str | None = None) -> consul.Consul:
    """A py-consul client for ``address`` (``host:port``; default ``CONSUL_HTTP_ADDR`` or
    127.0.0.1:8500) with ``token`` (default ``CONSUL_HTTP_TOKEN``)."""
    address = address or os.environ.get("CONSUL_HTTP_ADDR", "127.0.0.1:8500")
    scheme = "http"
    if "://" in address:
        scheme, address = address.split("://", 1)
    host, _, port = address.rpartition(":")
    return consul.Consul(host=host or address, port=int(port or 8500), scheme=scheme,
                         token=token or os.environ.get("CONSUL_HTTP_TOKEN"))


def cluster_error(exc: Exception, endpoint: str) -> ClusterError:
    """Translate a py-consul or transport exception into rewarm's typed error."""
    if isinstance(exc, consul.exceptions.ACLPermissionDenied):
        return AclDenied(f"consul: ACL token denied for {endpoint}: {exc}", service="consul",
                         endpoint=endpoint, status=403)
    return ClusterError(f"consul: {endpoint} failed: {_reason(exc)}", service="consul",
                        endpoint=endpoint, status=None)


def _reason(exc: Exception) -> str:
    """The short reason of a transport failure: urllib3's "Max retries exceeded ... (Caused
    by NewConnectionError(...: [Errno 111] Connection refused))" becomes "cannot connect to
    HOST:PORT: [Errno 111] Connection refused"."""
    text = str(exc)
    pool = re.search(r"host='([^']*)', port=(\d+)", text)
    cause = re.search(r"(\[Errno -?\d+\][^)'\"]*)", text)
    if pool and cause:
        return f"cannot connect to {pool[1]}:{pool[2]}: {cause[1].strip()}"
    return text if len(text) <= 300 else text[:297] + "..."


def _ttl(ttl_s: float) -> str:
    return f"{max(1, math.ceil(ttl_s))}s"


class ConsulRegistry:
    """Registry over a py-consul client. Thread-compatible (one call at a time per client)."""

    def __init__(self, client: consul.Consul) -> None:
        self._c = client
        self._mine: dict[str, tuple[ServiceInstance, float]] = {}

    def _register(self, inst: ServiceInstance, ttl_s: float) -> None:
        self._c.agent.service.register(
            inst.name, service_id=inst.id, address=inst.address, port=inst.port,
            tags=list(inst.tags), meta=dict(inst.meta),
            check=consul.Check.ttl(_ttl(ttl_s)))

    def register(self, instance: ServiceInstance, ttl_s: float) -> None:
        """Register ``instance`` with a TTL check and mark it passing at once."""
        try:
            self._register(instance, ttl_s)
            self._c.agent.check.ttl_pass(f"service:{instance.id}")
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise cluster_error(exc, "/v1/agent/service/register") from exc
        self._mine[instance.id] = (replace(instance, meta=dict(instance.meta)), ttl_s)

    def pass_ttl(self, instance_id: str, meta: dict[str, str] | None = None) -> None:
        """Heartbeat; a meta change re-registers the service (Consul has no meta-only update)."""
        try:
            if meta and instance_id in self._mine:
                inst, ttl_s = self._mine[instance_id]
                if any(inst.meta.get(k) != v for k, v in meta.items()):
                    inst.meta.update(meta)
                    self._register(inst, ttl_s)
            passed = self._c.agent.check.ttl_pass(f"service:{instance_id}")
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise cluster_error(exc, f"/v1/agent/check/pass/service:{instance_id}") from exc
        if not passed:   # Consul answers 404 for an unknown check; py-consul returns False
            raise KeyError(f"pass_ttl: service instance {instance_id!r} is not registered")

    def deregister(self, instance_id: str) -> None:
        self._mine.pop(instance_id, None)
        try:
            self._c.agent.service.deregister(instance_id)
        except consul.exceptions.NotFound:
            pass
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise cluster_error(exc, f"/v1/agent/service/deregister/{instance_id}") from exc

    def healthy(self, name: str, tag: str | None = None) -> list[ServiceInstance]:
        return self.watch(name, tag=tag)[1]

    def watch(self, name: str, tag: str | None = None, index: int | None = None,
              wait_s: float | None = None) -> tuple[int, list[ServiceInstance]]:
        """Passing instances of ``name``; with ``index`` a blocking query that returns when
        Consul's index passes it or after ``wait_s``. Returns ``(X-Consul-Index, instances)``."""
        try:
            new_index, entries = self._c.health.service(
                name, passing=True, tag=tag, index=index,
                wait=None if wait_s is None else f"{max(1, math.ceil(wait_s))}s")
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise cluster_error(exc, f"/v1/health/service/{name}") from exc
        out = []
        for e in entries or []:
            s = e["Service"]
            out.append(ServiceInstance(name=s["Service"], id=s["ID"], address=s["Address"],
                                       port=int(s["Port"]), tags=list(s.get("Tags") or []),
                                       meta=dict(s.get("Meta") or {})))
        return int(new_index), out
