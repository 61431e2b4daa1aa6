"""The node agent's named state: its settings, its replica records and what they share.

:class:`NodeState` is the one place the agent's collaborators (the restore ladder in
agent/node/ladder.py, snapshot bookkeeping in agent/node/snapshots.py, suspend/resume in
agent/node/suspend.py) find the replicas, the catalog, the local tier and the registrar; each
collaborator takes the narrow view of it that it needs.  Every field of a
:class:`ReplicaRecord` and every table here is read and written under ``NodeState.lock``.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.clock import Clock
from agent.cluster.base import LOAD_META_KEYS, ServiceInstance
from agent.errors import ConfigError, ReplicaNotFound, RewarmError
from agent.node.backend import ModelSpec, Replica
from agent.node.inventory import Inventory
from agent.node.lifecycle import Lifecycle, ReplicaState as S
from agent.node.registration import Registrar
from agent.snapshot.catalog import Catalog
from agent.snapshot.store import LocalStore
from agent.speed import QUEUE_META_KEYS, SPEED_META_KEYS
from agent.throughput import BACKLOG_META_KEYS

LOAD_KEYS = LOAD_META_KEYS
"""A replica's load as its worker's ``stats`` reports it, in the front door's router's keys."""
QUEUE_KEYS = QUEUE_META_KEYS
"""Its queue (ints; agent/speed.py), reported beside the load when the worker gives them."""
SPEED_KEYS = SPEED_META_KEYS
"""Its measured speed (floats; agent/speed.py), absent until the replica has measured itself."""
BACKLOG_KEYS = BACKLOG_META_KEYS
"""What it sustained while backlogged (floats; agent/throughput.py), absent until measured."""


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
    # every model's replicas together at most what the cores or devices serve at speed
    # (agent/node/capacity.py: cores // threads on CPU, one per GPU); False: no such limit
    limit_to_node: bool = False
    # a warm replica that has not answered its stats probes for unresponsive_after_s is taken
    # out of routing until it answers again (SIGSTOP, a livelock, a swap storm); both are
    # floors, raised per replica from its probe round trips and measured decode step
    # (agent/node/silence.py): it leaves routing within about that bound + one probe + one tick
    probe_timeout_s: float = 2.0
    unresponsive_after_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("restore_timeout_s", "drain_timeout_s", "drain_poll_s", "probe_timeout_s",
                     "unresponsive_after_s"):
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
    """One replica on this node: its lifecycle (state and history), model, device, the
    worker ``handle`` (None until it is up), the snapshot it came from, how it came up
    (``path``), each failed step on the way (``attempts``), the step under way while it
    comes up (``phase``, since ``phase_since_s``) and the worker's stats at the last tick."""

    lifecycle: Lifecycle
    spec: ModelSpec
    device: str
    handle: Replica | None = None
    snapshot_id: str | None = None
    path: str = ""                      # restore | staged_restore | cold_boot
    attempts: list[dict] = field(default_factory=list)
    phase: str | None = None            # while coming up: stage | restore | cold_boot
    phase_since_s: float = 0.0
    silent_since_s: float | None = None  # its stats probes have failed since then
    probe_rtts_s: deque | None = None    # round trips (s) of its last answered probes
    unrouted: bool = False               # taken out of routing for not answering
    last_stats: dict = field(default_factory=dict)   # the worker's stats at the last tick
    draining_in_flight: int = 0          # DRAINING: requests it was still serving at the last poll

    def describe(self, *, load: bool = False) -> dict[str, Any]:
        """The replica as the control API reports it.  With ``load`` (and a running
        handle) adds ``load``: its ``max_seqs``, ``active_seqs``, ``kv_capacity_tokens`` and
        ``kv_used_tokens`` (ints, KV in tokens), so a front door can route to it at once
        instead of waiting for the registry to show it."""
        out: dict[str, Any] = {
            "replica": self.lifecycle.replica_id, "model": self.spec.name,
            "version": self.spec.version, "device": self.device,
            "state": self.lifecycle.state.value, "snapshot": self.snapshot_id,
            "path": self.path, "address": self.handle.address if self.handle else None,
            "attempts": self.attempts}
        if self.phase is not None:
            out["phase"] = self.phase
        if self.lifecycle.state is S.DRAINING:
            out["in_flight"] = self.draining_in_flight
        for key in ("restore_io", "fallback"):    # gds | compat | host; why it read via host
            if getattr(self.handle, key, None):
                out[key] = getattr(self.handle, key)
        if load and self.handle is not None:
            try:
                stats = self.last_stats = self.handle.stats()
            except (OSError, RewarmError, RuntimeError):
                stats = {}
            if all(k in stats for k in LOAD_KEYS):
                out["load"] = load_report(stats)
        return out


