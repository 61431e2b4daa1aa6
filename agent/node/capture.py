"""First-boot capture: snapshot a warmed replica, prove the snapshot, only then mark it ready.

Sequence (docs/architecture.md, "Verification: fail closed": every new snapshot replays a
fixed golden prompt set with a fixed seed before it is marked ready):

1. make room in the local tier (eviction by expected reuse; DiskFull when it cannot);
2. the serving replica writes the snapshot atomically (``<dest>.partial`` → rename);
3. a ``pending`` catalog row is added with the manifest's pins, size and digest;
4. a scratch zygote restores it, running the golden check, and is shut down;
5. ``ready`` (or ``corrupt`` with the reason, and the local copy removed);
6. ready snapshots are pushed to the remote tier when one is configured; the remote URI makes
   the snapshot *durable* (the scale-in guard of the "idle-timeout race").

Serving never waits on this: the agent runs it on a background thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import time
from pathlib import Path

from agent.errors import DiskFull, GoldenMismatch, RewarmError, SnapshotError
from agent.node.backend import Backend, ModelSpec, Replica
from agent.snapshot.catalog import Catalog, SnapshotRow
from agent.snapshot.format import MANIFEST_NAME
from agent.snapshot.reader import read_manifest
from agent.snapshot.store import LocalStore, dir_size_bytes

log = logging.getLogger(__name__)


def new_snapshot_id(spec: ModelSpec) -> str:
    return f"{spec.name}-{spec.version}-{time.time_ns():x}"


def manifest_digest(snapshot_dir: Path) -> str:
    """``sha256:<hex>`` of the manifest file (it covers every chunk's checksum)."""
    return "sha256:" + hashlib.sha256((Path(snapshot_dir) / MANIFEST_NAME).read_bytes()).hexdigest()


def register_snapshot(catalog: Catalog, store: LocalStore, snapshot_id: str, spec: ModelSpec,
                      *, remote_uri: str | None = None) -> SnapshotRow:
    """Add a ``pending`` row (and the local-tier entry) for a snapshot present in the store.
    Raises what read_manifest raises (SnapshotCorrupt, SnapshotTampered)."""
    path = store.path(snapshot_id)
    manifest = read_manifest(path)
    row = catalog.add_snapshot(
        snapshot_id, model_name=spec.name, model_version=spec.version, path=str(path),
        pins=dataclasses.asdict(manifest.pins), size_bytes=dir_size_bytes(path),
        digest=manifest_digest(path), remote_uri=remote_uri)
    store.add(snapshot_id, spec.key, row.size_bytes)
    return row


def verify_in_scratch(backend: Backend, snapshot: Path, device: str) -> None:
    """Restore ``snapshot`` into a fresh zygote (golden check inside), then drop it.
    Raises SnapshotError, GoldenMismatch, or what the zygote raises."""
    zygote = backend.zygote(device)
    try:
        replica = zygote.restore(snapshot, replica_id="scratch")
    except BaseException:
        zygote.kill()
        raise
    replica.shutdown()


def push_remote(snapshot_dir: Path, remote_root: Path) -> str:
    """Copy a ready snapshot to the remote tier; returns its remote URI (a path)."""
    from agent.snapshot import remote

    result = remote.push(Path(snapshot_dir), Path(remote_root))
    return str(result if result is not None else Path(remote_root) / Path(snapshot_dir).name)


def capture_first_boot(replica: Replica, spec: ModelSpec, *, catalog: Catalog, store: LocalStore,
                       backend: Backend, device: str, remote_root: Path | None = None,
                       estimate_bytes: int | None = None) -> SnapshotRow:
    """Run steps 1–6 above; returns the final catalog row (status ready or corrupt).

    Raises DiskFull (no room even after eviction, or the write hit the disk limit) and what
    the replica's capture raises; in every raising case no ready row and no partial directory
    are left behind.
    """
    snapshot_id = new_snapshot_id(spec)
    dest = store.path(snapshot_id)
    store.make_room(estimate_bytes if estimate_bytes is not None else _weights_bytes(spec))
    try:
        replica.capture(dest)
    except BaseException:
        shutil.rmtree(dest.with_name(dest.name + ".partial"), ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)
        raise
    try:
        row = register_snapshot(catalog, store, snapshot_id, spec)
    except SnapshotError:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    try:
        with store.reading(snapshot_id) as path:
            verify_in_scratch(backend, path, device)
    except (SnapshotError, GoldenMismatch, RewarmError, RuntimeError, OSError) as exc:
        log.error("snapshot %s failed its verification restore: %s", snapshot_id, exc)
        catalog.set_status(snapshot_id, "corrupt", f"verification restore: {exc}")
        store.remove(snapshot_id)
        return catalog.snapshot(snapshot_id)
    row = catalog.set_status(snapshot_id, "ready", "verified by restore and golden check")
    if remote_root is not None:
        try:
            catalog.set_remote(snapshot_id, push_remote(dest, remote_root))
        except (OSError, SnapshotError, ImportError) as exc:
            log.warning("snapshot %s ready locally but not pushed to %s: %s", snapshot_id,
                        remote_root, exc)
        row = catalog.snapshot(snapshot_id)
    return row


def _weights_bytes(spec: ModelSpec) -> int:
    """Room to ask for before a capture: the checkpoint's safetensors bytes (runtime-layout
    weights are the same tensors), plus one page for the manifest."""
    files = list(Path(spec.model_dir).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) + 4096


__all__ = ["capture_first_boot", "register_snapshot", "verify_in_scratch", "push_remote",
           "manifest_digest", "new_snapshot_id", "DiskFull"]
