"""The node agent: owns this node's replicas and snapshots and makes restores fast and safe.

:class:`NodeAgent` is the node's facade (the control API, ``rewarm up`` and the metrics call
it) over collaborators that share its named state (:class:`~agent.node.state.NodeState`):

- the restore ladder (:class:`~agent.node.ladder.RestoreLadder`, agent/node/ladder.py):
  local snapshot, remote copy, cold boot, then the capture;
- snapshot bookkeeping (:class:`~agent.node.snapshots.Snapshots`): reconciliation at start,
  list/verify/evict, the cluster summary, the scale-in durability test;
- suspend/resume (:class:`~agent.node.suspend.SuspendResume`, GPU nodes);
- scale-in (:class:`~agent.node.drain.Drainer`): drain one replica behind the durability
  guard, or all of them at close;
- the zygote pool (:class:`~agent.node.pool.ZygotePool`) and the registrar
  (:class:`~agent.node.registration.Registrar`).

It keeps the agent loop, status and close.  Zygotes per device are kept at
``zygotes_per_device`` per replica the device hosts (:meth:`NodeAgent.pool_target`) by
:meth:`NodeAgent.refill_pool`, run on the background executor after each restore and each
capture.  :meth:`NodeAgent.tick` (the agent loop, clock-injected) keeps registrations and
TTLs current.  Replica states move only through :class:`~agent.node.lifecycle.Lifecycle`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from agent.clock import Clock, SystemClock
from agent.cluster.base import Registry, ServiceInstance
from agent.errors import RewarmError
from agent.node.backend import Backend, ModelSpec
from agent.node.capacity import NodeCapacity, ReplicaLimit
from agent.node.drain import Drainer, ScaleInBlocked
from agent.node.inventory import Inventory
from agent.node.ladder import RestoreLadder
from agent.node.lifecycle import ReplicaState as S
from agent.node.metrics import NodeMetrics, restores_in_flight
from agent.node.pool import ZygotePool
from agent.node import silence
from agent.node.registration import Registrar
from agent.node.snapshots import Snapshots, SnapshotSummary
from agent.node.state import AgentConfig, NodeState, ReplicaRecord, load_meta
from agent.node.suspend import Suspender, SuspendResume
from agent.snapshot.catalog import Catalog
from agent.snapshot.store import LocalStore

log = logging.getLogger(__name__)

__all__ = ["AgentConfig", "NodeAgent", "NodeMetadata", "ScaleInBlocked"]


class NodeMetadata(Protocol):
    """Where the node's cached models are published for placement (Nomad dynamic node
    metadata: agent/cluster/node_meta.py's SnapshotMetadata); posts only on a change."""

    def update(self, models: list[str]) -> bool: ...


