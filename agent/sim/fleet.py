"""Simulated replicas: start-up time per tier of warmth, sequence slots, GPU-second billing.

:class:`Fleet` is the simulator's :class:`agent.cluster.base.Scaler`: the production predictor
(or a baseline policy) calls ``set_target`` exactly as it calls the Nomad or local scaler, and
the fleet turns that into replicas that become routable (``Router.upsert``) only when their
start-up ends.  Nothing sleeps: a start schedules a READY event on the simulation's heap.

Replica states (one per slot index)::

    OFF ──start──► BOOTING ──READY──► WARM ──scale-in, idle──► SUSPENDED (keep_suspended)
     ▲                │ cancel          │ scale-in, busy              │ resume (suspended_s)
     └────────────────┴───── DRAINING ◄─┘ (off when its last request completes)

Start-up tier, fastest first (docs/architecture.md, "Tiers of warmth"): a SUSPENDED replica
resumes in ``suspended_s``; otherwise a snapshot restore takes ``restore_s`` when snapshots
are in use; otherwise a cold boot takes ``naive_s``.  BOOTING, WARM and DRAINING replicas
hold a GPU and are billed; SUSPENDED ones hold host RAM only (counted separately).

How a replica serves: with ``FleetConfig.replica`` (a profile measured on the real engine,
agent/sim/profile.py) each replica is a :class:`~agent.sim.replica.SimReplica` that batches
and steps at that speed (``Fleet.engines``); without it, a fixed occupancy model: a
request holds one slot for its ``occupancy_s`` (the document scenarios keep it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Protocol

import numpy as np

from agent.errors import ConfigError
from agent.frontdoor.router import ReplicaLoad, Router
from agent.speed import SpeedProfile

OFF, BOOTING, WARM, DRAINING, SUSPENDED = range(5)
READY = 1  # event kind the simulation hands back to :meth:`Fleet.on_ready`


@dataclass(frozen=True)
class StartupTimes:
    """Seconds from a scale-out decision to a routable replica, per tier: ``(low, high)``.

    Equal bounds are a fixed time; otherwise each start draws uniformly in the range.
    Defaults: ``restore_s`` 3.6 s and ``naive_s`` 60-90 s, a 13B model's snapshot restore
    against its uncached boot (docs/architecture.md, "Cost model"); ``suspended_s`` 2.0 s is an
    estimate for a CUDA checkpoint resume of ~26 GB from pinned host RAM at ~13 GB/s until
    bench/ measures it (``--startup-json``).
    """

    suspended_s: tuple[float, float] = (2.0, 2.0)
    restore_s: tuple[float, float] = (3.6, 3.6)
    naive_s: tuple[float, float] = (60.0, 90.0)

    @classmethod
    def from_json(cls, path: Path, base: StartupTimes | None = None) -> StartupTimes:
        """Override tiers from a benchmark JSON with keys ``restore_s`` (or
        ``zygote_restore_s``, preferred), ``suspended_s``/``resume_s`` and ``naive_s``:
        each a number or a ``[low, high]`` pair.  Raises :class:`ConfigError` on negative or
        non-numeric values."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{path}: cannot read start-up times as JSON ({exc})",
                              name="path", value=str(path), limit="a JSON file") from None
        if isinstance(data, dict) and isinstance(data.get("startup"), dict):
            data = data["startup"]          # an engine profile (bench/engine_profile.py)
        return cls.from_dict(data, path, base)

    @classmethod
    def from_dict(cls, data: dict, where: object = "start-up times",
                  base: StartupTimes | None = None) -> StartupTimes:
        """:meth:`from_json` on an object already read (``where`` names it in errors)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: start-up times must be an object, not "
                              f"{type(data).__name__}", name="startup", value=type(data).__name__,
                              limit="object")
        path = where
        base = base or cls()
        picked = {
            "suspended_s": data.get("suspended_s", data.get("resume_s")),
            "restore_s": data.get("zygote_restore_s", data.get("restore_s")),
            "naive_s": data.get("naive_s"),
        }
        values = {}
        for name, raw in picked.items():
            if raw is None:
                values[name] = getattr(base, name)
                continue
            pair = tuple(raw) if isinstance(raw, (list, tuple)) else (raw, raw)
            if len(pair) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                         and math.isfinite(v) and v >= 0 for v in pair) \
                    or pair[0] > pair[1]:
                raise ConfigError(f"{path}: {name}={raw!r} must be a number >= 0 or [low, high]",
                                  name=name, value=raw, limit=">= 0")
            values[name] = (float(pair[0]), float(pair[1]))
        return cls(**values)


class Profiled(Protocol):
    """What :attr:`FleetConfig.replica` gives the fleet (agent.sim.profile.ReplicaProfile)."""

    @property
    def speed(self) -> SpeedProfile: ...


@dataclass
class FleetConfig:
    """One model's replicas.  ``seqs_per_replica`` concurrent sequences (KV slots) and
    ``kv_capacity_tokens`` per replica; ``max_concurrent_starts`` caps restores and boots in
    flight (shared storage and network bandwidth; 0 = no cap); ``suspended_ttl_s`` is how
    long a suspended replica keeps its host RAM before it drops to the snapshot tier."""

    model: str = "m"
    seqs_per_replica: int = 80
    kv_capacity_tokens: int = 72_089
    startup: StartupTimes = field(default_factory=StartupTimes)
    use_snapshot: bool = True
    keep_suspended: bool = False
    suspended_ttl_s: float = 3600.0
    max_concurrent_starts: int = 0
    max_replicas: int = 10_000
    replica: Profiled | None = None   # agent.sim.profile.ReplicaProfile: replicas step at its speed
    # the front door asks for a replica the moment a request finds none warm or starting
    # (rewarm's request path does; the baselines' autoscalers only see their own ticks)
    restore_on_cold: bool = False

    def __post_init__(self) -> None:
        for name in ("seqs_per_replica", "kv_capacity_tokens", "max_replicas"):
            if getattr(self, name) < 1:
                raise ConfigError(f"FleetConfig.{name}={getattr(self, name)} must be >= 1",
                                  name=name, value=getattr(self, name), limit=">= 1")


class Fleet:
    """Replicas of one model, driven by ``set_target``; implements the Scaler protocol.

    ``schedule(t_s, kind, index, generation)`` puts a READY event on the simulation's heap;
    ``router`` is the production :class:`Router` the simulation dispatches through.
    """

    def __init__(self, cfg: FleetConfig, *, router: Router, clock, schedule: Callable | None,
                 rng: np.random.Generator) -> None:
        self.cfg = cfg
        self.router = router
        self.clock = clock
        self._schedule = schedule
        self._rng = rng
        self.state: list[int] = []
        self.busy: list[int] = []
        self.gen: list[int] = []
        self.suspended_at: list[float] = []
        self.ids: list[str] = []
        self.engines: list = []       # SimReplica per slot when cfg.replica is set
        self.index: dict[str, int] = {}
        self._pending_starts = 0
        self._booting = 0
        self._target = 0
        self.count = [0] * 5
        self.gpu_s = 0.0
        self.suspended_s = 0.0
        self._t_acc = clock.now()
        self.starts_by_tier = {"suspended": 0, "restore": 0, "naive": 0}
        self.reasons: list[tuple[float, int, str]] = []
        # where released replicas go; a keep-alive policy may change both every tick
        self.keep_suspended = cfg.keep_suspended
        self.suspended_ttl_s = cfg.suspended_ttl_s

    # --- Scaler protocol ---------------------------------------------------------------
    def target(self, model: str) -> int:
        return self._target

    def set_target(self, model: str, count: int, *, reason: str = "") -> None:
        """Ask for ``count`` replicas (warm + starting).  Idempotent."""
        count = max(0, min(int(count), self.cfg.max_replicas))
        if count != self._target:
            self.reasons.append((self.clock.now(), count, reason))
        self._target = count
        self.expire_suspended()
        have = self.count[WARM] + self.count[BOOTING] + self._pending_starts
        if count > have:
            self._pending_starts += count - have
            self._start_pending()
        elif count < have:
            self._scale_in(have - count)

    # --- accounting ----------------------------------------------------------------------
    def _accrue(self) -> None:
        now = self.clock.now()
        dt = now - self._t_acc
        if dt > 0:
            c = self.count
            self.gpu_s += dt * (c[BOOTING] + c[WARM] + c[DRAINING])
            self.suspended_s += dt * c[SUSPENDED]
            self._t_acc = now

    def _set(self, i: int, new: int) -> None:
        self._accrue()
        self.count[self.state[i]] -= 1
        self.count[new] += 1
        self.state[i] = new

    @property
    def warm(self) -> int:
        return self.count[WARM]

    @property
    def pending_starts(self) -> int:
        """Starts asked for that wait for a start slot (``max_concurrent_starts``)."""
        return self._pending_starts

    @property
    def billed(self) -> int:
        return self.count[BOOTING] + self.count[WARM] + self.count[DRAINING]

    # --- scale-out -----------------------------------------------------------------------
    def _slot(self) -> int:
        for i, s in enumerate(self.state):
            if s == OFF:
                return i
        i = len(self.state)
        rid = f"r{i}"
        self.state.append(OFF)
        self.busy.append(0)
        self.gen.append(0)
        self.suspended_at.append(0.0)
        self.ids.append(rid)
        if self.cfg.replica is not None:
            from agent.sim.replica import SimReplica

            self.engines.append(SimReplica(self.cfg.replica.speed, self.cfg.seqs_per_replica))
        self.index[rid] = i
        self.count[OFF] += 1
        return i

    def _draw(self, bounds: tuple[float, float]) -> float:
        lo, hi = bounds
        return lo if hi <= lo else float(self._rng.uniform(lo, hi))

    def _start_pending(self) -> None:
        cap = self.cfg.max_concurrent_starts
        while self._pending_starts > 0 and (cap <= 0 or self._booting < cap):
            self._pending_starts -= 1
            st = self.cfg.startup
            suspended = [i for i, s in enumerate(self.state) if s == SUSPENDED]
            if suspended:
                i, tier, dt = suspended[-1], "suspended", self._draw(st.suspended_s)
            else:
                i = self._slot()
                tier, dt = ("restore", self._draw(st.restore_s)) if self.cfg.use_snapshot \
                    else ("naive", self._draw(st.naive_s))
            self.starts_by_tier[tier] += 1
            self._set(i, BOOTING)
            self._booting += 1
            self.gen[i] += 1
            assert self._schedule is not None, "the Simulation gives the fleet its schedule"
            self._schedule(self.clock.now() + dt, READY, i, self.gen[i])

    def start_warm(self, n: int) -> None:
        """Begin the run with ``n`` replicas already warm (a steady state, not a cold fleet)."""
        for _ in range(n):
            i = self._slot()
            self._set(i, BOOTING)
            self._booting += 1
            self.gen[i] += 1
            self.on_ready(i, self.gen[i])
        self._target = max(self._target, self.count[WARM])

    def on_ready(self, i: int, generation: int) -> bool:
        """A start finished; make the replica routable.  False for a cancelled start."""
        if self.gen[i] != generation or self.state[i] != BOOTING:
            return False
        self._booting -= 1
        self._set(i, WARM)
        self.busy[i] = 0
        if self.engines:
            self.engines[i].reset()
        c = self.cfg
        load = ReplicaLoad(self.ids[i], c.model, f"sim://{self.ids[i]}",
                           c.seqs_per_replica, 0, c.kv_capacity_tokens, 0)
        if c.replica is not None:   # a replica reports its measured speed at once
            load.speed = self.engines[i].reported   # with the ITL target its steps plan by
        self.router.upsert(load)
        self._start_pending()
        return True

    def report_loads(self) -> None:
        """Each warm replica's load report (as a live replica's registry meta refreshes the
        front door's view): its engine's queue and context replace the router's own
        accounting for them; slots and KV stay the router's (dispatched requests)."""
        for i, eng in enumerate(self.engines):
            if self.state[i] != WARM:
                continue
            load = self.router.get(self.ids[i])
            if load is not None:
                rep = eng.report()
                load.waiting_seqs = rep["waiting_seqs"]
                load.queued_prefill_tokens = rep["queued_prefill_tokens"]
                load.active_ctx_tokens = rep["active_ctx_tokens"]

    # --- scale-in ------------------------------------------------------------------------
    def _stop(self, i: int) -> None:
        """Take replica ``i`` out of service now (it holds no request)."""
        was = self.state[i]
        if was == WARM:
            self.router.remove(self.ids[i])
        self._set(i, SUSPENDED if self.keep_suspended and was in (WARM, DRAINING) else OFF)
        self.suspended_at[i] = self.clock.now()

    def _scale_in(self, n: int) -> None:
        take = min(n, self._pending_starts)
        self._pending_starts -= take
        n -= take
        # cancel the newest starts first: they have the most start-up left
        for i in reversed(range(len(self.state))):
            if n == 0:
                return
            if self.state[i] == BOOTING:
                self._booting -= 1
                self.gen[i] += 1
                self._set(i, OFF)
                n -= 1
        order = sorted((self.busy[i], i) for i, s in enumerate(self.state) if s == WARM)
        for busy, i in order[:n]:
            if busy == 0:
                self._stop(i)
            else:
                self.router.remove(self.ids[i])
                self._set(i, DRAINING)
        self._start_pending()

    def expire_suspended(self) -> None:
        if not self.count[SUSPENDED]:
            return
        limit = self.clock.now() - self.suspended_ttl_s
        for i, s in enumerate(self.state):
            if s == SUSPENDED and self.suspended_at[i] <= limit:
                self._set(i, OFF)

    # --- requests ------------------------------------------------------------------------
    def on_complete(self, i: int) -> None:
        """A request on replica ``i`` finished; a draining replica stops when it is empty."""
        self.busy[i] -= 1
        if self.state[i] == DRAINING and self.busy[i] == 0:
            self._stop(i)

    def finish(self) -> None:
        """Close the books at the current clock (call once at the end of a run)."""
        self._accrue()
