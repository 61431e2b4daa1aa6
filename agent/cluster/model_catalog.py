"""The models a cluster serves, and their policies, from Consul KV.

Two kinds of entry (JSON values):

- ``rewarm/models/<model>``: ``{"deadline_ms"?, "version"?, "node"?}``, created by each node
  agent for the models it is configured with (``?cas=0``: created once, never overwritten,
  so an operator's edit of the policy stays), or by the operator
  (``consul kv put rewarm/models/M '{"deadline_ms": 20000}'``);
- ``rewarm/snapshots/<model>``: the snapshot summary (:mod:`agent.cluster.consul_kv`).

A model is known when either exists; its policy is the models entry (empty when there is
none).  :meth:`ModelCatalog.watch` is one blocking read of the ``rewarm/`` prefix (Consul
"KV Store HTTP API", ``recurse``, ``index``, ``wait``) with the index rules of
:func:`agent.cluster.consul_http.next_index`; :class:`CatalogWatcher` runs it on a thread.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable

import consul
import consul.exceptions

from agent.cluster.consul_http import cluster_error, next_index
from agent.cluster.consul_kv import KEY_PREFIX as SNAPSHOTS_PREFIX
from agent.cluster.names import check_name
from agent.errors import ClusterError

log = logging.getLogger(__name__)

MODELS_PREFIX = "rewarm/models/"
MAX_POLICY_BYTES = 4096
MAX_DEADLINE_MS = 3_600_000.0


def policy_from(raw: bytes | None) -> dict:
    """A policy from a KV value: ``deadline_ms`` kept when a number in (0, 1 h]; anything
    else (non-JSON, too large, other keys) is ignored rather than trusted."""
    if not raw or len(raw) > MAX_POLICY_BYTES:
        return {}
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    out = {}
    deadline = value.get("deadline_ms")
    if (isinstance(deadline, (int, float)) and not isinstance(deadline, bool)
            and math.isfinite(deadline) and 0 < deadline <= MAX_DEADLINE_MS):
        out["deadline_ms"] = float(deadline)
    return out


class ModelCatalog:
    def __init__(self, client: consul.Consul) -> None:
        self._c = client

    def announce(self, model: str, version: str = "", node: str = "") -> bool:
        """Create ``rewarm/models/<model>`` unless it exists; True when created."""
        key = MODELS_PREFIX + check_name("model", model, 63)
        try:
            return bool(self._c.kv.put(key, json.dumps({"version": version, "node": node}),
                                       cas=0))
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise cluster_error(exc, f"/v1/kv/{key}") from exc

    def watch(self, index: int | None = None, wait_s: float | None = None
              ) -> tuple[int, dict[str, dict]]:
        """``(next index, {model: policy})``; blocking when ``index`` is given."""
        try:
            got, entries = self._c.kv.get(
                "rewarm/", recurse=True, index=index,
                wait=None if wait_s is None else f"{max(1, math.ceil(wait_s))}s")
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise cluster_error(exc, "/v1/kv/rewarm/?recurse") from exc
        models: dict[str, dict] = {}
        for e in entries or []:
            key = e.get("Key", "")
            for prefix in (MODELS_PREFIX, SNAPSHOTS_PREFIX):
                name = key[len(prefix):] if key.startswith(prefix) else ""
                if not name or "/" in name:
                    continue
                try:
                    check_name("model", name, 63)
                except ValueError:
                    continue
                policy = policy_from(e.get("Value")) if prefix == MODELS_PREFIX else {}
                models.setdefault(name, {}).update(policy)
        return next_index(index, got), models


class CatalogWatcher:
    """Calls ``on_change({model: policy})`` from a daemon thread whenever the catalog
    changes; reads at least ``min_interval_s`` apart; failures are logged once per outage
    and retried after ``retry_s`` (an ACL denial after ``acl_retry_s``)."""

    def __init__(self, catalog: ModelCatalog, on_change: Callable[[dict[str, dict]], None], *,
                 wait_s: float = 30.0, min_interval_s: float = 0.5, retry_s: float = 2.0,
                 acl_retry_s: float = 300.0) -> None:
        self.catalog, self.on_change = catalog, on_change
        self.wait_s, self.min_interval_s = wait_s, min_interval_s
        self.retry_s, self.acl_retry_s = retry_s, acl_retry_s
        self.error: ClusterError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watch-catalog", daemon=True)

    def start(self) -> CatalogWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from agent.errors import AclDenied

        index, last, seen = None, -math.inf, None
        while not self._stop.is_set():
            wait = last + self.min_interval_s - time.monotonic()
            if wait > 0 and self._stop.wait(wait):
                return
            last = time.monotonic()
            try:
                index, models = self.catalog.watch(index, self.wait_s if index else None)
            except ClusterError as exc:
                if self.error is None or str(self.error) != str(exc):
                    log.warning("model catalog read failed (%s); keeping the models known",
                                exc)
                self.error, index = exc, None
                self._stop.wait(self.acl_retry_s if isinstance(exc, AclDenied) else self.retry_s)
                continue
            self.error = None
            if models != seen:
                seen = models
                self.on_change(models)