class NodeAgent:
    """One per node. Thread-safe; blocking methods are called from the control server's
    threads.  The collaborators are :attr:`ladder`, :attr:`snapshots`, :attr:`suspension`,
    :attr:`draining`, :attr:`zygotes` and :attr:`registrar`, over :attr:`state`."""

    def __init__(self, config: AgentConfig, *, models: list[ModelSpec], backend: Backend,
                 catalog: Catalog, store: LocalStore, registry: Registry, inventory: Inventory,
                 clock: Clock | None = None, suspender: Suspender | None = None,
                 executor: ThreadPoolExecutor | None = None,
                 sleep: Callable[[float], None] | None = None,
                 summary: SnapshotSummary | None = None,
                 node_meta: NodeMetadata | None = None,
                 metrics: NodeMetrics | None = None) -> None:
        import time

        clock = clock or SystemClock()
        st = self.state = NodeState(config, {m.name: m for m in models}, catalog, store,
                                    inventory, Registrar(registry, clock=clock), clock)
        # the state's parts, by name, for the control API, the metrics and the tests
        self.config, self.models, self.clock, self.lock = config, st.models, clock, st.lock
        self.catalog, self.store, self.inventory = catalog, store, inventory
        self.registrar, self.replicas, self.captures = st.registrar, st.replicas, st.captures
        self.staging = st.staging
        self.backend, self.node_meta, self.suspender = backend, node_meta, suspender
        self.executor = executor or ThreadPoolExecutor(max_workers=2, thread_name_prefix="agent")
        self._sleep = sleep or time.sleep
        self.zygotes = ZygotePool(backend, list(inventory.devices), target=self.pool_target,
                                  warm_for=self.warm_for)
        self.pool = self.zygotes.ready      # device -> ready zygotes
        self.metrics = metrics or NodeMetrics(config.node_id)
        self.snapshots = Snapshots(catalog, store, node_id=config.node_id,
                                   remote_root=config.remote_root, summary=summary)
        self.suspension = SuspendResume(st, suspender, self.restore, sleep=self._sleep)
        st.tier = self.suspension.tier      # the suspended tier in the agent's registry meta
        self.node_capacity = NodeCapacity(st, backend)
        self.draining = Drainer(st, durable=self.snapshot_durable, sleep=self._sleep)
        self.ladder = RestoreLadder(st, zygotes=self.zygotes, backend=backend,
                                    snapshots=self.snapshots, metrics=self.metrics,
                                    executor=self.executor, refill=self._refill_later,
                                    drain=self.drain, sleep=self._sleep,
                                    capacity=self.node_capacity)
        store.on_evict = self._evicted
        self.snapshots.reconcile()
        self.agent_instance = ServiceInstance(
            "rewarm-agent", st.agent_id, config.control_address, config.control_port,
            meta=st.agent_meta())
        self.registrar.want(self.agent_instance)
        self.metrics.attach(self)

    @property
    def closing(self) -> bool:
        """Set once :meth:`close` begins: no restore starts after it."""
        return self.state.closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self.state.closing = value

    @property
    def last_tick_s(self) -> float | None:
        """When the agent loop last ticked (the clock's seconds; None: not yet)."""
        return self.state.last_tick_s

    def _evicted(self, snapshot_id: str) -> None:
        self.metrics.evicted(snapshot_id)
        self.snapshots.on_evict(snapshot_id)

    # -- the control API's ops -----------------------------------------------------------------
    def spec(self, model: str) -> ModelSpec:
        """The configured model; ModelNotFound naming the choices."""
        return self.state.spec(model)

    def restore(self, model: str, device: str | None = None) -> dict[str, Any]:
        """Bring up one warm replica of ``model``: a parked one resumed when there is one
        (:meth:`SuspendResume.resume_parked <agent.node.suspend.SuspendResume.resume_parked>`,
        path ``resume``), else :meth:`RestoreLadder.restore
        <agent.node.ladder.RestoreLadder.restore>` (its answer and what it raises)."""
        resumed = self.suspension.resume_parked(model)
        if resumed is not None:
            return resumed
        return self.ladder.restore(model, device)

    def start_capture(self, rec: ReplicaRecord) -> Future:
        """Capture ``rec`` on the background executor (once per model version at a time)."""
        return self.ladder.start_capture(rec)

    def suspend(self, replica_id: str) -> dict[str, Any]:
        """:meth:`SuspendResume.suspend <agent.node.suspend.SuspendResume.suspend>`."""
        return self.suspension.suspend(replica_id)

    def resume(self, replica_id: str) -> dict[str, Any]:
        """:meth:`SuspendResume.resume <agent.node.suspend.SuspendResume.resume>`."""
        return self.suspension.resume(replica_id)

    def snapshot_list(self, model: str | None = None) -> list[dict[str, Any]]:
        return self.snapshots.snapshot_list(model)

    def snapshot_verify(self, snapshot_id: str) -> dict[str, Any]:
        return self.snapshots.snapshot_verify(snapshot_id)

    def snapshot_evict(self, snapshot_id: str) -> dict[str, Any]:
        return self.snapshots.snapshot_evict(snapshot_id)

    def publish(self, snapshot_id: str) -> None:
        self.snapshots.publish(snapshot_id)

    def snapshot_durable(self, model: str) -> bool:
        """Whether ``model`` has a ready snapshot that survives this node (the scale-in
        guard; :meth:`Snapshots.snapshot_durable <agent.node.snapshots.Snapshots.snapshot_durable>`)."""
        return self.snapshots.snapshot_durable(model)

    # -- zygote pool -------------------------------------------------------------------------
    def pool_target(self, device: str) -> int:
        """Zygotes kept ready on ``device``: ``zygotes_per_device`` per replica it hosts.  A
        GPU hosts one replica; the CPU device of a CPU-only node hosts up to
        ``max_replicas_per_model`` (one per core group), so it keeps one set per replica
        slot: a scale-up from zero to the cap restores every replica from a ready zygote
        instead of starting the second one's process inside its restore (seconds, measured
        in the trace replay: 5-24 s against 1.3-1.8 s with a zygote ready).  With a node
        limit (``limit_to_node``) the CPU's slots are that limit, the most the node runs."""
        if device != "cpu":
            return self.config.zygotes_per_device
        limit = self.replica_limit()
        slots = self.config.max_replicas_per_model or 1
        if limit is not None:
            slots = min(self.config.max_replicas_per_model or limit.limit, limit.limit)
        return self.config.zygotes_per_device * slots

    # -- capacity ------------------------------------------------------------------------------
    def replica_limit(self) -> ReplicaLimit | None:
        """What this node runs at speed (agent/node/capacity.py), None without
        ``limit_to_node``: cores // the backend's threads on CPU, one per GPU device."""
        return self.node_capacity.limit()

    def capacity(self) -> dict[str, Any] | None:
        """The capacity answer (``replica_limit``, ``basis``, ``replicas``, ``free``); None
        without a node limit."""
        return self.node_capacity.answer()

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

    # -- drain ---------------------------------------------------------------------------------
    def drain(self, replica_id: str, timeout_s: float | None = None,
              force: bool = False) -> dict[str, Any]:
        """:meth:`Drainer.drain <agent.node.drain.Drainer.drain>`: deregister, wait up to
        ``timeout_s`` for in-flight requests, stop; ScaleInBlocked for a model's last
        replica without a ready, durable snapshot (unless ``force``)."""
        return self.draining.drain(replica_id, timeout_s, force)

    # -- loop, status, registration ------------------------------------------------------------
    def tick(self) -> None:
        """One pass of the agent loop: registrations and TTLs (with backoff), load meta."""
        for rec in self.live_replicas_all():
            handle = rec.handle
            alive = getattr(handle, "alive", None)
            if handle is not None and alive is not None and not alive():
                log.error("replica %s: its process died; deregistering", rec.lifecycle.replica_id,
                          extra={"replica": rec.lifecycle.replica_id})
                self.registrar.drop(rec.lifecycle.replica_id)
                try:
                    handle.shutdown()      # reaps the process, removes its socket file
                except (OSError, RewarmError, RuntimeError) as exc:
                    log.warning("cleaning up after %s: %s", rec.lifecycle.replica_id, exc)
                rec.lifecycle.move(S.DEAD, "process died")
                self.state.record(rec)
                continue
            if rec.lifecycle.state is S.WARM and rec.handle is not None:
                sent_s = self.clock.now()
                try:
                    stats = rec.handle.stats(timeout_s=silence.probe_timeout_s(self.config, rec))
                except (OSError, RewarmError, RuntimeError) as exc:
                    self._unanswered(rec, exc)
                    continue
                silence.probe_answered(rec, self.clock.now() - sent_s)
                self._answered(rec)
                rec.last_stats = stats
                self.registrar.update_meta(rec.lifecycle.replica_id, load_meta(stats))
        self.registrar.update_meta(self.agent_instance.id, self.state.agent_meta())
        self.registrar.sync()
        self.state.last_tick_s = self.clock.now()
        if self.node_meta is not None:
            self.node_meta.update(self.cached_models())

    def _unanswered(self, rec: ReplicaRecord, exc: BaseException) -> None:
        """A stats probe failed: after :func:`agent.node.silence.unresponsive_after_s` of
        failures (the configured floor, raised from the replica's probe history and measured
        step), out of routing."""
        now = self.clock.now()
        if rec.silent_since_s is None:
            rec.silent_since_s = now
        if not rec.unrouted and \
                now - rec.silent_since_s >= silence.unresponsive_after_s(self.config, rec):
            rid = rec.lifecycle.replica_id
            log.error("replica %s has not answered for %.1f s (last: %s); out of routing until "
                      "it does", rid, now - rec.silent_since_s, exc, extra={"replica": rid})
            rec.unrouted = True
            self.registrar.drop(rid)

    def _answered(self, rec: ReplicaRecord) -> None:
        rec.silent_since_s = None
        if rec.unrouted:
            rec.unrouted = False
            log.warning("replica %s answers again; back in routing", rec.lifecycle.replica_id,
                        extra={"replica": rec.lifecycle.replica_id})
            self.registrar.want(self.state.replica_instance(rec))

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

    def status(self) -> dict[str, Any]:
        with self.lock:
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
                          "capacity_bytes": self.store.capacity_bytes},
                "capacity": self.capacity()}

    def close(self) -> None:
        """Drain everything (forced, all replicas at once so the whole drain takes at most
        ``drain_timeout_s``), deregister, stop the executor."""
        with self.lock:
            self.closing = True    # no restore starts now; those under way are waited for
            if not self.state.restores_done.wait_for(lambda: self.state.restoring == 0,
                                                     timeout=self.config.restore_timeout_s):
                log.warning("node %s closing: %d restores still under way after %.0f s; "
                            "each stops its replica when it comes up", self.config.node_id,
                            self.state.restoring, self.config.restore_timeout_s)
        self.draining.drain_all()
        self.registrar.drop(self.agent_instance.id)
        self.executor.shutdown(wait=True)
        self.zygotes.close()

    def live_replicas(self, model: str) -> list[ReplicaRecord]:
        """Warm or suspended replicas of ``model``."""
        return self.state.live(model)

    def live_replicas_all(self) -> list[ReplicaRecord]:
        """Every warm or suspended replica."""
        return self.state.live()
