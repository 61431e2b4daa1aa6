"""The node agent's own Prometheus metrics, served on its status port (agent/health.py).

Labels are bounded: ``node`` (this node's id), ``model`` (configured models only),
``tier`` (:data:`TIERS`), ``phase`` (:data:`PHASES`), ``kind`` (:data:`FAILURE_KINDS`),
``result``, ``state`` (the lifecycle's states).

=============================================  =============================================
``rewarm_node_restore_seconds``                {node, model, tier} histogram, request to warm
``rewarm_node_restore_phase_seconds``          {node, model, tier, phase} histogram, the
                                               replica's load phases (weights, package, golden)
``rewarm_node_restored_bytes_total``           {node, tier} snapshot bytes restored
``rewarm_node_verification_failures_total``    {node, kind} restores refused by a check
``rewarm_node_golden_checks_total``            {node, result} pass / fail
``rewarm_node_restores_total``                 {node, tier, result} ok / failed restore requests
``rewarm_node_restore_reads_total``            {node, io, fallback} how a restore's bytes were
                                               read (:data:`RESTORE_IO`) and why a device read
                                               took the host path (:data:`FALLBACK_KINDS`)
``rewarm_node_snapshot_cache_bytes``           {node, kind} used / free (capacity - used)
``rewarm_node_snapshot_cache_lookups_total``   {node, result} hit / miss (local copy present)
``rewarm_node_snapshot_evictions_total``       {node} local copies removed to make room
``rewarm_node_zygotes_ready``                  {node} pre-started workers waiting for a restore
``rewarm_node_replicas``                       {node, state} replicas by lifecycle state
``rewarm_node_suspended_replicas``             {node} (also a state above; the tier's own gauge)
``rewarm_node_restores_in_flight``             {node, phase} restores under way by step
``process_*``                                  this agent process (ProcessCollector)
=============================================  =============================================

One exporter per metric name: a replica's load (``rewarm_replica_*``) is exported by the
replica's own status port (agent/replica/meter.py), never again here, so a sum over every
port counts each once; the cache hit ratio is
``rate(rewarm_node_snapshot_cache_lookups_total{result="hit"}[5m])`` over all results.
Counters and histograms are prometheus-client's own; the gauges are read from the agent at
scrape time by a custom collector, so the agent never pushes them.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily

from agent.telemetry import BUCKETS_S

if TYPE_CHECKING:
    import threading as _threading

    from agent.clock import Clock
    from agent.node.backend import ModelSpec, Zygote
    from agent.node.inventory import Inventory
    from agent.node.state import ReplicaRecord
    from agent.snapshot.store import LocalStore

TIERS = {"restore": "local", "staged_restore": "remote", "cold_boot": "cold",
         "resume": "suspended", "warm": "warm"}
"""The agent's ``path`` names -> the ``tier`` label (docs/architecture.md, "Tiers of warmth")."""

PHASES = {"weights_s": "weights", "package_s": "package", "compile_s": "package",
          "golden_s": "golden"}
"""A replica's ``phases_s`` keys (agent/replica/zygote.py) -> the ``phase`` label."""

FAILURE_KINDS = ("checksum", "signature", "pins", "golden", "timeout", "stage", "other")

RESTORE_IO = ("staged", "gds", "compat", "host")
"""agent/snapshot/gpu.py: the staged restore, kvikio with GDS, kvikio's compat mode, the host
reader."""
FALLBACK_KINDS = ("none", "driver", "checksum", "memory", "io", "other")
"""Why a device read fell back: none; no driver or kvikio (DriverUnavailable); a chunk that
did not verify in device memory (SnapshotCorrupt); no device memory (OutOfMemoryError); a
failed read (kvikio's RuntimeError, OSError); anything else."""


def fallback_kind(reason: str | None) -> str:
    """The ``fallback`` label of a ``Loaded.fallback`` reason (``"<ErrorType>: message"``)."""
    if not reason:
        return "none"
    error = reason.split(":", 1)[0]
    return {"DriverUnavailable": "driver", "SnapshotCorrupt": "checksum",
            "OutOfMemoryError": "memory", "RuntimeError": "io", "OSError": "io"}.get(error, "other")


def failure_kind(attempt: dict[str, Any]) -> str:
    """The ``kind`` label of one failed ladder step (``ReplicaRecord.attempts`` entry)."""
    error, path = attempt.get("error", ""), attempt.get("path", "")
    if path == "stage":
        return "stage"
    if attempt.get("status") == "stale-pins" or error == "SnapshotIncompatible":
        return "pins"
    return {"SnapshotTampered": "signature", "SnapshotCorrupt": "checksum",
            "GoldenMismatch": "golden", "TimeoutError": "timeout"}.get(error, "other")