@dataclass
class NodeState:
    """What the node agent's collaborators share.

    ``replicas``: replica id -> record; ``captures``: ``name@version`` -> the running or
    last capture; ``staging``: snapshot id -> ``(bytes done, total bytes)`` of a copy from
    the remote tier; ``closing``: set once :meth:`agent.node.agent.NodeAgent.close` begins
    (no restore starts after it); ``restoring``: restore calls bringing a replica up, with
    ``restores_done`` notified as each ends.  ``lock`` guards all of them.
    """

    config: AgentConfig
    models: dict[str, ModelSpec]
    catalog: Catalog
    store: LocalStore
    inventory: Inventory
    registrar: Registrar
    clock: Clock
    lock: threading.RLock = field(default_factory=threading.RLock)
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    captures: dict[str, Future] = field(default_factory=dict)
    staging: dict[str, tuple[int, int]] = field(default_factory=dict)
    closing: bool = False
    restoring: int = 0
    last_tick_s: float | None = None
    tier: Any = None      # agent/node/suspend.py ParkedTier: the suspended tier's ETA

    def __post_init__(self) -> None:
        self.restores_done = threading.Condition(self.lock)

    @property
    def agent_id(self) -> str:
        """The id of this node agent's own ``rewarm-agent`` registry entry."""
        return f"rewarm-agent-{self.config.node_id}"

    def spec(self, model: str) -> ModelSpec:
        """The configured model; ModelNotFound naming the choices."""
        from agent.errors import ModelNotFound

        try:
            return self.models[model]
        except KeyError:
            raise ModelNotFound(f"model {model!r} is not configured on node "
                                f"{self.config.node_id}; models: {sorted(self.models)}",
                                model=model) from None

    def rec(self, replica_id: str) -> ReplicaRecord:
        """The record of ``replica_id``; ReplicaNotFound naming the node and the ids it has."""
        with self.lock:
            rec = self.replicas.get(replica_id)
            known = sorted(self.replicas)
        if rec is None:
            raise ReplicaNotFound(f"no replica {replica_id!r} on node {self.config.node_id}; "
                                  f"replicas: {known}", replica=replica_id,
                                  node=self.config.node_id, limit=known)
        return rec

    def live(self, model: str | None = None) -> list[ReplicaRecord]:
        """Warm or suspended replicas (of ``model``, when given)."""
        with self.lock:
            return [r for r in self.replicas.values()
                    if (model is None or r.spec.name == model)
                    and r.lifecycle.state in (S.WARM, S.SUSPENDED)]

    def phase(self, rec: ReplicaRecord, phase: str | None) -> None:
        rec.phase, rec.phase_since_s = phase, self.clock.now()

    def record(self, rec: ReplicaRecord, snapshot_id: str | None = None) -> None:
        """Write ``rec``'s state to the catalog's replicas table."""
        self.catalog.upsert_replica(
            rec.lifecycle.replica_id, model_name=rec.spec.name, model_version=rec.spec.version,
            node_id=self.config.node_id, device=rec.device, state=rec.lifecycle.state.value,
            snapshot_id=snapshot_id or rec.snapshot_id)

    def replica_instance(self, rec: ReplicaRecord) -> ServiceInstance:
        """``rec`` as a ``rewarm-replica`` registry entry, its load in the meta."""
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
                  **load_meta(stats)})

    def agent_meta(self) -> dict[str, str]:
        """The ``rewarm-agent`` entry's meta: node, devices free, ready snapshots here, and
        the suspended tier (parked replicas and the resume ETA, :meth:`ParkedTier.meta
        <agent.node.suspend.ParkedTier.meta>`)."""
        with self.lock:
            busy = {r.device for r in self.replicas.values()
                    if r.lifecycle.state not in (S.DEAD,) and r.device != "cpu"}
        free = [d for d in self.inventory.devices if d not in busy]
        cached = sorted({f"{r.model_name}@{r.model_version}"
                         for r in self.catalog.snapshots(status="ready")
                         if self.store.has(r.snapshot_id)})
        out = {"node": self.config.node_id, "devices_free": ",".join(free),
               "snapshots": ",".join(cached)}
        if self.tier is not None:
            with self.lock:
                parked = [(r.spec.name, r.spec.version, r.lifecycle.replica_id)
                          for r in self.replicas.values() if r.lifecycle.state is S.SUSPENDED]
            out.update(self.tier.meta(parked))
        return out


def load_report(stats: dict[str, Any]) -> dict[str, Any]:
    """The load, queue and (once measured, all or none) speed and backlog-capacity keys of
    a worker's ``stats``: ints, and floats for the speed and capacity."""
    out: dict[str, Any] = {k: int(stats[k]) for k in LOAD_KEYS + QUEUE_KEYS if k in stats}
    for keys in (SPEED_KEYS, BACKLOG_KEYS):
        if all(k in stats for k in keys):
            out.update({k: float(stats[k]) for k in keys})
    return out


def load_meta(stats: dict[str, Any]) -> dict[str, str]:
    """:func:`load_report` as registry meta: decimal strings (``repr`` of a float)."""
    return {k: repr(v) for k, v in load_report(stats).items()}
