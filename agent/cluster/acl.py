"""ACL denials (401/403 from Consul or Nomad): surfaced once per change, retried slowly.

A refused token is not fixed by asking again every tick.  :class:`AclGate` keeps the last
:class:`~agent.errors.AclDenied`; while it is younger than ``backoff_s`` every call is
answered with it without a request.  A new denial text is logged once (error), reported in
the ``rewarm_cluster_acl_denied{service}`` gauge (prometheus-client's default registry) and
in ``gate.error`` (health answers read it); the first success clears all three.
"""

from __future__ import annotations

import logging
import threading

from prometheus_client import Gauge

from agent.clock import Clock, SystemClock
from agent.errors import AclDenied

log = logging.getLogger(__name__)

ACL_BACKOFF_S = 300.0
ACL_DENIED = Gauge("rewarm_cluster_acl_denied",
                   "1 while Consul or Nomad refuses this process's ACL token", ["service"])


class AclGate:
    """Thread-safe gate for one service's calls (``service``: "consul" | "nomad")."""

    def __init__(self, service: str, *, clock: Clock | None = None,
                 backoff_s: float = ACL_BACKOFF_S) -> None:
        self.service, self.backoff_s = service, backoff_s
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self.error: AclDenied | None = None
        self.until_s = 0.0

    def check(self) -> None:
        """Raise the stored denial while its back-off runs (no request is made)."""
        with self._lock:
            err, left = self.error, self.until_s - self._clock.now()
        if err is not None and left > 0:
            raise AclDenied(f"{err} (not asking again for {left:.0f} s)", service=err.service,
                            status=getattr(err, "status", 403),
                            endpoint=getattr(err, "endpoint", None), retry_after_s=left)

    def denied(self, err: AclDenied) -> None:
        with self._lock:
            changed = self.error is None or str(self.error) != str(err)
            self.error, self.until_s = err, self._clock.now() + self.backoff_s
        if changed:
            log.error("%s; asking again in %.0f s (fix the token: CONSUL_HTTP_TOKEN / "
                      "NOMAD_TOKEN)", err, self.backoff_s)
            ACL_DENIED.labels(self.service).set(1)

    def ok(self) -> None:
        with self._lock:
            was, self.error, self.until_s = self.error, None, 0.0
        if was is not None:
            log.info("%s accepts the token again", self.service)
            ACL_DENIED.labels(self.service).set(0)
