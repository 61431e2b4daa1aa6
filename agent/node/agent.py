"""The node agent: owns this node's replicas and snapshots and makes restores fast and safe.

Restore ladder for ``restore(model)`` (every step fails closed; the caller sees a slower
start, never wrong tokens), after the suspended tier (a parked replica of the model is
resumed instead, agent/node/suspend.py)::

    newest ready local snapshot ──ok──► warm, registered
        │ pins differ → stale (a remote copy has the same pins: go to cold boot)
        │ checksum / signature / golden mismatch → corrupt;  timeout, zygote died → stale
        ▼
    remote copy of that snapshot ── stage (verify every chunk) → restore ──ok──► warm
        │ fails → corrupt/stale
        ▼
    cold boot from the checkpoint (+ AOT package) ──► warm;  capture in the background
    (agent/node/capture.py) when no ready snapshot of this version remains

Zygotes per device are kept at ``zygotes_per_device`` per replica the device hosts
(:meth:`NodeAgent.pool_target`) by :meth:`NodeAgent.refill_pool` (agent/node/pool.py), run
on the background executor after each restore and each capture.  :meth:`tick` (the agent loop, clock-injected)
keeps registrations and TTLs current.  Replica states move only through
:class:`~agent.node.lifecycle.Lifecycle`.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

from agent.clock import Clock, SystemClock
from agent.cluster.base import LOAD_META_KEYS, Registry, ServiceInstance
from agent.errors import (ConfigError, CudaCheckpointError, DiskFull, GoldenMismatch,
                          ModelNotFound, NoCapacity, ReplicaNotFound, RewarmError,
                          SnapshotCorrupt, SnapshotError, SnapshotIncompatible)
from agent.node import capture as cap
from agent.node.backend import Backend, ModelSpec, Replica, new_replica_id
from agent.node.inventory import Inventory
from agent.node.lifecycle import Lifecycle, ReplicaState as S
from agent.node.metrics import NodeMetrics, restores_in_flight
from agent.node.pool import ZygotePool
from agent.node.registration import Registrar
from agent.node.snapshots import SnapshotOps
from agent.node.suspend import ParkedTier, Suspender, SuspendOps, _bounded
from agent.progress import byte_callback
from agent.snapshot.catalog import Catalog, SnapshotRow
from agent.snapshot.pins import check_pins
from agent.snapshot.reader import read_manifest, verify_chunks
from agent.snapshot.store import LocalStore
from agent.speed import QUEUE_META_KEYS, SPEED_META_KEYS

log = logging.getLogger(__name__)

LOAD_KEYS = LOAD_META_KEYS
"""A replica's load as its worker's ``stats`` reports it, in the front door's router's keys."""
QUEUE_KEYS = QUEUE_META_KEYS
"""Its queue (ints; agent/speed.py), reported beside the load when the worker gives them."""
SPEED_KEYS = SPEED_META_KEYS
"""Its measured speed (floats; agent/speed.py), absent until the replica has measured itself."""


class SnapshotSummary(Protocol):
    """The cluster-wide per-model summary (agent/cluster/consul_kv.py's SnapshotKV)."""

    def publish(self, model: str, snapshot_id: str, status: str, *, durable: bool,
                node: str = "", updated_s: float = 0.0) -> bool: ...


class NodeMetadata(Protocol):
    """Where the node's cached models are published for placement (Nomad dynamic node
    metadata: agent/cluster/node_meta.py's SnapshotMetadata); posts only on a change."""

    def update(self, models: list[str]) -> bool: ...


class ScaleInBlocked(RewarmError, RuntimeError):
    """Draining would remove the last replica of a model with no ready, durable snapshot.
    Attributes: ``model``, ``replica``."""

    code = 409


@dataclass
class AgentConfig:
    """Per-node settings; ``*_s`` in seconds, ``*_bytes`` in bytes."""

    node_id: str
    zygotes_per_device: int = 1
    restore_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    drain_poll_s: float = 0.05
    remote_root: Path | None = None
    control_address: str = "127.0.0.1"
    control_port: int = 0
    max_replicas_per_model: int | None = None   # None: no cap on this node
    replica_wait_poll_s: float = 0.1

    def __post_init__(self) -> None:
        for name in ("restore_timeout_s", "drain_timeout_s", "drain_poll_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0", name=name,
                                  value=getattr(self, name), limit=0)
        if self.max_replicas_per_model is not None and self.max_replicas_per_model < 1:
            raise ConfigError(f"max_replicas_per_model={self.max_replicas_per_model} must be "
                              ">= 1 (or None for no cap)", name="max_replicas_per_model",
                              value=self.max_replicas_per_model, limit=1)
        if self.zygotes_per_device < 0:
            raise ConfigError(f"zygotes_per_device={self.zygotes_per_device} must be >= 0",
                              name="zygotes_per_device", value=self.zygotes_per_device, limit=0)


@dataclass
class ReplicaRecord:
    lifecycle: Lifecycle
    spec: ModelSpec
    device: str
    handle: Replica | None = None
    snapshot_id: str | None = None
    path: str = ""                      # restore | staged_restore | cold_boot
    attempts: list[dict] = field(default_factory=list)
    phase: str | None = None            # while coming up: stage | restore | cold_boot
    phase_since_s: float = 0.0
    last_stats: dict = field(default_factory=dict)   # the worker's stats at the last tick

    def describe(self, *, load: bool = False) -> dict[str, Any]:
        """The replica as the control API reports it.  With ``load`` (and a running
        handle) adds ``load``: its ``max_seqs``, ``active_seqs``, ``kv_capacity_tokens`` and
        ``kv_used_tokens`` (ints, KV in tokens), so a front door can route to it at once
        instead of waiting for the registry to show it."""
        out = {"replica": self.lifecycle.replica_id, "model": self.spec.name,
               "version": self.spec.version, "device": self.device,
               "state": self.lifecycle.state.value, "snapshot": self.snapshot_id,
               "path": self.path, "address": self.handle.address if self.handle else None,
               "attempts": self.attempts}
        if self.phase is not None:
            out["phase"] = self.phase
        for key in ("restore_io", "fallback"):    # gds | compat | host; why it read via host
            if getattr(self.handle, key, None):
                out[key] = getattr(self.handle, key)
        if load and self.handle is not None:
            try:
                stats = self.last_stats = self.handle.stats()
            except (OSError, RewarmError, RuntimeError):
                stats = {}
            if all(k in stats for k in LOAD_KEYS):
                out["load"] = _load_report(stats)
        return out


class _Failed(Exception):
    def __init__(self, exc: BaseException, status: str) -> None:
        self.exc, self.status = exc, status


def _classify(exc: BaseException, snapshot: Path) -> str:
    """corrupt: the bytes, or the state they hold, are wrong; stale: not usable here or now.

    An error that does not say (a worker's answer, a dead zygote, a timeout) is settled by
    re-reading every chunk of the local copy."""
    if isinstance(exc, (SnapshotCorrupt, GoldenMismatch)):
        return "corrupt"
    if isinstance(exc, SnapshotIncompatible):
        return "stale"
    try:
        verify_chunks(snapshot, read_manifest(snapshot))
    except SnapshotError:
        return "corrupt"
    return "stale"


class NodeAgent(SnapshotOps, SuspendOps):
    """One per node. Thread-safe; blocking methods are called from the control server's threads."""

    def __init__(self, config: AgentConfig, *, models: list[ModelSpec], backend: Backend,
                 catalog: Catalog, store: LocalStore, registry: Registry, inventory: Inventory,
                 clock: Clock | None = None, suspender: Suspender | None = None,
                 executor: ThreadPoolExecutor | None = None,
                 sleep: Callable[[float], None] | None = None,
                 summary: SnapshotSummary | None = None,
                 node_meta: NodeMetadata | None = None,
                 metrics: NodeMetrics | None = None) -> None:
        import time

        self.config = config
        self.models = {m.name: m for m in models}
        self.backend, self.catalog, self.store = backend, catalog, store
        self.inventory = inventory
        self.clock = clock or SystemClock()
        self.registrar = Registrar(registry, clock=self.clock)
        self.suspender = suspender
        self.tier = ParkedTier()                # the suspended tier's registry view
        self.summary = summary
        self.node_meta = node_meta
        self.executor = executor or ThreadPoolExecutor(max_workers=2, thread_name_prefix="agent")
        self._sleep = sleep or time.sleep
        self._lock = threading.RLock()
        self.replicas: dict[str, ReplicaRecord] = {}
        self.zygotes = ZygotePool(backend, list(inventory.devices), target=self.pool_target,
                                  warm_for=self.warm_for)
        self.pool = self.zygotes.ready      # device -> ready zygotes
        self.captures: dict[str, Future] = {}
        self.staging: dict[str, tuple[int, int]] = {}   # snapshot id -> (bytes done, total)
        self.store.on_evict = self._evicted
        self.metrics = metrics or NodeMetrics(config.node_id)
        self.last_tick_s: float | None = None
        self.closing = False
        self._restoring = 0                     # restore() calls bringing a replica up
        self._restores_done = threading.Condition(self._lock)
        self._reconcile()
        self.agent_instance = ServiceInstance(
            "rewarm-agent", f"rewarm-agent-{config.node_id}", config.control_address,
            config.control_port, meta=self._agent_meta())
        self.registrar.want(self.agent_instance)
        self.metrics.attach(self)

    def _evicted(self, snapshot_id: str) -> None:
        self.metrics.evicted(snapshot_id)
        self._on_evict(snapshot_id)

    def _phase(self, rec: ReplicaRecord, phase: str | None) -> None:
        rec.phase, rec.phase_since_s = phase, self.clock.now()

    # -- zygote pool -------------------------------------------------------------------------
    def pool_target(self, device: str) -> int:
        """Zygotes kept ready on ``device``: ``zygotes_per_device`` per replica it hosts.  A
        GPU hosts one replica; the CPU device of a CPU-only node hosts up to
        ``max_replicas_per_model`` (one per core group), so it keeps one set per replica
        slot: a scale-up from zero to the cap restores every replica from a ready zygote
        instead of starting the second one's process inside its restore (seconds, measured
        in the trace replay: 5-24 s against 1.3-1.8 s with a zygote ready)."""
        slots = (self.config.max_replicas_per_model or 1) if device == "cpu" else 1
        return self.config.zygotes_per_device * slots

    def refill_pool(self) -> int:
        """Refill the zygote pool (agent/node/pool.py); returns how many zygotes started."""
        return self.zygotes.refill()

    def _refill_later(self) -> None:
        """:meth:`refill_pool` on the background executor, unless the agent is closing."""
        if self.closing:
            return
        try:
            self.executor.submit(self.refill_pool)
        except RuntimeError:   # the executor shut down meanwhile (close): no refill
            pass

    def warm_for(self, device: str) -> Path | None:
        """The snapshot a new zygote on ``device`` pays its first-call costs for
        (agent/replica/zygote.py ``warm_zygote``; nothing of it is trusted by the restore):
        the newest ready local snapshot of the model last restored there, else of the only
        model this agent serves; None when there is none."""
        name = self.zygotes.last_model.get(device)
        spec = self.models.get(name) if name else None
        if spec is None and len(self.models) == 1:
            spec = next(iter(self.models.values()))
        row = None if spec is None else self.catalog.newest_ready(spec.name, spec.version)
        if row is None or not self.store.has(row.snapshot_id):
            return None
        return self.store.path(row.snapshot_id)

    # -- restore -----------------------------------------------------------------------------
    def spec(self, model: str) -> ModelSpec:
        try:
            return self.models[model]
        except KeyError:
            raise ModelNotFound(f"model {model!r} is not configured on node "
                                f"{self.config.node_id}; models: {sorted(self.models)}",
                                model=model) from None

    def _device(self, device: str | None) -> str:
        """``device`` checked against the inventory; None: the device hosting the fewest
        replicas that are not dead (a GPU serves one at speed; ties go to the lowest index).
        Call with the lock held when the choice must stand (:meth:`restore`)."""
        devices = self.inventory.devices
        if device is None:
            with self._lock:
                hosted = [r.device for r in self.replicas.values()
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
        (a second replica on the same cores would only compete with the first).  Raises
        ModelNotFound, ConfigError, NoCapacity (at the cap and none warm within
        ``restore_timeout_s``), and what a cold boot raises when even that fails.
        """
        spec, asked = self.spec(model), device
        device = self._device(device)
        resumed = self.resume_parked(model)     # the suspended tier first: nothing to read
        if resumed is not None:
            return resumed
        rid = new_replica_id(self.config.node_id)
        rec = ReplicaRecord(Lifecycle(rid, clock=self.clock), spec, device)
        with self._lock:
            if self.closing:
                raise self._closing_error(model)
            if self._at_cap(model):
                rec = None
            else:
                if asked is None:                # chosen again, now that the choice stands
                    rec.device = self._device(None)
                self.replicas[rid] = rec
                self._restoring += 1
        if rec is None:
            return self._wait_warm(model)
        try:
            return self._bring_up(rec, spec)
        finally:
            with self._lock:
                self._restoring -= 1
                self._restores_done.notify_all()

    def _bring_up(self, rec: ReplicaRecord, spec: ModelSpec) -> dict[str, Any]:
        rid = rec.lifecycle.replica_id
        self._record(rec)
        start = self.clock.now()
        try:
            self._ladder(rec)
        except BaseException as exc:
            if rec.lifecycle.state is not S.DEAD:
                rec.lifecycle.move(S.DEAD, "every way up failed")
            self._record(rec)
            self.metrics.restore_finished(rec, self.clock.now() - start, False,
                                          reason=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._phase(rec, None)
            self._refill_later()
        took_s = self.clock.now() - start
        self.catalog.record_cold_start(spec.name, rec.path, "ok", took_s, rid)
        self._go_warm(rec)
        if self.closing:     # close() began while it came up, and waits for it: stop it
            self.drain(rid, force=True)
            raise self._closing_error(spec.name)
        out = rec.describe(load=True)      # keeps the stats it read in rec.last_stats
        self.metrics.restore_finished(rec, took_s, True, self.catalog)
        return out

    def _closing_error(self, model: str) -> NoCapacity:
        return NoCapacity(f"model {model!r}: node {self.config.node_id} is closing; no "
                          f"replica starts on it", model=model)

    def _at_cap(self, model: str) -> bool:
        """Whether ``model`` has ``max_replicas_per_model`` replicas coming up or warm (call
        with the lock held)."""
        cap_n = self.config.max_replicas_per_model
        if cap_n is None:
            return False
        up = (S.COLD, S.RESTORING, S.WARM)
        return sum(1 for r in self.replicas.values()
                   if r.spec.name == model and r.lifecycle.state in up) >= cap_n

    def _wait_warm(self, model: str) -> dict[str, Any]:
        """At the cap: the first of ``model``'s replicas to be warm, described with path
        ``warm``; a fresh restore if they have all gone meanwhile."""
        deadline = self.clock.now() + self.config.restore_timeout_s
        while True:
            with self._lock:
                warm = [r for r in self.replicas.values()
                        if r.spec.name == model and r.lifecycle.state is S.WARM]
                at_cap = self._at_cap(model)
            if warm:
                return {**warm[0].describe(load=True), "path": "warm"}
            if not at_cap:
                return self.restore(model)
            if self.clock.now() >= deadline:
                raise NoCapacity(f"model {model!r}: node {self.config.node_id} is at "
                                 f"max_replicas_per_model({self.config.max_replicas_per_model})"
                                 f" and none became warm within restore_timeout_s"
                                 f"({self.config.restore_timeout_s})", model=model)
            self._sleep(self.config.replica_wait_poll_s)

    def _ladder(self, rec: ReplicaRecord) -> None:
        spec = rec.spec
        row = self.catalog.newest_ready(spec.name, spec.version)
        try_remote = row is not None and row.remote_uri is not None
        if row is not None and self.store.has(row.snapshot_id):
            if self._try_restore(rec, row, "restore"):
                return
            try_remote = try_remote and rec.attempts[-1]["status"] != "stale-pins"
        if try_remote:
            staged = self._stage(rec, row)
            if staged is not None and self._try_restore(rec, staged, "staged_restore"):
                self.catalog.set_status(staged.snapshot_id, "ready", "staged and restored")
                self.publish(staged.snapshot_id)
                return
        self._cold_boot(rec)

    def _try_restore(self, rec: ReplicaRecord, row: SnapshotRow, path: str) -> bool:
        rec.lifecycle.move(S.RESTORING, f"{path} {row.snapshot_id}")
        self._phase(rec, "restore")
        self._record(rec, row.snapshot_id)
        zygote = self.zygotes.take(rec.device, rec.spec.name)
        try:
            with self.store.reading(row.snapshot_id) as snap:
                try:
                    manifest = read_manifest(snap)
                    check_pins(manifest.pins, self.inventory.pins(rec.device), snap)
                    handle = _bounded(lambda: zygote.restore(snap, rec.lifecycle.replica_id),
                                      self.config.restore_timeout_s, "restore")
                except (SnapshotError, GoldenMismatch, CudaCheckpointError, OSError,
                        RuntimeError, RewarmError) as exc:
                    zygote.kill()
                    status = _classify(exc, snap)
                    raise _Failed(exc, status) from exc
        except _Failed as failed:
            exc, status = failed.exc, failed.status
            log.error("%s of %s from %s failed closed (%s): %s", path, rec.spec.key,
                      row.snapshot_id, status, exc, extra={"model": rec.spec.name,
                      "replica": rec.lifecycle.replica_id, "snapshot": row.snapshot_id})
            if row.status in ("pending", "ready"):
                self.catalog.set_status(row.snapshot_id, status, f"{type(exc).__name__}: {exc}")
                self.publish(row.snapshot_id)
            self.store.remove(row.snapshot_id)
            rec.attempts.append({"path": path, "snapshot": row.snapshot_id,
                                 "status": "stale-pins" if isinstance(exc, SnapshotIncompatible)
                                 else status, "error": type(exc).__name__, "reason": str(exc)})
            self.catalog.record_cold_start(rec.spec.name, path, f"failed: {type(exc).__name__}",
                                           0.0, rec.lifecycle.replica_id)
            rec.lifecycle.move(S.COLD, f"{path} failed: {type(exc).__name__}")
            return False
        rec.handle, rec.snapshot_id, rec.path = handle, row.snapshot_id, path
        if getattr(handle, "fallback", None):
            log.warning("%s of %s onto %s read through host memory: the device read failed (%s)",
                        path, rec.spec.key, rec.device, handle.fallback,
                        extra={"model": rec.spec.name, "replica": rec.lifecycle.replica_id})
        self.store.record_restore(rec.spec.key)
        return True

    def _stage(self, rec: ReplicaRecord, row: SnapshotRow) -> SnapshotRow | None:
        """Copy the remote tier's copy of ``row`` into the local tier as a new pending row."""
        from agent.snapshot import remote

        # Same id until a staged copy is registered, so an interrupted stage resumes.
        prefix = f"{row.snapshot_id}.s"
        k = sum(1 for r in self.catalog.snapshots(rec.spec.name) if r.snapshot_id.startswith(prefix))
        sid = f"{prefix}{k}"
        dest = self.store.path(sid)
        self._phase(rec, "stage")

        shown, close_bar = byte_callback(f"stage {row.snapshot_id}")

        def progress(done_bytes: int, total_bytes: int) -> None:
            with self._lock:
                self.staging[sid] = (done_bytes, total_bytes)
            shown(done_bytes, total_bytes)

        try:
            self.store.make_room(row.size_bytes)
            try:
                remote.stage(Path(row.remote_uri), dest, progress)
            finally:
                close_bar()
            with self._lock:
                self.staging.pop(sid, None)
            return cap.register_snapshot(self.catalog, self.store, sid, rec.spec,
                                         remote_uri=row.remote_uri)
        except (SnapshotError, OSError, RewarmError) as exc:
            log.error("staging %s from %s failed: %s", row.snapshot_id, row.remote_uri, exc)
            with self._lock:
                self.staging.pop(sid, None)
            rec.attempts.append({"path": "stage", "snapshot": row.snapshot_id,
                                 "status": "failed", "error": type(exc).__name__,
                                 "reason": str(exc)})
            if self.store.has(sid):
                self.store.remove(sid, force=True)
            return None

    def _cold_boot(self, rec: ReplicaRecord) -> None:
        self._phase(rec, "cold_boot")
        rec.handle = self.backend.cold_boot(rec.spec, rec.device, rec.lifecycle.replica_id)
        rec.path = "cold_boot"
        if self.catalog.newest_ready(rec.spec.name, rec.spec.version) is None:
            self.start_capture(rec)

    def _go_warm(self, rec: ReplicaRecord) -> None:
        rec.lifecycle.move(S.WARM, rec.path)
        self._record(rec)
        self.registrar.want(self._replica_instance(rec))
        self.registrar.update_meta(self.agent_instance.id, self._agent_meta())

    # -- capture -----------------------------------------------------------------------------
    def start_capture(self, rec: ReplicaRecord) -> Future:
        """Capture ``rec`` on the background executor (once per model version at a time)."""
        key = rec.spec.key
        with self._lock:
            running = self.captures.get(key)
            if running is not None and not running.done():
                return running
            future = self.executor.submit(self._capture, rec)
            self.captures[key] = future
            return future

    def _capture(self, rec: ReplicaRecord) -> SnapshotRow | None:
        try:
            row = cap.capture_first_boot(rec.handle, rec.spec, catalog=self.catalog,
                                         store=self.store, backend=self.backend,
                                         device=rec.device, remote_root=self.config.remote_root)
            self.publish(row.snapshot_id)
            self._refill_later()   # zygotes warmed for the new snapshot
            return row
        except (DiskFull, SnapshotError, OSError, RewarmError, RuntimeError) as exc:
            log.error("capture of %s failed; it keeps serving and the next cold boot tries "
                      "again: %s", rec.spec.key, exc)
            return None

    # -- drain, suspend, resume --------------------------------------------------------------
    def _rec(self, replica_id: str) -> ReplicaRecord:
        with self._lock:
            rec = self.replicas.get(replica_id)
        if rec is None:
            with self._lock:
                known = sorted(self.replicas)
            raise ReplicaNotFound(f"no replica {replica_id!r} on node {self.config.node_id}; "
                                  f"replicas: {known}", replica=replica_id,
                                  node=self.config.node_id, limit=known)
        return rec

    def live_replicas(self, model: str) -> list[ReplicaRecord]:
        with self._lock:
            return [r for r in self.replicas.values() if r.spec.name == model
                    and r.lifecycle.state in (S.WARM, S.SUSPENDED)]

    def drain(self, replica_id: str, timeout_s: float | None = None,
              force: bool = False) -> dict[str, Any]:
        """Stop new requests (deregister), wait up to ``timeout_s`` for in-flight ones, stop.

        Raises ScaleInBlocked when this is the model's last live replica and its snapshot is
        not ready and durable (unless ``force``, used at node shutdown).
        """
        rec = self._rec(replica_id)
        model = rec.spec.name
        others = [r for r in self.live_replicas(model) if r is not rec]
        if not force and not others and not self.snapshot_durable(model):
            raise ScaleInBlocked(
                f"replica {replica_id} is the last of {model} and no ready, durable snapshot "
                "exists yet; scale-in waits for the capture", model=model, replica=replica_id)
        rec.lifecycle.move(S.DRAINING, "drain")
        self.registrar.drop(replica_id)
        self._record(rec)
        bound = self.config.drain_timeout_s if timeout_s is None else timeout_s
        start = self.clock.now()
        while rec.handle is not None and rec.handle.in_flight() > 0:
            if self.clock.now() - start >= bound:
                log.warning("drain of %s: %d requests still in flight after %.1f s; stopping",
                            replica_id, rec.handle.in_flight(), bound)
                break
            self._sleep(self.config.drain_poll_s)
        left = rec.handle.in_flight() if rec.handle is not None else 0
        self._stop(rec, "drained")
        return {**rec.describe(), "in_flight_at_stop": left}

    def _stop(self, rec: ReplicaRecord, reason: str) -> None:
        if rec.handle is not None:
            try:
                rec.handle.shutdown()
            except (OSError, RewarmError, RuntimeError) as exc:
                log.warning("shutdown of %s: %s", rec.lifecycle.replica_id, exc)
        rec.lifecycle.move(S.DEAD, reason)
        self._record(rec)

    # -- loop, status, registration ------------------------------------------------------------
    def tick(self) -> None:
        """One pass of the agent loop: registrations and TTLs (with backoff), load meta."""
        for rec in self.live_replicas_all():
            alive = getattr(rec.handle, "alive", None)
            if alive is not None and not alive():
                log.error("replica %s: its process died; deregistering", rec.lifecycle.replica_id,
                          extra={"replica": rec.lifecycle.replica_id})
                self.registrar.drop(rec.lifecycle.replica_id)
                try:
                    rec.handle.shutdown()      # reaps the process, removes its socket file
                except (OSError, RewarmError, RuntimeError) as exc:
                    log.warning("cleaning up after %s: %s", rec.lifecycle.replica_id, exc)
                rec.lifecycle.move(S.DEAD, "process died")
                self._record(rec)
                continue
            if rec.lifecycle.state is S.WARM and rec.handle is not None:
                try:
                    stats = rec.handle.stats()
                except (OSError, RewarmError, RuntimeError):
                    continue
                rec.last_stats = stats
                self.registrar.update_meta(rec.lifecycle.replica_id, _load_meta(stats))
        self.registrar.update_meta(self.agent_instance.id, self._agent_meta())
        self.registrar.sync()
        self.last_tick_s = self.clock.now()
        if self.node_meta is not None:
            self.node_meta.update(self.cached_models())

    def cached_models(self) -> list[str]:
        """Models with a ready snapshot in this node's local tier (sorted names)."""
        return sorted({r.model_name for r in self.catalog.snapshots(status="ready")
                       if self.store.has(r.snapshot_id)})

    def run(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """The agent loop until ``stop`` is set (production; tests call :meth:`tick`)."""
        self.executor.submit(self.refill_pool)
        while not stop.wait(interval_s):
            try:
                self.tick()
            except Exception:  # the loop must outlive any one bad tick
                log.exception("agent tick failed")

    def live_replicas_all(self) -> list[ReplicaRecord]:
        with self._lock:
            return [r for r in self.replicas.values() if r.lifecycle.state in (S.WARM, S.SUSPENDED)]

    def status(self) -> dict[str, Any]:
        with self._lock:
            replicas = [r.describe() for r in self.replicas.values()
                        if r.lifecycle.state is not S.DEAD]
            pool = self.zygotes.counts()
            captures = sorted(k for k, f in self.captures.items() if not f.done())
            staging = {k: {"done_bytes": d, "total_bytes": t} for k, (d, t) in self.staging.items()}
            in_flight = restores_in_flight(self.replicas.values(), self.clock.now())
        st = self.registrar.state
        return {"node": self.config.node_id, "inventory": self.inventory.describe(),
                "replicas": replicas, "zygotes": pool, "captures_running": captures,
                "staging": staging, "restores_in_flight": in_flight,
                "models": {n: s.version for n, s in self.models.items()},
                "registry": {"healthy": st.healthy, "failures": st.failures,
                             "last_error": st.last_error},
                "store": {"used_bytes": self.store.used_bytes,
                          "capacity_bytes": self.store.capacity_bytes}}

    def close(self) -> None:
        """Drain everything (forced, all replicas at once so the whole drain takes at most
        ``drain_timeout_s``), deregister, stop the executor."""
        with self._lock:
            self.closing = True    # no restore starts now; those under way are waited for
            if not self._restores_done.wait_for(lambda: self._restoring == 0,
                                                timeout=self.config.restore_timeout_s):
                log.warning("node %s closing: %d restores still under way after %.0f s; "
                            "each stops its replica when it comes up", self.config.node_id,
                            self._restoring, self.config.restore_timeout_s)
        live = [r.lifecycle.replica_id for r in self.live_replicas_all()]
        if live:
            with ThreadPoolExecutor(max_workers=len(live), thread_name_prefix="drain") as pool:
                list(pool.map(lambda rid: self.drain(rid, force=True), live))
        self.registrar.drop(self.agent_instance.id)
        self.executor.shutdown(wait=True)
        self.zygotes.close()

    def _record(self, rec: ReplicaRecord, snapshot_id: str | None = None) -> None:
        self.catalog.upsert_replica(
            rec.lifecycle.replica_id, model_name=rec.spec.name, model_version=rec.spec.version,
            node_id=self.config.node_id, device=rec.device, state=rec.lifecycle.state.value,
            snapshot_id=snapshot_id or rec.snapshot_id)

    def _replica_instance(self, rec: ReplicaRecord) -> ServiceInstance:
        # The TCP data listener when the worker has one (front doors on other hosts).
        address = ((getattr(rec.handle, "data_address", None) or rec.handle.address)
                   if rec.handle is not None else "")
        host, _, port = address.rpartition(":")
        numeric = port.isdigit()
        stats = {}
        if rec.handle is not None:
            try:
                stats = rec.handle.stats()
            except (OSError, RewarmError, RuntimeError):
                stats = {}
        return ServiceInstance(
            "rewarm-replica", rec.lifecycle.replica_id, host if numeric else address,
            int(port) if numeric else 0,
            tags=[f"model={rec.spec.name}", f"version={rec.spec.version}"],
            # came_up: how this replica came up (restore, staged_restore, resume, cold_boot),
            # so a front door that scaled through Nomad learns which tier its wait measured
            meta={"address": address, "node": self.config.node_id, "came_up": rec.path or "",
                  **_load_meta(stats)})

    def _agent_meta(self) -> dict[str, str]:
        with self._lock:
            busy = {r.device for r in self.replicas.values()
                    if r.lifecycle.state not in (S.DEAD,) and r.device != "cpu"}
        free = [d for d in self.inventory.devices if d not in busy]
        cached = sorted({f"{r.model_name}@{r.model_version}"
                         for r in self.catalog.snapshots(status="ready")
                         if self.store.has(r.snapshot_id)})
        return {"node": self.config.node_id, "devices_free": ",".join(free),
                "snapshots": ",".join(cached), **self.tier_meta()}


def _load_report(stats: dict[str, Any]) -> dict[str, Any]:
    """The load, queue and (once measured, all or none) speed keys of a worker's ``stats``:
    ints, and floats for the speed."""
    out: dict[str, Any] = {k: int(stats[k]) for k in LOAD_KEYS + QUEUE_KEYS if k in stats}
    if all(k in stats for k in SPEED_KEYS):
        out.update({k: float(stats[k]) for k in SPEED_KEYS})
    return out


def _load_meta(stats: dict[str, Any]) -> dict[str, str]:
    """:func:`_load_report` as registry meta: decimal strings (``repr`` of a float)."""
    return {k: repr(v) for k, v in _load_report(stats).items()}
