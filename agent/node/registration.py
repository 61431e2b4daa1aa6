"""Keeps this node's instances registered in any Registry, and keeps serving when it is down.

The agent says which instances should exist (``want``/``drop``); :meth:`Registrar.sync`,
called from the agent loop, registers what is missing and passes each TTL check.  A failing
registry (Consul unreachable, 5xx) never stops serving: the error is logged once per outage,
the next try waits ``backoff_s`` (doubling up to ``max_backoff_s``), and everything is
registered again when the registry answers.  An ACL denial (:class:`~agent.errors.AclDenied`)
is logged as a clear error once per change of its text and retried at the longest backoff,
never in a tight loop.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from agent.clock import Clock, SystemClock
from agent.cluster.base import Registry, ServiceInstance
from agent.errors import AclDenied, ConfigError

log = logging.getLogger(__name__)


@dataclass
class RegistrarState:
    healthy: bool = True
    failures: int = 0
    next_try_s: float = 0.0
    last_error: str | None = None


class Registrar:
    """Desired instances → registry, with backoff.  Thread-safe."""

    def __init__(self, registry: Registry, *, ttl_s: float = 10.0, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, clock: Clock | None = None) -> None:
        if ttl_s <= 0 or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ConfigError(
                f"registrar timings ttl_s={ttl_s}, backoff_s={backoff_s}, "
                f"max_backoff_s={max_backoff_s}: need ttl_s > 0 and 0 < backoff_s <= max_backoff_s",
                name="registrar", value=(ttl_s, backoff_s, max_backoff_s), limit="> 0")
        self.registry = registry
        self.ttl_s = ttl_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.clock = clock or SystemClock()
        self.state = RegistrarState()
        self._lock = threading.Lock()
        self._want: dict[str, ServiceInstance] = {}
        self._registered: set[str] = set()
        self._meta: dict[str, dict[str, str]] = {}

    def want(self, instance: ServiceInstance) -> None:
        """Ask for ``instance`` to be registered (now if the registry answers, else later)."""
        with self._lock:
            self._want[instance.id] = instance
            self._registered.discard(instance.id)
        self.sync(force=True)

    def update_meta(self, instance_id: str, meta: dict[str, str]) -> None:
        with self._lock:
            if instance_id in self._want:
                self._want[instance_id].meta.update(meta)
                self._meta[instance_id] = dict(meta)

    def drop(self, instance_id: str) -> None:
        """Stop announcing ``instance_id`` and deregister it (best effort: its TTL expires)."""
        with self._lock:
            self._want.pop(instance_id, None)
            self._registered.discard(instance_id)
            self._meta.pop(instance_id, None)
        try:
            self.registry.deregister(instance_id)
        except Exception as exc:  # the registry's TTL check removes it anyway
            self._failed(exc)

    def registered(self) -> set[str]:
        with self._lock:
            return set(self._registered)

    def sync(self, force: bool = False) -> bool:
        """Register what is missing and pass every TTL. True when the registry answered."""
        now = self.clock.now()
        if not force and now < self.state.next_try_s:
            return False
        if force and not self.state.healthy and now < self.state.next_try_s:
            return False
        with self._lock:
            want = dict(self._want)
            done = set(self._registered)
            metas = dict(self._meta)
        try:
            for iid, inst in want.items():
                if iid not in done:
                    self.registry.register(inst, self.ttl_s)
                    with self._lock:
                        if iid in self._want:
                            self._registered.add(iid)
                else:
                    self.registry.pass_ttl(iid, metas.pop(iid, None))
        except Exception as exc:
            self._failed(exc)
            return False
        if not self.state.healthy:
            log.info("registry reachable again; %d instances registered", len(want))
        self.state = RegistrarState(healthy=True, next_try_s=now)
        return True

    def _failed(self, exc: Exception) -> None:
        now = self.clock.now()
        st = self.state
        if isinstance(exc, AclDenied):
            delay = self.max_backoff_s
            if not (st.last_error or "").startswith(str(exc).split(" (not asking again")[0]):
                log.error("registry refused the token (ACL): %s; set a token with "
                          "service:write (CONSUL_HTTP_TOKEN); retrying every %.0f s", exc, delay)
        else:
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** st.failures)
            if st.healthy:
                log.warning("registry unreachable (%s); serving continues, retrying with backoff",
                            exc)
        with self._lock:
            self._registered.clear()  # register everything again when it returns
        self.state = RegistrarState(healthy=False, failures=st.failures + 1,
                                    next_try_s=now + delay, last_error=str(exc))
