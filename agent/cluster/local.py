"""Embedded default registry: in-process, with TTL health driven by an injected clock."""

from __future__ import annotations

import threading

from agent.clock import Clock, SystemClock
from agent.cluster.base import ServiceInstance


class LocalRegistry:
    """A :class:`~agent.cluster.base.Registry` held in memory, safe across threads."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._entries: dict[str, tuple[ServiceInstance, float, float]] = {}  # id -> (inst, ttl, last)

    def register(self, instance: ServiceInstance, ttl_s: float) -> None:
        with self._lock:
            self._entries[instance.id] = (instance, float(ttl_s), self._clock.now())

    def pass_ttl(self, instance_id: str, meta: dict[str, str] | None = None) -> None:
        with self._lock:
            entry = self._entries.get(instance_id)
            if entry is None:
                raise KeyError(f"pass_ttl: service instance {instance_id!r} is not registered")
            instance, ttl, _ = entry
            if meta:
                instance.meta.update(meta)
            self._entries[instance_id] = (instance, ttl, self._clock.now())

    def deregister(self, instance_id: str) -> None:
        with self._lock:
            self._entries.pop(instance_id, None)

    def healthy(self, name: str, tag: str | None = None) -> list[ServiceInstance]:
        now = self._clock.now()
        with self._lock:
            return [inst for inst, ttl, last in self._entries.values()
                    if inst.name == name and now - last <= ttl
                    and (tag is None or tag in inst.tags)]
