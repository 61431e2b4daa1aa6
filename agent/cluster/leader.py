"""Leader election for the predictor: a Consul session with a TTL holding a KV lock.

Only the holder of ``rewarm/predictor/leader`` acts; the others stand by. One call to
:meth:`LeaderLock.tick` per predictor tick::

    no session ──create (TTL, lock-delay 0)──► session ──renew──► acquire key ──► leader?
        ▲                                         │ renew 404 (expired)
        └──────────── forget session ◄────────────┘
    any Consul error ──► not leader this tick (losing Consul means losing the lock)

Safety: a leader is only a leader while its last successful renew is younger than the TTL
on the injected clock, so a leader cut off from Consul stops acting before Consul lets the
lock go (Consul invalidates a session no earlier than its TTL). A standby takes over on the
first tick after the old session expires (within TTL + one tick), because the session is
created with lock-delay 0 (Consul's default of 15 s would block the takeover).
"""

from __future__ import annotations

import logging
import math

import consul
import consul.exceptions

from agent.clock import Clock
from agent.errors import ConfigError

log = logging.getLogger(__name__)

LEADER_KEY = "rewarm/predictor/leader"
MIN_TTL_S, MAX_TTL_S = 10, 86400    # Consul's documented session TTL range


class LeaderLock:
    """Consul session lock on ``key``; ``tick()`` renews, acquires and says who leads."""

    def __init__(self, client: consul.Consul, *, clock: Clock, name: str,
                 key: str = LEADER_KEY, ttl_s: int = 10) -> None:
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ConfigError(f"LeaderLock: ttl_s={ttl_s} is out of range; limit is "
                              f"{MIN_TTL_S}..{MAX_TTL_S}", name="ttl_s", value=ttl_s,
                              limit=(MIN_TTL_S, MAX_TTL_S))
        self._c = client
        self._clock = clock
        self.name = name
        self.key = key
        self.ttl_s = int(ttl_s)
        self.session: str | None = None
        self._renewed_s = -math.inf
        self._held = False

    @property
    def is_leader(self) -> bool:
        """Held, and the last renew is younger than the TTL (checked on the clock now)."""
        return self._held and self._clock.now() - self._renewed_s < self.ttl_s

    def tick(self) -> bool:
        """Renew or create the session, try to take the lock; True if this instance leads."""
        now = self._clock.now()
        try:
            if self.session is not None:
                try:
                    self._c.session.renew(self.session)
                except consul.exceptions.NotFound:
                    log.warning("leader %s: session %s expired; lock lost", self.name,
                                self.session)
                    self.session, self._held = None, False
            if self.session is None:
                self.session = self._c.session.create(
                    name=f"rewarm-predictor-{self.name}", ttl=self.ttl_s, lock_delay=0,
                    behavior="release")
            self._renewed_s = now
            held = bool(self._c.kv.put(self.key, self.name, acquire=self.session))
        except (consul.exceptions.ConsulException, OSError) as exc:
            if self._held:
                log.warning("leader %s: Consul unreachable (%s); standing down", self.name, exc)
            self._held = False
            return False
        if held != self._held:
            log.info("leader %s: %s %s", self.name, "acquired" if held else "lost", self.key)
        self._held = held
        return self.is_leader

    def release(self) -> None:
        """Give the lock up and destroy the session (orderly shutdown); errors are logged."""
        if self.session is None:
            return
        try:
            self._c.kv.put(self.key, self.name, release=self.session)
            self._c.session.destroy(self.session)
        except (consul.exceptions.ConsulException, OSError) as exc:
            log.warning("leader %s: release failed: %s", self.name, exc)
        self.session, self._held = None, False
