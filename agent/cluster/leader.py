"""Leader election for the predictor: a Consul session, tied to a short TTL check the leader
feeds, holding a KV lock.

Only the holder of ``rewarm/predictor/leader`` acts; the others stand by. One call to
:meth:`LeaderLock.tick` per predictor tick::

    no session ──register check service, pass it, create session (TTL, lock-delay 0,
        │         checks serfHealth + the check)──► session
        ▼
    every tick: pass the check ──► renew the session ──► acquire the key ──► leader?
        ▲                                 │ renew 404 (session invalidated)
        └──────── forget the session ◄────┘
    any Consul error ──► not leader this tick (losing Consul means losing the lock)
    release() (graceful stop): release the key, destroy the session, deregister the check

Why the check.  Consul invalidates a session whose renewals stop only ``2 x TTL`` after the
last one (``agent/consul/session_ttl.go``: the timer is armed at ``ttl *
SessionTTLMultiplier``, 2), and the TTL is at least 10 s: a killed leader would hold the
lock for up to 20 s.  A session is also invalidated at once when one of its health checks
goes critical (``agent/consul/state/catalog.go``), and a TTL check goes critical when its
TTL passes without an update (``agent/checks/check.go``, ``CheckTTL``).  So each instance
registers a service ``rewarm-predictor-leader`` (id ``rewarm-predictor-leader-<name>-<token>``,
the token new per process, so an instance restarted in the same allocation never passes
the check its killed predecessor's session is tied to) with a TTL check of ``check_ttl_s`` (default 3 s), passes it every tick, and ties its session
to it: a leader killed with ``kill -9`` loses the lock ``check_ttl_s`` after its last pass,
and a standby takes it on its next tick (lock-delay 0: Consul's default 15 s would block
the takeover).  Expected failover: at most ``check_ttl_s`` + one tick + the time since the
last pass, against ``2 x ttl_s`` without the check.

Safety: a leader is only a leader while its last successful check pass is younger than
``check_ttl_s`` on the injected clock, so a leader cut off from Consul stops acting before
Consul can let the lock go (no earlier than the check's TTL after the last pass).
"""

from __future__ import annotations

import logging
import math
import secrets

import consul
import consul.exceptions

from agent.clock import Clock
from agent.errors import ConfigError

log = logging.getLogger(__name__)

LEADER_KEY = "rewarm/predictor/leader"
LEADER_SERVICE = "rewarm-predictor-leader"
MIN_TTL_S, MAX_TTL_S = 10, 86400    # Consul's session TTL range (session_endpoint.go)
SERF_HEALTH = "serfHealth"          # the node's own check, a session's default


class LeaderLock:
    """Consul session lock on ``key``; ``tick()`` feeds the check, renews, acquires and
    says who leads.  ``check_ttl_s`` must be shorter than ``ttl_s`` and longer than the
    caller's tick (a tick that passes the check every ``tick_s`` keeps it passing)."""

    def __init__(self, client: consul.Consul, *, clock: Clock, name: str,
                 key: str = LEADER_KEY, ttl_s: int = 10, check_ttl_s: float = 3.0) -> None:
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ConfigError(f"LeaderLock: ttl_s={ttl_s} is out of range; limit is "
                              f"{MIN_TTL_S}..{MAX_TTL_S}", name="ttl_s", value=ttl_s,
                              limit=(MIN_TTL_S, MAX_TTL_S))
        if not 0 < check_ttl_s < ttl_s:
            raise ConfigError(f"LeaderLock: check_ttl_s={check_ttl_s} must be > 0 and < "
                              f"ttl_s ({ttl_s})", name="check_ttl_s", value=check_ttl_s,
                              limit=(0, ttl_s))
        self._c = client
        self._clock = clock
        self.name = name
        self.key = key
        self.ttl_s = int(ttl_s)
        self.check_ttl_s = float(check_ttl_s)
        self.service_id = f"{LEADER_SERVICE}-{name}-{secrets.token_hex(4)}"
        self.check_id = f"service:{self.service_id}"
        self.session: str | None = None
        self._registered = False
        self._passed_s = -math.inf
        self._held = False

    @property
    def is_leader(self) -> bool:
        """Held, and the check was passed less than ``check_ttl_s`` ago (on the clock now)."""
        return self._held and self._clock.now() - self._passed_s < self.check_ttl_s

    def _feed(self) -> None:
        if not self._registered:
            check = consul.Check.ttl(f"{self.check_ttl_s:g}s")
            # a killed instance's service is reaped by the agent once its check has been
            # critical this long (agent/agent.go reapServicesInternal; 1 m is Consul's minimum)
            check["DeregisterCriticalServiceAfter"] = "1m"
            self._c.agent.service.register(LEADER_SERVICE, service_id=self.service_id,
                                           check=check)
            self._registered = True
        try:
            self._c.agent.check.ttl_pass(self.check_id)
        except consul.exceptions.NotFound:
            # the agent lost the registration (restarted): register again next tick
            self._registered = False
            raise

    def tick(self) -> bool:
        """Pass the check, renew or create the session, try to take the lock; True if this
        instance leads."""
        now = self._clock.now()
        try:
            self._feed()
            self._passed_s = now
            if self.session is not None:
                try:
                    self._c.session.renew(self.session)
                except consul.exceptions.NotFound:
                    log.warning("leader %s: session %s invalidated; lock lost", self.name,
                                self.session)
                    self.session, self._held = None, False
            if self.session is None:
                self.session = self._c.session.create(
                    name=f"rewarm-predictor-{self.name}", ttl=self.ttl_s, lock_delay=0,
                    behavior="release", checks=[SERF_HEALTH, self.check_id])
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
        """Give the lock up at once (orderly shutdown): release the key, destroy the session,
        deregister the check; errors are logged."""
        try:
            if self.session is not None:
                self._c.kv.put(self.key, self.name, release=self.session)
                self._c.session.destroy(self.session)
            if self._registered:
                self._c.agent.service.deregister(self.service_id)
        except (consul.exceptions.ConsulException, OSError) as exc:
            log.warning("leader %s: release failed: %s", self.name, exc)
        self.session, self._held, self._registered = None, False, False
