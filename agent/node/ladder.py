"""The node agent's restore ladder: how ``restore(model)`` brings a replica up, and the
capture that follows a cold boot.

Every step fails closed; the caller sees a slower start, never wrong tokens::

    newest ready local snapshot ──ok──► warm, registered
        │ pins differ → stale (a remote copy has the same pins: go to cold boot)
        │ checksum / signature / golden mismatch → corrupt;  out of memory, timeout, zygote
        │ died, with every chunk verified → transient: the snapshot stays ready and local
        ▼
    remote copy of that snapshot ── stage (verify every chunk) → restore ──ok──► warm
        │ fails → corrupt/stale
        ▼
    cold boot from the checkpoint (+ AOT package) ──► warm;  capture in the background
    (agent/node/capture.py) when no ready snapshot of this version remains

:class:`RestoreLadder` works on the agent's named state (agent/node/state.py): it adds a
replica record, moves it through :class:`~agent.node.lifecycle.Lifecycle` and registers it
when warm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

from agent.errors import (ConfigError, CudaCheckpointError, DiskFull, GoldenMismatch,
                          NoCapacity, RewarmError, SnapshotCorrupt, SnapshotError,
                          SnapshotIncompatible, SnapshotNotFound)
from agent.node import capture as cap
from agent.node.backend import Backend, ModelSpec, new_replica_id
from agent.node.bounded import call_within
from agent.node.capacity import NodeCapacity
from agent.node.lifecycle import Lifecycle, ReplicaState as S
from agent.node.metrics import NodeMetrics
from agent.node.pool import ZygotePool
from agent.node.snapshots import Snapshots
from agent.node.state import NodeState, ReplicaRecord
from agent.progress import byte_callback
from agent.snapshot.catalog import SnapshotRow
from agent.snapshot.pins import check_pins
from agent.snapshot.reader import read_manifest, verify_chunks

log = logging.getLogger("agent.node.agent")


class _Failed(Exception):
    def __init__(self, exc: BaseException, status: str) -> None:
        self.exc, self.status = exc, status


def _classify(exc: BaseException, snapshot: Path) -> str:
    """corrupt: the bytes, or the state they hold, are wrong; stale: not usable here (its
    pins differ); transient: the failure was not the snapshot's (out of memory, a killed
    zygote, a timeout) and it is kept as it is.

    An error that does not say (a worker's answer, a dead zygote, a timeout, MemoryError) is
    settled by re-reading every chunk of the local copy: only a failed verification condemns
    a snapshot."""
    if isinstance(exc, (SnapshotCorrupt, GoldenMismatch)):
        return "corrupt"
    if isinstance(exc, SnapshotIncompatible):
        return "stale"
    try:
        verify_chunks(snapshot, read_manifest(snapshot))
    except SnapshotError:
        return "corrupt"
    except (OSError, MemoryError) as again:
        # the re-read could not run (the same memory shortage, no descriptors left): that
        # says nothing about the bytes either, and must not end the ladder before a cold boot
        log.warning("verifying %s after a failed restore could not run (%s: %s); kept as "
                    "it is", snapshot, type(again).__name__, again)
    return "transient"


def check_package_current(manifest, snapshot: Path) -> None:
    """Raise SnapshotIncompatible when the AOT package ``manifest`` was captured with has been
    replaced: its directory now holds a package of another digest (``rewarm up`` rebuilds a
    package compiled from other forward code in place, agent/up.py ``prepare_release``).  Such
    a snapshot can never restore here (the worker refuses the digest), so it is stale, like one
    whose pins differ: the ladder cold-boots and captures a snapshot of the new package instead
    of cold-booting at every scale-up while the old one stays "ready".  A package that is gone,
    or unreadable, is left to the restore (it then serves eager, which the golden check
    guards)."""
    from agent.errors import InvalidCheckpoint
    from agent.replica.aot import read_package_manifest

    extra = manifest.extra if isinstance(manifest.extra, dict) else {}
    ref = extra.get("aot_package")
    if not isinstance(ref, dict) or not isinstance(ref.get("dir"), str):
        return
    try:
        current = read_package_manifest(Path(ref["dir"])).get("digest")
    except (InvalidCheckpoint, OSError):
        return
    if current != ref.get("digest"):
        raise SnapshotIncompatible(
            f"{snapshot}: captured with the AOT package {ref.get('digest')} in {ref['dir']}, "
            f"which now holds {current} (rebuilt): the snapshot is stale",
            path=snapshot, mismatches={"aot_package": (ref.get("digest"), current)})


class RestoreLadder:
    """Brings replicas up on ``state``'s node: zygotes from ``zygotes``, cold boots and
    scratch verification through ``backend``, captures on ``executor``, snapshot status
    published through ``snapshots``, each outcome counted in ``metrics``.  ``refill()``
    refills the zygote pool in the background after each attempt; ``drain(replica_id,
    force=True)`` stops a replica that came up while the agent closes; ``sleep`` waits
    between polls (seconds; tests pass a fake)."""

    def __init__(self, state: NodeState, *, zygotes: ZygotePool, backend: Backend,
                 snapshots: Snapshots, metrics: NodeMetrics, executor: Executor,
                 refill: Callable[[], None], drain: Callable[..., dict[str, Any]],
                 sleep: Callable[[float], None], capacity: NodeCapacity | None = None) -> None:
        self.state, self.zygotes, self.backend = state, zygotes, backend
        self.capacity = capacity or NodeCapacity(state, backend)
        self.snapshots, self.metrics, self.executor = snapshots, metrics, executor
        self._refill, self._drain, self._sleep = refill, drain, sleep

    def _device(self, device: str | None) -> str:
        """``device`` checked against the inventory; None: the device hosting the fewest
        replicas that are not dead (a GPU serves one at speed; ties go to the lowest index).
        Chosen again under the lock when the record is added (:meth:`restore`)."""
        devices = self.state.inventory.devices
        if device is None:
            with self.state.lock:
                hosted = [r.device for r in self.state.replicas.values()
                          if r.lifecycle.state is not S.DEAD]
            return min(devices, key=lambda d: (hosted.count(d), devices.index(d)))
        if device not in devices:
            raise ConfigError(f"device {device!r} not on this node; devices: {devices}",
                              name="device", value=device, limit=devices)
        return device

    def restore(self, model: str, device: str | None = None) -> dict[str, Any]:
        """Bring up one warm replica of ``model`` (ladder in the module docstring).

        Returns the replica's description with its ``load`` (``path``: restore |
        staged_restore | cold_boot, ``attempts``: each failed step with its reason).  When
        the node already has ``max_replicas_per_model`` of the model coming up or warm, no
        new one starts: the answer is the first of them to be warm, with ``path`` ``warm``
        (a second replica on the same cores would only compete with the first).  The same
        holds when the node runs every replica its cores or devices serve at speed
        (:class:`~agent.node.capacity.NodeCapacity`); with none of ``model`` up then, it is
        refused at once.  Raises ModelNotFound, ConfigError, NoCapacity (the node full with
        none of the model up, naming the limit; at the cap and none warm within
        ``restore_timeout_s``), and what a cold boot raises when even that fails.
        """
        spec, asked = self.state.spec(model), device
        device = self._device(device)
        rid = new_replica_id(self.state.config.node_id)
        rec = ReplicaRecord(Lifecycle(rid, clock=self.state.clock), spec, device)
        with self.state.lock:
            if self.state.closing:
                raise self._closing_error(model)
            full = self.capacity.full(model)
            if full is not None and not self.capacity.up(model):
                raise full            # nothing of this model to wait for: refused at once
            at_cap = full is not None or self._at_cap(model)
            if not at_cap:
                if asked is None:              # chosen again, now that the choice stands
                    rec.device = self._device(None)
                self.state.replicas[rid] = rec
                self.state.restoring += 1
        if at_cap:
            return self._wait_warm(model)
        try:
            return self._bring_up(rec, spec)
        finally:
            with self.state.lock:
                self.state.restoring -= 1
                self.state.restores_done.notify_all()

    def _bring_up(self, rec: ReplicaRecord, spec: ModelSpec) -> dict[str, Any]:
        rid = rec.lifecycle.replica_id
        self.state.record(rec)
        start = self.state.clock.now()
        try:
            self._ladder(rec)
        except BaseException as exc:
            if rec.lifecycle.state is not S.DEAD:
                rec.lifecycle.move(S.DEAD, "every way up failed")
            self.state.record(rec)
            self.metrics.restore_finished(rec, self.state.clock.now() - start, False,
                                          reason=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self.state.phase(rec, None)
            self._refill()
        took_s = self.state.clock.now() - start
        self.state.catalog.record_cold_start(spec.name, rec.path, "ok", took_s, rid)
        self._go_warm(rec)
        if self.state.closing:     # close() began while it came up, and waits for it: stop it
            self._drain(rid, force=True)
            raise self._closing_error(spec.name)
        out = rec.describe(load=True)      # keeps the stats it read in rec.last_stats
        capacity = self.capacity.answer()
        if capacity is not None:
            out["capacity"] = capacity
        self.metrics.restore_finished(rec, took_s, True, self.state.catalog)
        return out

    def _closing_error(self, model: str) -> NoCapacity:
        return NoCapacity(f"model {model!r}: node {self.state.config.node_id} is closing; no "
                          f"replica starts on it", model=model)

    def _at_cap(self, model: str) -> bool:
        """Whether ``model`` has ``max_replicas_per_model`` replicas coming up or warm (call
        with the lock held)."""
        cap_n = self.state.config.max_replicas_per_model
        if cap_n is None:
            return False
        up = (S.COLD, S.RESTORING, S.WARM)
        return sum(1 for r in self.state.replicas.values()
                   if r.spec.name == model and r.lifecycle.state in up) >= cap_n

    def _wait_warm(self, model: str) -> dict[str, Any]:
        """At the cap: the first of ``model``'s replicas to be warm, described with path
        ``warm``; a fresh restore if they have all gone meanwhile."""
        deadline = self.state.clock.now() + self.state.config.restore_timeout_s
        while True:
            with self.state.lock:
                warm = [r for r in self.state.replicas.values()
                        if r.spec.name == model and r.lifecycle.state is S.WARM]
                # at the model's cap, or the node is full and one of the model's comes up
                at_cap = self._at_cap(model) or (self.capacity.full(model) is not None
                                                 and self.capacity.up(model) > 0)
            if warm:
                return {**warm[0].describe(load=True), "path": "warm"}
            if not at_cap:
                return self.restore(model)
            if self.state.clock.now() >= deadline:
                raise NoCapacity(f"model {model!r}: node {self.state.config.node_id} is at "
                                 f"max_replicas_per_model({self.state.config.max_replicas_per_model})"
                                 f" and none became warm within restore_timeout_s"
                                 f"({self.state.config.restore_timeout_s})", model=model)
            self._sleep(self.state.config.replica_wait_poll_s)

    def _ladder(self, rec: ReplicaRecord) -> None:
        spec = rec.spec
        row = self.state.catalog.newest_ready(spec.name, spec.version)
        try_remote = row is not None and row.remote_uri is not None
        if row is not None and self.state.store.has(row.snapshot_id):
            if self._try_restore(rec, row, "restore"):
                return
            # the remote copy has the same pins, and after a transient fault the same bytes
            try_remote = try_remote and rec.attempts[-1]["status"] not in ("stale-pins",
                                                                          "transient")
        if try_remote and row is not None:
            staged = self._stage(rec, row)
            if staged is not None and self._try_restore(rec, staged, "staged_restore"):
                self.state.catalog.set_status(staged.snapshot_id, "ready", "staged and restored")
                self.snapshots.publish(staged.snapshot_id)
                return
            if staged is not None and rec.attempts[-1]["status"] == "transient":
                # staged and verified, then a fault that was not the snapshot's: keep it
                self.state.catalog.set_status(staged.snapshot_id, "ready",
                                              "staged and verified; its restore failed "
                                              "transiently")
                self.snapshots.publish(staged.snapshot_id)
        self._cold_boot(rec)

    def _try_restore(self, rec: ReplicaRecord, row: SnapshotRow, path: str) -> bool:
        rec.lifecycle.move(S.RESTORING, f"{path} {row.snapshot_id}")
        self.state.phase(rec, "restore")
        self.state.record(rec, row.snapshot_id)
        zygote = self.zygotes.take(rec.device, rec.spec.name)
        if rec.device == "cpu":
            # the next restore's zygote warms while this one restores (at background
            # priority), not after it: back-to-back scale-ups found none ready and each
            # started its own process inside its restore (5-6 s against about 1 s).  On a
            # GPU it starts when this restore is over (_bring_up's refill): a zygote making
            # its CUDA context, zeroing its device buffer and running its warm-up kernels on
            # the GPU being restored to would share the device with this restore's reads,
            # golden check and first token, and a GPU serves one replica
            # (agent/node/capacity.py), so no second restore onto it waits for that zygote.
            self._refill()
        try:
            with self.state.store.reading(row.snapshot_id) as snap:
                try:
                    manifest = read_manifest(snap)
                    check_pins(manifest.pins, self.state.inventory.pins(rec.device), snap)
                    check_package_current(manifest, snap)
                    handle = call_within(lambda: zygote.restore(snap, rec.lifecycle.replica_id),
                                      self.state.config.restore_timeout_s, "restore")
                except (SnapshotError, GoldenMismatch, CudaCheckpointError, OSError,
                        RuntimeError, RewarmError, MemoryError) as exc:
                    zygote.kill()
                    status = _classify(exc, snap)
                    raise _Failed(exc, status) from exc
        except SnapshotNotFound as gone:
            # evicted from the local tier after the ladder saw it (another restore's staging
            # made room): nothing is wrong with the snapshot; its remote copy or a cold boot
            zygote.kill()
            log.warning("%s of %s from %s: the local copy went away before it was read (%s)",
                        path, rec.spec.key, row.snapshot_id, gone)
            rec.attempts.append({"path": path, "snapshot": row.snapshot_id, "status": "evicted",
                                 "error": type(gone).__name__, "reason": str(gone)})
            rec.lifecycle.move(S.COLD, f"{path} failed: {type(gone).__name__}")
            return False
        except _Failed as failed:
            err, status = failed.exc, failed.status
            log.error("%s of %s from %s failed closed (%s): %s", path, rec.spec.key,
                      row.snapshot_id, status, err, extra={"model": rec.spec.name,
                      "replica": rec.lifecycle.replica_id, "snapshot": row.snapshot_id})
            if status != "transient":   # a fault that was not the snapshot's keeps it
                if row.status in ("pending", "ready"):
                    self.state.catalog.set_status(row.snapshot_id, status,
                                                  f"{type(err).__name__}: {err}")
                    self.snapshots.publish(row.snapshot_id)
                self.state.store.remove(row.snapshot_id)
            rec.attempts.append({"path": path, "snapshot": row.snapshot_id,
                                 "status": "stale-pins" if isinstance(err, SnapshotIncompatible)
                                 else status, "error": type(err).__name__, "reason": str(err)})
            self.state.catalog.record_cold_start(rec.spec.name, path,
                                                 f"failed: {type(err).__name__}", 0.0,
                                                 rec.lifecycle.replica_id)
            rec.lifecycle.move(S.COLD, f"{path} failed: {type(err).__name__}")
            return False
        rec.handle, rec.snapshot_id, rec.path = handle, row.snapshot_id, path
        fallback = getattr(handle, "fallback", None)     # set by a GPU zygote's restore
        if fallback:
            log.warning("%s of %s onto %s read through host memory: the device read failed (%s)",
                        path, rec.spec.key, rec.device, fallback,
                        extra={"model": rec.spec.name, "replica": rec.lifecycle.replica_id})
        self.state.store.record_restore(rec.spec.key)
        return True

    def _stage(self, rec: ReplicaRecord, row: SnapshotRow) -> SnapshotRow | None:
        """Copy the remote tier's copy of ``row`` into the local tier as a new pending row."""
        from agent.snapshot import remote

        # Same id until a staged copy is registered, so an interrupted stage resumes.
        prefix = f"{row.snapshot_id}.s"
        k = sum(1 for r in self.state.catalog.snapshots(rec.spec.name) if r.snapshot_id.startswith(prefix))
        sid = f"{prefix}{k}"
        dest = self.state.store.path(sid)
        self.state.phase(rec, "stage")

        shown, close_bar = byte_callback(f"stage {row.snapshot_id}")

        def progress(done_bytes: int, total_bytes: int) -> None:
            with self.state.lock:
                self.state.staging[sid] = (done_bytes, total_bytes)
            shown(done_bytes, total_bytes)

        try:
            self.state.store.make_room(row.size_bytes)
            try:
                remote.stage(Path(str(row.remote_uri)), dest, progress)
            finally:
                close_bar()
            with self.state.lock:
                self.state.staging.pop(sid, None)
            return cap.register_snapshot(self.state.catalog, self.state.store, sid, rec.spec,
                                         remote_uri=row.remote_uri)
        except (SnapshotError, OSError, RewarmError) as exc:
            log.error("staging %s from %s failed: %s", row.snapshot_id, row.remote_uri, exc)
            with self.state.lock:
                self.state.staging.pop(sid, None)
            rec.attempts.append({"path": "stage", "snapshot": row.snapshot_id,
                                 "status": "failed", "error": type(exc).__name__,
                                 "reason": str(exc)})
            if self.state.store.has(sid):
                self.state.store.remove(sid, force=True)
            return None

    def _cold_boot(self, rec: ReplicaRecord) -> None:
        self.state.phase(rec, "cold_boot")
        rec.handle = self.backend.cold_boot(rec.spec, rec.device, rec.lifecycle.replica_id)
        rec.path = "cold_boot"
        if self.state.catalog.newest_ready(rec.spec.name, rec.spec.version) is None:
            self.start_capture(rec)

    def _go_warm(self, rec: ReplicaRecord) -> None:
        rec.lifecycle.move(S.WARM, rec.path)
        self.state.record(rec)
        self.state.registrar.want(self.state.replica_instance(rec))
        self.state.registrar.update_meta(self.state.agent_id, self.state.agent_meta())

    # -- capture -----------------------------------------------------------------------------
    def start_capture(self, rec: ReplicaRecord) -> Future:
        """Capture ``rec`` on the background executor (once per model version at a time)."""
        key = rec.spec.key
        with self.state.lock:
            running = self.state.captures.get(key)
            if running is not None and not running.done():
                return running
            future = self.executor.submit(self._capture, rec)
            self.state.captures[key] = future
            return future

    def _capture(self, rec: ReplicaRecord) -> SnapshotRow | None:
        assert rec.handle is not None, "captured once it serves"
        try:
            row = cap.capture_first_boot(rec.handle, rec.spec, catalog=self.state.catalog,
                                         store=self.state.store, backend=self.backend,
                                         device=rec.device, remote_root=self.state.config.remote_root)
            self.snapshots.publish(row.snapshot_id)
            self._refill()   # zygotes warmed for the new snapshot
            return row
        except (DiskFull, SnapshotError, OSError, RewarmError, RuntimeError) as exc:
            log.error("capture of %s failed; it keeps serving and the next cold boot tries "
                      "again: %s", rec.spec.key, exc)
            return None