class AgentView(Protocol):
    """What the metrics read of the node agent (agent/node/agent.py's NodeAgent) at scrape
    time; ``lock`` guards ``replicas`` and ``pool``."""

    @property
    def store(self) -> LocalStore: ...
    @property
    def lock(self) -> _threading.RLock: ...
    @property
    def pool(self) -> dict[str, list[Zygote]]: ...
    @property
    def replicas(self) -> dict[str, ReplicaRecord]: ...
    @property
    def closing(self) -> bool: ...
    @property
    def last_tick_s(self) -> float | None: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def inventory(self) -> Inventory: ...
    @property
    def models(self) -> dict[str, ModelSpec]: ...
    @property
    def metrics(self) -> NodeMetrics: ...


class NodeMetrics:
    """Metrics of one node agent (module docstring).  ``registry``: a fresh one by default.
    Thread-safe: the control server's threads call :meth:`restore_finished`."""

    def __init__(self, node_id: str, registry: CollectorRegistry | None = None, *,
                 process_metrics: bool = True) -> None:
        self.node = node_id
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.restore_s = Histogram("rewarm_node_restore_seconds", "Restore request to warm",
                                   ("node", "model", "tier"), buckets=BUCKETS_S, registry=r)
        self.phase_s = Histogram("rewarm_node_restore_phase_seconds",
                                 "A replica's load phases during a restore",
                                 ("node", "model", "tier", "phase"), buckets=BUCKETS_S, registry=r)
        self.restored_bytes = Counter("rewarm_node_restored_bytes", "Snapshot bytes restored",
                                      ("node", "tier"), registry=r)
        self.failures = Counter("rewarm_node_verification_failures",
                                "Restores refused by a check (checksum, signature, pins, "
                                "golden, timeout, stage)", ("node", "kind"), registry=r)
        self.golden = Counter("rewarm_node_golden_checks", "Golden-token checks by result",
                              ("node", "result"), registry=r)
        self.restores = Counter("rewarm_node_restores", "Restore requests by tier and result",
                                ("node", "tier", "result"), registry=r)
        self.lookups = Counter("rewarm_node_snapshot_cache_lookups",
                               "Restores that found (hit) or lacked (miss) a local copy",
                               ("node", "result"), registry=r)
        self.evictions = Counter("rewarm_node_snapshot_evictions",
                                 "Local snapshot copies removed", ("node",), registry=r)
        self.reads = Counter("rewarm_node_restore_reads", "Restores by how the bytes were read "
                             "and why a device read fell back to the host path",
                             ("node", "io", "fallback"), registry=r)
        for result in ("hit", "miss"):
            self.lookups.labels(node_id, result)
        for result in ("pass", "fail"):
            self.golden.labels(node_id, result)
        for kind in FAILURE_KINDS:
            self.failures.labels(node_id, kind)
        self.evictions.labels(node_id)
        self.outcomes: dict[str, tuple[bool, str]] = {}   # model -> latest restore (ok, why)
        self._lock = threading.Lock()
        self.agent: AgentView | None = None
        if process_metrics:
            ProcessCollector(registry=r)

    def attach(self, agent: AgentView) -> NodeMetrics:
        """Read ``agent``'s gauges at scrape time (once)."""
        self.agent = agent
        self.registry.register(_AgentCollector(self))
        return self

    # -- events from the agent ---------------------------------------------------------------
    def restore_finished(self, rec: ReplicaRecord, duration_s: float, ok: bool,
                         catalog=None, *, reason: str = "") -> None:
        """One ``restore()`` ended: its tier (``rec.path``), duration, each failed step
        (``rec.attempts``), the phases the replica reports, bytes restored (the size of
        ``rec.snapshot_id`` in ``catalog``), cache hit/miss; ``reason``: why it failed (kept
        for :func:`readiness`)."""
        node, model = self.node, rec.spec.name
        with self._lock:
            self.outcomes[model] = (ok, reason)
        tried_local = any(a.get("path") == "restore" for a in rec.attempts)
        if rec.path in ("restore", "staged_restore", "cold_boot") or rec.attempts:
            hit = rec.path == "restore" or tried_local
            self.lookups.labels(node, "hit" if hit else "miss").inc()
        for attempt in rec.attempts:
            kind = failure_kind(attempt)
            self.failures.labels(node, kind).inc()
            if kind == "golden":
                self.golden.labels(node, "fail").inc()
        tier = TIERS.get(rec.path, "cold") if ok else "none"
        self.restores.labels(node, tier, "ok" if ok else "failed").inc()
        if not ok or rec.path == "warm":
            return
        self.restore_s.labels(node, model, tier).observe(duration_s)
        io = getattr(rec.handle, "restore_io", None)
        if io in RESTORE_IO:
            self.reads.labels(node, io, fallback_kind(getattr(rec.handle, "fallback", None))).inc()
        phases = _phases(rec)
        for key, seconds in phases.items():
            if key in PHASES:
                self.phase_s.labels(node, model, tier, PHASES[key]).observe(float(seconds))
        if "golden_s" in phases:
            self.golden.labels(node, "pass").inc()
        size_bytes = _size_bytes(catalog, rec.snapshot_id)
        if size_bytes and tier in ("local", "remote"):
            self.restored_bytes.labels(node, tier).inc(size_bytes)

    def evicted(self, snapshot_id: str) -> None:
        self.evictions.labels(self.node).inc()


