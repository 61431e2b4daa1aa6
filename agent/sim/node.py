"""A simulated node agent and its registry, on a virtual-time loop (agent/sim/vloop.py).

:class:`SimNode` stands where the embedded stack's node agent (agent/node/agent.py) and its
local registry stand, as the front door and the predictor's scaler see them:

- **zygotes**: a restore takes a ready zygote (``zygotes`` kept per node, agent/node/agent.py's
  ``zygotes_per_device``), which is refilled ``zygote_s`` after the restore; a restore that
  finds none ready starts its own and takes ``zygote_s`` longer (as the node agent does);
- **restore** (the front door's :class:`~agent.frontdoor.capacity.CapacityRequester`,
  :meth:`request_restore`, and ``call("restore")`` for
  :class:`~agent.cluster.local_scaler.LocalScaler`): a new replica record in ``restoring``
  that is warm ``restore_s`` later (the live replay's measured restore) and is registered
  then, unless ``max_replicas`` of the model are coming up or warm: then, as the node agent
  does, the answer is the first warm one with path ``warm``;
- **drain** (``call("drain")``): deregistered at once, new requests refused (503), stopped
  (and no longer billed) once its requests in flight are done;
- **suspend** is refused (a CPU node cannot park device memory), so the scaler drains;
- **status**: the replicas not dead, with their states;
- the agent loop (:meth:`tick`, every ``agent_tick_s``) copies each warm replica's load into
  its registry meta, which the front door reads every ``registry_poll_s``
  (:meth:`instances`, handed to ``RequestPath.apply_replicas`` as the registry watcher does);
- **billing**: replica-seconds of every record not dead (restoring and draining included),
  as the live replay's sampler counts.

The scaler's calls are synchronous in production, and block the predictor's thread for as
long as they take (a restore: ``restore_s``; a drain: until its requests are done).  Here a
synchronous call returns at once and its work happens on the loop: restores asked in one
scaler call run one after another (each starts when the one before is warm, as the blocking
calls do), and :meth:`settle` awaits them, so the predictor's next tick comes when it
would come live.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

from agent.cluster.base import ServiceInstance
from agent.errors import ConfigError, NoCapacity
from agent.frontdoor.capacity import RestoreResult
from agent.frontdoor.router import ReplicaLoad
from agent.node.state import load_meta   # the node agent's own: load, queue, speed, capacity
from agent.sim.worker import SimWorker
from agent.speed import SpeedProfile

UP = ("restoring", "warm")


@dataclass
class SimRecord:
    """One replica on the node: its worker, state and the times it moved."""

    replica_id: str
    worker: SimWorker
    ready: asyncio.Future             # done when it turns warm
    state: str = "restoring"          # restoring | warm | draining | dead
    path: str = "restore"             # how it came up (the node agent's word)
    warm_s: float | None = None
    dead_s: float | None = None
    meta: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "model": self.worker.model, "state": self.state,
                "path": self.path, "address": self.replica_id}


class SimNode:
    """The node agent, its registry and its replicas (module docstring).  Replicas report
    (and predict with) ``speed``; they serve at ``actual`` (default ``speed``)."""

    def __init__(self, model: str, speed: SpeedProfile, *, max_seqs: int, max_seq_len: int,
                 restore_s: float, max_replicas: int | None = None,
                 actual: SpeedProfile | None = None, zygote_s: float = 0.0,
                 zygotes: int = 1) -> None:
        if not restore_s >= 0 or restore_s == float("inf"):
            raise ConfigError(f"SimNode restore_s={restore_s!r} must be a finite number >= 0",
                              name="restore_s", value=restore_s, limit=">= 0")
        self.model, self.speed, self.actual = model, speed, actual or speed
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self.restore_s = float(restore_s)
        if not zygote_s >= 0 or zygote_s == float("inf"):
            raise ConfigError(f"SimNode zygote_s={zygote_s!r} must be a finite number >= 0",
                              name="zygote_s", value=zygote_s, limit=">= 0")
        self.zygote_s, self.zygotes = float(zygote_s), zygotes
        self._pool = zygotes                     # zygotes ready
        self._refilling = False
        self.max_replicas = max_replicas
        self.records: dict[str, SimRecord] = {}
        self._ids = itertools.count(1)
        self._chain: list[asyncio.Future] = []   # work the scaler's synchronous calls started
        self._chain_until_s = float("-inf")      # when the last of it is done (virtual s)
        self._billed_s = 0.0
        self._billed_at_s: float | None = None
        self.restores = 0
        self.peak = 0

    # --- time and billing --------------------------------------------------------------------
    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    def _bill(self) -> None:
        now = self.now()
        if self._billed_at_s is not None:
            self._billed_s += self.alive() * (now - self._billed_at_s)
        self._billed_at_s = now

    def alive(self) -> int:
        return sum(1 for r in self.records.values() if r.state != "dead")

    def start_billing(self) -> None:
        """Count replica-seconds from now (the replay's window begins)."""
        self._billed_s, self._billed_at_s = 0.0, self.now()
        self.peak = self.alive()

    def replica_seconds(self) -> float:
        """Replica-seconds since :meth:`start_billing`, up to now."""
        self._bill()
        return self._billed_s

    def _move(self, rec: SimRecord, state: str) -> None:
        self._bill()
        rec.state = state
        if state == "dead":
            rec.dead_s = self.now()
        self.peak = max(self.peak, self.alive())

    # --- replicas ---------------------------------------------------------------------------
    def _new(self, path: str = "restore") -> SimRecord:
        rid = f"sim-{self.model}-{next(self._ids)}"
        worker = SimWorker(rid, self.model, self.actual, max_seqs=self.max_seqs,
                           max_seq_len=self.max_seq_len, reported=self.speed)
        rec = SimRecord(rid, worker, asyncio.get_running_loop().create_future(), path=path)
        self._bill()
        self.records[rid] = rec
        self.peak = max(self.peak, self.alive())
        return rec

    def start_warm(self) -> SimRecord:
        """A replica that is warm now (the replay begins with one)."""
        rec = self._new("restore")
        self._go_warm(rec)
        return rec

    def _go_warm(self, rec: SimRecord) -> None:
        if rec.state != "restoring":
            return
        self._move(rec, "warm")
        rec.warm_s = self.now()
        rec.meta = load_meta(rec.worker.stats())
        if rec.ready is not None and not rec.ready.done():
            rec.ready.set_result(rec)

    def _at_cap(self) -> bool:
        return self.max_replicas is not None and sum(
            1 for r in self.records.values() if r.state in UP) >= self.max_replicas

    def _first_warm(self) -> SimRecord | None:
        up = [r for r in self.records.values() if r.state in UP]
        warm = [r for r in up if r.state == "warm"]
        return next(iter(warm or up), None)

    def _restore_later(self, rec: SimRecord, start_s: float) -> float:
        """Make ``rec`` warm ``restore_s`` after ``start_s`` (``zygote_s`` more when no
        zygote is ready: the node agent then starts one for it); returns when."""
        duration_s = self.restore_s
        if self.zygote_s > 0:
            if self._pool > 0:
                self._pool -= 1
            else:
                duration_s += self.zygote_s
        ready_s = max(start_s, self.now()) + duration_s
        self.restores += 1
        loop = asyncio.get_running_loop()
        loop.call_at(ready_s, self._go_warm, rec)
        loop.call_at(ready_s, self._refill)
        return ready_s

    def _refill(self) -> None:
        """After a restore the node agent refills its zygote pool, one zygote at a time
        (``refill_pool`` on its executor), each ``zygote_s``."""
        if self.zygote_s <= 0 or self._refilling or self._pool >= self.zygotes:
            return
        self._refilling = True

        def ready() -> None:
            self._pool += 1
            self._refilling = False
            self._refill()
        asyncio.get_running_loop().call_later(self.zygote_s, ready)

    async def request_restore(self, model: str) -> RestoreResult:
        """The front door's capacity requester (the node agent's ``restore`` op)."""
        started = self.now()
        if model != self.model:
            raise NoCapacity(f"model {model!r}: not on this node (it serves {self.model!r})",
                             model=model)
        if self._at_cap():
            rec = self._first_warm()
            if rec is None:
                raise NoCapacity(f"model {model!r}: at max_replicas and none up", model=model)
            if rec.state != "warm":
                await asyncio.shield(rec.ready)
            return RestoreResult(self._load(rec), "warm_hit",
                                 (self.now() - started) * 1000.0)
        rec = self._new("restore")
        self._restore_later(rec, started)
        await asyncio.shield(rec.ready)
        return RestoreResult(self._load(rec), "snapshot_restore",
                             (self.now() - started) * 1000.0)

    def _load(self, rec: SimRecord) -> ReplicaLoad:
        load = ReplicaLoad.from_meta(rec.replica_id, self.model, rec.replica_id,
                                     load_meta(rec.worker.stats()))
        load.came_up = rec.path
        return load

    def drain(self, replica_id: str) -> SimRecord:
        rec = self.records[replica_id]
        if rec.state != "warm":
            return rec
        self._move(rec, "draining")
        rec.worker.draining = True
        done = asyncio.get_running_loop().create_future()

        def idle() -> None:
            if rec.state == "draining":
                rec.worker.stop()
                self._move(rec, "dead")
            if not done.done():
                done.set_result(rec)
        rec.worker.on_idle = idle
        if rec.worker.in_flight() == 0:
            asyncio.get_running_loop().call_soon(idle)
        self._chain.append(done)
        return rec

    # --- the control API, as LocalScaler calls it ----------------------------------------
    def call(self, op: str, **fields: Any) -> dict:
        """One control-API call (agent/node/control.py's ops), answered at once; the work
        runs on the loop (module docstring)."""
        if op == "status":
            return {"replicas": [r.describe() for r in self.records.values()
                                 if r.state != "dead"]}
        if op == "restore":
            start = max(self.now(), self._chain_until_s)
            if self._at_cap():
                rec = self._first_warm()
                if rec is None:
                    raise NoCapacity(f"model {self.model!r}: at max_replicas and none up",
                                     model=self.model)
                if rec.state != "warm":
                    self._chain.append(rec.ready)
                return {**rec.describe(), "state": "warm", "path": "warm"}
            rec = self._new("restore")
            self._chain_until_s = self._restore_later(rec, start)
            self._chain.append(rec.ready)
            return {**rec.describe(), "state": "warm"}
        if op == "drain":
            rec = self.drain(str(fields["replica"]))
            return rec.describe()
        if op in ("suspend", "resume"):
            raise NoCapacity(f"replica {fields.get('replica')}: {op} needs a GPU node (CUDA "
                             "checkpoint); this node has none", model=self.model)
        raise ConfigError(f"SimNode: unknown op {op!r}", name="op", value=op,
                          limit=["status", "restore", "drain", "suspend", "resume"])

    async def settle(self) -> None:
        """Wait for the work the scaler's last calls started (restores warm, drains done)."""
        chain, self._chain = self._chain, []
        if chain:
            await asyncio.gather(*(asyncio.shield(f) for f in chain))

    # --- the agent loop and the registry ------------------------------------------------------
    def tick(self) -> None:
        """The agent loop's pass: each warm replica's load into its registry meta."""
        for rec in self.records.values():
            if rec.state == "warm":
                rec.meta = load_meta(rec.worker.stats())

    def instances(self) -> list[ServiceInstance]:
        """The registry's passing ``rewarm-replica`` instances (warm replicas)."""
        return [ServiceInstance("rewarm-replica", r.replica_id, r.replica_id, 0,
                                tags=[f"model={self.model}"],
                                meta={"address": r.replica_id, "came_up": r.path, **r.meta})
                for r in self.records.values() if r.state == "warm"]

    async def connect(self, link, address: str) -> None:
        """The request path's connector: ``address`` is the replica's id."""
        rec = self.records.get(address)
        if rec is None or rec.state == "dead":
            raise ConnectionRefusedError(f"replica {address}: no such replica running")
        await rec.worker.connect(link)
