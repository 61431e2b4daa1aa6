"""Keeps the front door's view of replicas current, off the request path.

A daemon thread reads the registry and hands each list of passing ``rewarm-replica``
instances to the event loop (``loop.call_soon_threadsafe``).  A registry with
``watch(name, tag, index, wait_s) -> (index, instances)`` (Consul's blocking queries in
:class:`~agent.cluster.consul_registry.ConsulRegistry`) is read as soon as it changes;
any other Registry is polled every ``poll_s``.  Failures are logged once per outage and
retried after ``poll_s``; the front door keeps serving from its cached view meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from agent.cluster.base import Registry, ServiceInstance

log = logging.getLogger(__name__)


class RegistryWatcher:
    def __init__(self, registry: Registry, service: str, *, poll_s: float, wait_s: float,
                 on_change: Callable[[list[ServiceInstance]], None],
                 loop: asyncio.AbstractEventLoop,
                 on_tick: Callable[[], None] | None = None) -> None:
        self.registry, self.service = registry, service
        self.poll_s, self.wait_s = poll_s, wait_s
        self._on_change, self._on_tick, self._loop = on_change, on_tick, loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watch-{service}", daemon=True)

    def start(self) -> RegistryWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the thread to end (a blocking query in progress ends within ``wait_s``)."""
        self._stop.set()

    def _run(self) -> None:
        watch = getattr(self.registry, "watch", None)
        index, failing = None, False
        while not self._stop.is_set():
            try:
                if watch is not None:
                    index, instances = watch(self.service, None, index, self.wait_s)
                else:
                    instances = self.registry.healthy(self.service)
                if self._on_tick is not None:
                    self._on_tick()
                failing = False
            except Exception as exc:  # an outage must not stop serving
                if not failing:
                    log.warning("registry read for %s failed (%s); serving from the cached "
                                "view", self.service, exc)
                failing, index = True, None
                self._stop.wait(self.poll_s)
                continue
            if self._stop.is_set():
                return
            try:
                self._loop.call_soon_threadsafe(self._on_change, instances)
            except RuntimeError:  # the loop is closed
                return
            if watch is None or index is None:
                self._stop.wait(self.poll_s)
