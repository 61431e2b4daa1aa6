"""The front door process: the request path, its entrances and its background loops.

:class:`FrontDoor` builds the one :class:`~agent.frontdoor.request_path.RequestPath` (routing,
admission, capacity, replica links) and the msgpack/TCP entrance over it, watches the
registry for replicas (a watcher thread: Consul blocking queries, or polling) and runs the
loops that expire queued requests and sweep idle connections.  Another entrance (HTTP) is
given ``frontdoor.path`` and ``frontdoor.auth`` and is as thin as the msgpack one.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
import uuid

from agent.clock import Clock, SystemClock
from agent.cluster.base import Registry, ServiceInstance
from agent.frontdoor.announce import FRONTDOOR_SERVICE, Announcer, RegistryAnnouncer
from agent.frontdoor.auth import TokenAuth
from agent.frontdoor.capacity import CapacityRequester
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.msgpack_entrance import ClientConn, MsgpackEntrance
from agent.frontdoor.ratelog import RateLimitedLog
from agent.frontdoor.request_path import RequestPath
from agent.frontdoor.watch import RegistryWatcher
from agent.limits import raise_nofile
from agent.telemetry import Telemetry

__all__ = ["FrontDoor", "FrontDoorConfig", "REPLICA_SERVICE", "ClientConn"]

log = logging.getLogger(__name__)
REPLICA_SERVICE = "rewarm-replica"


class FrontDoor:
    """Owns the request path, the msgpack entrance, the registry watcher and the loops."""

    def __init__(self, config: FrontDoorConfig, *, registry: Registry,
                 capacity: CapacityRequester | None = None, clock: Clock | None = None,
                 telemetry: Telemetry | None = None, auth: TokenAuth | None = None,
                 announcer: Announcer | None = None) -> None:
        self.config = config
        self.registry = registry
        self.clock = clock or SystemClock()
        self.telemetry = telemetry or Telemetry()
        self.auth = auth or TokenAuth()
        if announcer is None and config.announce:
            announcer = RegistryAnnouncer(registry, ttl_s=max(3 * config.registry_poll_s, 5.0))
        self.announcer = announcer
        self.path = RequestPath(config, clock=self.clock, telemetry=self.telemetry,
                                capacity=capacity)
        self.msgpack = MsgpackEntrance(self.path, config, clock=self.clock, auth=self.auth)
        self.instance_id = f"frontdoor-{uuid.uuid4().hex[:12]}"
        self._tasks: list[asyncio.Task] = []
        self._watcher: RegistryWatcher | None = None
        self._last_beat_s = float("-inf")
        self._pass_log = RateLimitedLog(log, "front door loop passes that raised",
                                        clock=self.clock,
                                        interval_s=config.accept_log_interval_s)

    # The request path's state, for tests and tools that look inside.
    @property
    def capacity(self) -> CapacityRequester | None:
        return self.path.capacity

    @capacity.setter
    def capacity(self, value: CapacityRequester | None) -> None:
        self.path.capacity = value

    @property
    def router(self):
        return self.path.router

    @property
    def links(self):
        return self.path.links

    @property
    def queues(self):
        return self.path.queues

    @property
    def known_models(self):
        return self.path.known_models

    @property
    def conns(self) -> set[ClientConn]:
        return self.msgpack.conns

    # --- lifecycle -------------------------------------------------------------------

    async def start(self) -> tuple[str, int]:
        """Raise the soft RLIMIT_NOFILE to the hard limit (logged, agent/limits.py), listen
        and start the background loops; returns the msgpack door's ``(host, port)``."""
        raise_nofile("frontdoor")
        loop = asyncio.get_running_loop()
        await self.refresh_replicas()
        self._watcher = RegistryWatcher(
            self.registry, REPLICA_SERVICE, poll_s=self.config.registry_poll_s,
            wait_s=self.config.registry_wait_s, on_change=self.path.apply_replicas, loop=loop,
            on_tick=self._heartbeat).start()
        await self.msgpack.listen(self.config.host, self.config.port)
        self._tasks = [loop.create_task(self._ticker()), loop.create_task(self._sweeper())]
        if self.announcer is not None:
            host, port = self.address
            await asyncio.to_thread(self.announcer.announce, ServiceInstance(
                FRONTDOOR_SERVICE, self.instance_id, host, port, tags=["protocol=msgpack"]))
        return self.address

    @property
    def address(self) -> tuple[str, int]:
        return self.msgpack.address

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain, then stop.  For ``grace_s`` (default ``config.drain_grace_s``) requests
        already at a replica may finish (streams run to their end) while every new request
        is answered 503 with ``retry_after_ms`` (the grace left) and queued ones 503 at once;
        those still running after it are answered 503 naming ``grace_s``.  Then the listener
        and every connection close gracefully (answers flushed first; at most
        ``close_linger_s`` more)."""
        grace_s = self.config.drain_grace_s if grace_s is None else grace_s
        if self._watcher is not None:
            self._watcher.stop()
        deadline = self.clock.now() + grace_s
        self.path.begin_stop(deadline)
        while self.path.dispatched() and self.clock.now() < deadline:
            await asyncio.sleep(0.01)
        self.msgpack.close_listener()
        for task in self._tasks:
            task.cancel()
        self.path.fail_dispatched(f"front door shutting down: replica {{replica}} did not "
                                  f"finish within grace_s({grace_s})")
        await self.msgpack.close_all()
        self.path.tick_logs(final=True)
        if self.announcer is not None:
            await asyncio.to_thread(self.announcer.withdraw, self.instance_id)
        self.telemetry.flush()

    # --- background loops ------------------------------------------------------------

    async def _ticker(self) -> None:
        """Answer queued requests past their deadline (504) or wait bound (429), and
        dispatched ones whose replica gave no first token in time (first_token.py).  A pass
        that raises is logged and the next one runs (every queued request depends on it)."""
        while True:
            await asyncio.sleep(self.config.tick_s)
            if self.path.queued_models or self.path.watching:
                self._pass("ticker", self.path.expire_queued)

    async def _sweeper(self) -> None:
        """Close idle connections and cut off frames that take too long to arrive (a pass
        that raises is logged and the next one runs)."""
        while True:
            await asyncio.sleep(self.config.sweep_s)
            self._pass("sweeper", self.msgpack.sweep, self.path.tick_logs,
                       self.telemetry.flush)
            self._pass_log.tick()

    def _pass(self, loop: str, *steps) -> None:
        """Run ``steps`` in order, each once: one that raises (a bug) is logged with its
        traceback (rate-limited) and the rest still run, so a background loop never ends
        on one bad pass."""
        for step in steps:
            try:
                step()
            except Exception:   # noqa: BLE001 - logged; the loop's next pass runs
                self._pass_log.warning("front door %s: a pass raised; the loop goes on:\n%s",
                                       loop, traceback.format_exc())

    def _heartbeat(self) -> None:
        """Keep a TTL announcement passing (called from the watcher thread)."""
        now = self.clock.now()
        if self.announcer is not None and now - self._last_beat_s >= self.config.registry_poll_s:
            self._last_beat_s = now
            try:
                self.announcer.heartbeat(self.instance_id)
            except Exception as exc:
                log.warning("front door heartbeat failed: %s", exc)

    async def refresh_replicas(self) -> None:
        """Read the registry now (startup, tests) and apply it."""
        self.path.apply_replicas(await asyncio.to_thread(self.registry.healthy,
                                                         REPLICA_SERVICE))