def _size_bytes(catalog, snapshot_id: str | None) -> int | None:
    from agent.errors import SnapshotError

    if catalog is None or snapshot_id is None:
        return None
    try:
        return catalog.snapshot(snapshot_id).size_bytes
    except SnapshotError:
        return None


def restores_in_flight(records, now_s: float) -> list[dict[str, Any]]:
    """The replicas coming up: ``replica``, ``model``, ``phase`` (stage | restore |
    cold_boot), ``seconds`` in that phase, ``snapshot`` (call with the agent's lock held)."""
    return [{"replica": r.lifecycle.replica_id, "model": r.spec.name, "phase": r.phase,
             "seconds": round(now_s - r.phase_since_s, 3), "snapshot": r.snapshot_id}
            for r in records if r.phase is not None]


def _phases(rec: ReplicaRecord) -> dict[str, float]:
    """The load phases from the replica's last ``stats`` (read by ``describe(load=True)``;
    no call of its own: the restore path asks the replica once)."""
    phases = (getattr(rec, "last_stats", None) or {}).get("phases_s") or {}
    return {k: v for k, v in phases.items() if isinstance(v, (int, float))}


class _AgentCollector:
    def __init__(self, m: NodeMetrics) -> None:
        self.m = m

    def collect(self):
        from agent.node.lifecycle import ReplicaState

        agent, node = self.m.agent, self.m.node
        def g(name: str, doc: str, labels: tuple = ("node",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)
        used, capacity = agent.store.used_bytes, agent.store.capacity_bytes
        cache = g("rewarm_node_snapshot_cache_bytes", "Local snapshot tier bytes", ("node", "kind"))
        cache.add_metric((node, "used"), used)
        cache.add_metric((node, "free"), max(0, capacity - used))
        yield cache
        with agent.lock:
            zygotes = sum(len(z) for z in agent.pool.values())
            records = list(agent.replicas.values())
        ready = g("rewarm_node_zygotes_ready", "Pre-started workers waiting for a restore")
        ready.add_metric((node,), zygotes)
        yield ready
        by_state = g("rewarm_node_replicas", "Replicas by lifecycle state", ("node", "state"))
        counts = {s.value: 0 for s in ReplicaState}
        for rec in records:
            counts[rec.lifecycle.state.value] += 1
        for state, n in counts.items():
            by_state.add_metric((node, state), n)
        yield by_state
        suspended = g("rewarm_node_suspended_replicas", "Replicas parked in host memory")
        suspended.add_metric((node,), counts.get("suspended", 0))
        yield suspended
        flight = g("rewarm_node_restores_in_flight", "Restores under way by step",
                   ("node", "phase"))
        phases = {"stage": 0, "restore": 0, "cold_boot": 0}
        for rec in records:
            phase = getattr(rec, "phase", None)
            if phase in phases:
                phases[phase] += 1
        for phase, n in phases.items():
            flight.add_metric((node, phase), n)
        yield flight



def readiness(agent: AgentView, *, stall_s: float = 10.0) -> tuple[bool, str]:
    """Whether ``agent`` can restore now, and why not: not while it shuts down, before its
    loop's first tick or when the loop has not ticked for ``stall_s``, with no device or no
    model, or while the latest restore of every model that asked for one failed."""
    if agent.closing:
        return False, "shutting down: draining replicas"
    if agent.last_tick_s is None:
        return False, "starting: the agent loop has not run yet"
    idle_s = agent.clock.now() - agent.last_tick_s
    if idle_s > stall_s:
        return False, f"agent loop stalled: no tick for {idle_s:.1f} s (limit {stall_s} s)"
    if not agent.inventory.devices or not agent.models:
        return False, (f"nothing to serve: devices {agent.inventory.devices}, "
                       f"models {sorted(agent.models)}")
    with agent.metrics._lock:
        outcomes = dict(agent.metrics.outcomes)
    if outcomes and not any(ok for ok, _r in outcomes.values()):
        return False, "every restore fails: " + "; ".join(
            f"{m}: {r}" for m, (_ok, r) in sorted(outcomes.items()))
    return True, "ready"
