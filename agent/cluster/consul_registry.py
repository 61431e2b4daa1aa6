"""Service discovery through Consul (py-consul): a :class:`agent.cluster.base.Registry`.

Each instance is an agent service with one TTL check (check id ``service:<id>``, Consul's
naming for a service's single check). ``healthy`` reads ``/v1/health/service/:name?passing``;
``watch`` is the same read as a blocking query (``index``/``wait``, ``X-Consul-Index``).
Errors from Consul become :class:`~agent.errors.ClusterError` (401/403:
:class:`~agent.errors.AclDenied`, then no request for the ACL back-off,
:class:`~agent.cluster.acl.AclGate`).  Service names and instance ids are checked
(:func:`agent.cluster.names.check_name`) before a URL is built.

Blocking-query rules (Consul "Blocking Queries", implementation details): an
``X-Consul-Index`` of 0 is treated as 1; an index lower than the one sent resets the watch
(the next read is a plain one, index 0); successive reads of one service are at least
``min_watch_interval_s`` apart.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import replace
from collections.abc import Callable

import consul
import consul.exceptions

from agent.clock import Clock, SystemClock
from agent.cluster.acl import AclGate
from agent.cluster.base import ServiceInstance
from agent.cluster.consul_http import cluster_error, consul_client, next_index  # noqa: F401
from agent.cluster.names import check_name
from agent.errors import AclDenied

MIN_WATCH_INTERVAL_S = 0.5
"""Least time between two blocking reads of one service: at most 2 requests/s however the
server answers (Consul "Blocking Queries": an index of 0, or one that does not move, must
not become a busy loop)."""


def _ttl(ttl_s: float) -> str:
    return f"{max(1, math.ceil(ttl_s))}s"


class ConsulRegistry:
    """Registry over a py-consul client. Thread-compatible (one call at a time per client)."""

    def __init__(self, client: consul.Consul, *, clock: Clock | None = None,
                 sleep: Callable[[float], None] | None = None,
                 min_watch_interval_s: float = MIN_WATCH_INTERVAL_S,
                 acl_backoff_s: float = 300.0) -> None:
        self._c = client
        self._clock = clock or SystemClock()
        self._sleep = sleep or time.sleep
        self.min_watch_interval_s = min_watch_interval_s
        self.acl = AclGate("consul", clock=self._clock, backoff_s=acl_backoff_s)
        self._mine: dict[str, tuple[ServiceInstance, float]] = {}
        self._last_read: dict[tuple[str, str | None], float] = {}
        self._read_lock = threading.Lock()

    def _failed(self, exc: Exception, endpoint: str):
        err = cluster_error(exc, endpoint)
        if isinstance(err, AclDenied):
            self.acl.denied(err)
        return err

    def _register(self, inst: ServiceInstance, ttl_s: float) -> None:
        self._c.agent.service.register(
            inst.name, service_id=inst.id, address=inst.address, port=inst.port,
            tags=list(inst.tags), meta=dict(inst.meta),
            check=consul.Check.ttl(_ttl(ttl_s)))

    def register(self, instance: ServiceInstance, ttl_s: float) -> None:
        """Register ``instance`` with a TTL check and mark it passing at once."""
        check_name("service name", instance.name)
        check_name("service id", instance.id)
        self.acl.check()
        try:
            self._register(instance, ttl_s)
            self._c.agent.check.ttl_pass(f"service:{instance.id}")
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise self._failed(exc, "/v1/agent/service/register") from exc
        self.acl.ok()
        self._mine[instance.id] = (replace(instance, meta=dict(instance.meta)), ttl_s)

    def pass_ttl(self, instance_id: str, meta: dict[str, str] | None = None) -> None:
        """Heartbeat; a meta change re-registers the service (Consul has no meta-only update)."""
        check_name("service id", instance_id)
        self.acl.check()
        try:
            if meta and instance_id in self._mine:
                inst, ttl_s = self._mine[instance_id]
                if any(inst.meta.get(k) != v for k, v in meta.items()):
                    inst.meta.update(meta)
                    self._register(inst, ttl_s)
            passed = self._c.agent.check.ttl_pass(f"service:{instance_id}")
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise self._failed(exc, f"/v1/agent/check/pass/service:{instance_id}") from exc
        if not passed:   # Consul answers 404 for an unknown check; py-consul returns False
            raise KeyError(f"pass_ttl: service instance {instance_id!r} is not registered")

    def deregister(self, instance_id: str) -> None:
        check_name("service id", instance_id)
        self._mine.pop(instance_id, None)
        self.acl.check()
        try:
            self._c.agent.service.deregister(instance_id)
        except consul.exceptions.NotFound:
            pass
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise self._failed(exc, f"/v1/agent/service/deregister/{instance_id}") from exc

    def healthy(self, name: str, tag: str | None = None) -> list[ServiceInstance]:
        return self.watch(name, tag=tag)[1]

    def watch(self, name: str, tag: str | None = None, index: int | None = None,
              wait_s: float | None = None) -> tuple[int, list[ServiceInstance]]:
        """Passing instances of ``name``; with ``index`` a blocking query that returns when
        Consul's index passes it or after ``wait_s``. Returns ``(index to send next,
        instances)`` under the rules in the module docstring."""
        check_name("service name", name)
        if tag is not None and (not isinstance(tag, str) or len(tag) > 256):
            check_name("service tag", tag, 256)
        self.acl.check()
        self._pace((name, tag), blocking=index is not None)
        try:
            new_index, entries = self._c.health.service(
                name, passing=True, tag=tag, index=index,
                wait=None if wait_s is None else f"{max(1, math.ceil(wait_s))}s")
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise self._failed(exc, f"/v1/health/service/{name}") from exc
        self.acl.ok()
        new_index = next_index(index, new_index)
        out = []
        for e in entries or []:
            s = e["Service"]
            out.append(ServiceInstance(name=s["Service"], id=s["ID"], address=s["Address"],
                                       port=int(s["Port"]), tags=list(s.get("Tags") or []),
                                       meta=dict(s.get("Meta") or {})))
        return new_index, out

    def _pace(self, key: tuple[str, str | None], blocking: bool) -> None:
        """A blocking read sleeps until ``min_watch_interval_s`` has passed since the last
        read of ``key``; every read is remembered."""
        with self._read_lock:
            last = self._last_read.get(key)
        if blocking and last is not None:
            left = last + self.min_watch_interval_s - self._clock.now()
            if left > 0:
                self._sleep(left)
        with self._read_lock:
            self._last_read[key] = self._clock.now()
