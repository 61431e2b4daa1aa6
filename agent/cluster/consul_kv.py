"""Per-model snapshot summary in Consul KV (``rewarm/snapshots/<model>``), written with
check-and-set so that status only moves forward.

The summary is JSON: ``{"snapshot_id", "status", "durable", "node", "updated_s"}``. Status
moves follow the catalog's :data:`agent.snapshot.catalog.STATUS_MOVES` (pending -> ready ->
corrupt | stale; corrupt and stale are final) for the same ``snapshot_id``; a different
``snapshot_id`` (a newer snapshot) may replace the summary. Every write is a CAS on the
key's ``ModifyIndex`` (``?cas=0`` for a new key), retried on a lost race, so two agents
cannot move a status backwards between a read and a write.
"""

from __future__ import annotations

import json
from typing import Protocol
from collections.abc import Callable

import consul
import consul.exceptions

from agent.cluster.consul_http import cluster_error
from agent.cluster.names import check_name
from agent.errors import ClusterError, ConfigError

KEY_PREFIX = "rewarm/snapshots/"
STATUS_MOVES: dict[str, frozenset[str]] = {
    "pending": frozenset({"ready", "corrupt", "stale"}),
    "ready": frozenset({"corrupt", "stale"}),
    "corrupt": frozenset(),
    "stale": frozenset(),
}
MAX_CAS_RETRIES = 8


class SnapshotKV:
    """Read and move per-model snapshot summaries in Consul KV."""

    def __init__(self, client: consul.Consul, prefix: str = KEY_PREFIX) -> None:
        self._c = client
        self._prefix = prefix

    def _key(self, model: str) -> str:
        return self._prefix + check_name("model", model, 63)

    def get(self, model: str) -> dict | None:
        """The summary for ``model`` or None."""
        return self._read(model)[1]

    def _read(self, model: str) -> tuple[int, dict | None]:
        key = self._key(model)
        try:
            _, entry = self._c.kv.get(key)
        except (consul.exceptions.ConsulException, OSError) as exc:
            raise cluster_error(exc, f"/v1/kv/{key}") from exc
        if entry is None:
            return 0, None
        try:
            return int(entry["ModifyIndex"]), json.loads(entry["Value"] or b"null")
        except ValueError as exc:
            raise ClusterError(f"consul: {key} holds non-JSON", service="consul",
                               endpoint=key, status=None) from exc

    def publish(self, model: str, snapshot_id: str, status: str, *, durable: bool,
                node: str = "", updated_s: float = 0.0) -> bool:
        """Move ``model``'s summary to ``status``; False if that would move it backwards.

        Raises ConfigError for an unknown status and ClusterError when Consul fails or the
        CAS keeps losing (more than ``MAX_CAS_RETRIES`` races).
        """
        if status not in STATUS_MOVES:
            raise ConfigError(f"snapshot KV: status={status!r} unknown; limit is one of "
                              f"{sorted(STATUS_MOVES)}", name="status", value=status,
                              limit=sorted(STATUS_MOVES))
        key = self._key(model)
        new = {"snapshot_id": snapshot_id, "status": status, "durable": bool(durable),
               "node": node, "updated_s": float(updated_s)}
        for _ in range(MAX_CAS_RETRIES):
            index, old = self._read(model)
            if old is not None and old.get("snapshot_id") == snapshot_id:
                if old.get("status") == status and old.get("durable") == new["durable"]:
                    return True
                if status != old.get("status") and status not in STATUS_MOVES.get(
                        str(old.get("status")), frozenset()):
                    return False
                if status == old.get("status") and old.get("durable") and not durable:
                    return False                     # durability is not taken back
            try:
                if self._c.kv.put(key, json.dumps(new), cas=index):
                    return True
            except (consul.exceptions.ConsulException, OSError) as exc:
                raise cluster_error(exc, f"/v1/kv/{key}") from exc
        raise ClusterError(f"consul: CAS on {key} lost {MAX_CAS_RETRIES} races", service="consul",
                           endpoint=key, status=None)

    def durable(self, model: str) -> bool:
        """True when ``model``'s snapshot is ready and durable according to Consul."""
        summary = self.get(model)
        return bool(summary and summary.get("status") == "ready" and summary.get("durable"))


class DurableCatalog(Protocol):
    """What the scale-in guard reads of the node's catalog (agent/snapshot/catalog.py)."""

    def durable_ready(self, model_name: str) -> bool: ...


def snapshot_durable(catalog: DurableCatalog | None, kv: SnapshotKV | None
                     ) -> Callable[[str], bool]:
    """The predictor's scale-in guard: ready and durable in the catalog and in Consul KV
    (each source that is given must agree; an unreachable Consul answers False)."""
    def check(model: str) -> bool:
        if catalog is not None and not catalog.durable_ready(model):
            return False
        if kv is not None:
            try:
                return kv.durable(model)
            except ClusterError:
                return False
        return catalog is not None
    return check
