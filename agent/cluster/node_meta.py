"""The node agent's cached snapshots as Nomad dynamic node metadata (``rewarm_snapshots``).

``POST /v1/client/metadata`` (Nomad "Client HTTP API", Update Dynamic Node Metadata: body
``{"Meta": {key: value | null}}``, ``node_id`` query parameter; null unsets a key; needs
``node:write``) sets the comma-separated, sorted model names whose snapshot this node caches;
the replica job's ``set_contains`` affinity on ``${meta.rewarm_snapshots}`` reads it.

:class:`SnapshotMetadata` is called every agent tick with the models cached now and posts only
when that set changed since the last accepted post (or a failed one is due again): failures
back off (doubling to ``max_backoff_s``; an ACL denial waits ``acl_backoff_s`` and is logged
once per change of its text).
"""

from __future__ import annotations

import logging

import nomad
import nomad.api.exceptions as nexc
from nomad.api.base import Requester

from agent.clock import Clock, SystemClock
from agent.cluster.acl import AclGate
from agent.cluster.names import check_name
from agent.cluster.nomad_http import nomad_error
from agent.errors import AclDenied, ClusterError

log = logging.getLogger(__name__)

SNAPSHOTS_META_KEY = "rewarm_snapshots"
ENDPOINT = "/v1/client/metadata"


class _NodeMetadata(Requester):
    """``/v1/client/metadata`` through python-nomad's own requester (no helper in 2.1)."""

    ENDPOINT = "client/metadata"


def publish_cached_snapshots(client: nomad.Nomad, models: list[str],
                             node_id: str | None = None) -> dict:
    """Set ``rewarm_snapshots`` on ``node_id`` (None: the node of the Nomad agent answering)
    to ``models``; an empty list unsets it.  Returns Nomad's answer (``Meta``, ``Dynamic``,
    ``Static``).  Raises ConfigError (a bad model or node id), AclDenied, ClusterError."""
    names = sorted({check_name("model", m, 63) for m in models})
    if node_id is not None:
        check_name("node id", node_id)
    req = _NodeMetadata(**client.requester_settings)
    body = {"Meta": {SNAPSHOTS_META_KEY: ",".join(names) or None}}
    params = {"node_id": node_id} if node_id else None
    try:
        return req.request(method="post", params=params, json=body).json()
    except nexc.BaseNomadException as exc:
        raise nomad_error(exc, ENDPOINT, "node:write") from exc
    except ValueError as exc:
        raise ClusterError(f"nomad: {ENDPOINT} answered non-JSON: {exc}", service="nomad",
                           status=None, endpoint=ENDPOINT) from exc


class SnapshotMetadata:
    """Publishes a node's cached models when they change (see the module docstring)."""

    def __init__(self, client: nomad.Nomad, node_id: str | None = None, *,
                 clock: Clock | None = None, backoff_s: float = 1.0, max_backoff_s: float = 60.0,
                 acl_backoff_s: float = 300.0) -> None:
        self._n, self.node_id = client, node_id
        self._clock = clock or SystemClock()
        self._backoff_s, self._max_backoff_s = backoff_s, max_backoff_s
        self._acl_backoff_s = acl_backoff_s
        self.published: frozenset[str] | None = None    # what Nomad has, as far as we know
        self.failures = 0
        self.next_try_s = 0.0
        self.last_error: ClusterError | None = None
        self.acl = AclGate("nomad", clock=self._clock, backoff_s=acl_backoff_s)

    def update(self, models: list[str]) -> bool:
        """Post ``models`` if they differ from what was published; True when a post was made
        and accepted.  Never raises for Nomad's failures (they are kept in ``last_error``)."""
        want = frozenset(models)
        now = self._clock.now()
        if want == self.published or now < self.next_try_s:
            return False
        try:
            publish_cached_snapshots(self._n, sorted(want), self.node_id)
        except AclDenied as exc:
            self.acl.denied(exc)   # logged once per change; next_try_s holds the back-off
            self._failed(exc, now, self._acl_backoff_s)
            return False
        except ClusterError as exc:
            delay = min(self._max_backoff_s, self._backoff_s * 2 ** self.failures)
            if self.failures == 0:
                log.warning("node metadata not published (%s); retrying with backoff", exc)
            self._failed(exc, now, delay)
            return False
        self.acl.ok()
        if self.last_error is not None:
            log.info("node metadata published again after %d failures", self.failures)
        self.published, self.failures, self.last_error = want, 0, None
        return True

    def _failed(self, exc: ClusterError, now: float, delay: float) -> None:
        self.failures += 1
        self.last_error = exc
        self.next_try_s = now + delay
