"""The node agent's snapshot bookkeeping: start-up reconciliation, eviction hook, the
operator's list/verify/evict, the cluster summary and the scale-in durability test.

:class:`Snapshots` works on the catalog and the local tier alone (agent/snapshot/), and
publishes to the cluster summary (agent/cluster/consul_kv.py's SnapshotKV) when given one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from agent.errors import RewarmError, SnapshotCorrupt, SnapshotError
from agent.snapshot.catalog import Catalog
from agent.snapshot.reader import read_manifest, verify_chunks
from agent.snapshot.store import LocalStore

log = logging.getLogger("agent.node.agent")


class SnapshotSummary(Protocol):
    """The cluster-wide per-model summary (agent/cluster/consul_kv.py's SnapshotKV)."""

    def publish(self, model: str, snapshot_id: str, status: str, *, durable: bool,
                node: str = "", updated_s: float = 0.0) -> bool: ...


class Snapshots:
    """Snapshot bookkeeping of node ``node_id`` over ``catalog`` and the local tier
    ``store``; ``remote_root`` is the remote tier (None: none configured, so a ready local
    copy is as durable as this node gets)."""

    def __init__(self, catalog: Catalog, store: LocalStore, *, node_id: str,
                 remote_root: Path | None, summary: SnapshotSummary | None) -> None:
        self.catalog, self.store = catalog, store
        self.node_id, self.remote_root, self.summary = node_id, remote_root, summary

    # -- start-up ----------------------------------------------------------------------------
    def reconcile(self) -> None:
        """Make catalog and local tier agree after a restart or a crash mid-capture."""
        from agent.snapshot.writer import clean_partials

        clean_partials(self.store.root)
        for row in self.catalog.snapshots():
            if row.status == "pending":  # a capture or staging that never finished
                self.catalog.set_status(row.snapshot_id, "stale", "unfinished at restart")
            path = self.store.path(row.snapshot_id)
            present = (path / "manifest.msgpack").is_file()
            if present and row.status == "ready" and not self.store.has(row.snapshot_id):
                self.store.add(row.snapshot_id, f"{row.model_name}@{row.model_version}")
            elif not present and row.status == "ready" and row.remote_uri is None:
                self.catalog.set_status(row.snapshot_id, "stale", "local copy gone; no remote copy")

    def on_evict(self, snapshot_id: str) -> None:
        """The local tier evicted ``snapshot_id``: without a remote copy it is stale."""
        try:
            row = self.catalog.snapshot(snapshot_id)
        except SnapshotError:
            return
        if row.remote_uri is None and row.status in ("pending", "ready"):
            self.catalog.set_status(snapshot_id, "stale", "evicted from the local tier; no remote copy")

    # -- snapshots ---------------------------------------------------------------------------
    def snapshot_list(self, model: str | None = None) -> list[dict[str, Any]]:
        return [{"snapshot": r.snapshot_id, "model": r.model_name, "version": r.model_version,
                 "status": r.status, "reason": r.reason, "size_bytes": r.size_bytes,
                 "local": self.store.has(r.snapshot_id), "remote": r.remote_uri,
                 "driver": r.driver_version} for r in self.catalog.snapshots(model)]

    def snapshot_verify(self, snapshot_id: str) -> dict[str, Any]:
        """Re-read every chunk of the local copy; a failure marks it corrupt."""
        row = self.catalog.snapshot(snapshot_id)
        try:
            with self.store.reading(snapshot_id) as path:
                verified = verify_chunks(path, read_manifest(path))
        except SnapshotCorrupt as exc:
            if row.status in ("pending", "ready"):
                self.catalog.set_status(snapshot_id, "corrupt", f"verify: {exc}")
            return {"snapshot": snapshot_id, "ok": False, "reason": str(exc)}
        return {"snapshot": snapshot_id, "ok": True, "bytes": verified, "status": row.status}

    def snapshot_evict(self, snapshot_id: str) -> dict[str, Any]:
        """Remove the local copy (refused while a restore reads it)."""
        self.catalog.snapshot(snapshot_id)  # SnapshotNotFound for an unknown id
        return {"snapshot": snapshot_id, "evicted": self.store.remove(snapshot_id)}

    def publish(self, snapshot_id: str) -> None:
        """Move the cluster summary for this snapshot's model (best effort: Consul may be down;
        the summary only moves forward, so a later publish catches up)."""
        if self.summary is None:
            return
        row = self.catalog.snapshot(snapshot_id)
        try:
            self.summary.publish(row.model_name, snapshot_id, row.status,
                                 durable=row.remote_uri is not None, node=self.node_id,
                                 updated_s=row.updated_s)
        except (RewarmError, OSError) as exc:
            log.warning("snapshot summary for %s not published: %s", row.model_name, exc)

    def snapshot_durable(self, model: str) -> bool:
        """A ready snapshot that survives this node: pushed remotely (or, with no remote tier
        configured, ready locally)."""
        if self.remote_root is None:
            return any(True for _ in self.catalog.snapshots(model, status="ready"))
        return self.catalog.durable_ready(model)
