"""Suspend and resume a replica process with the CUDA checkpoint driver API (GPU nodes).

Suspend = lock + checkpoint: CUDA calls in the replica block, its device memory is parked in
host RAM by the driver and the GPU is free.  Resume = restore (optionally onto other GPUs, by
UUID pairs) + unlock.  The driver calls block for as long as the copy takes (many seconds per
GPU for large models), so each runs on a helper thread bounded by ``toggle_timeout_s``; the
lock has its own driver-side ``lock_timeout_s``.  Defaults are generous on purpose.

Failures leave the process in a known, reported state:

* lock fails: nothing changed; the replica keeps RUNNING and serving.
* checkpoint fails: the process is unlocked again (RUNNING) when the driver allows it.
* restore or unlock fails: :class:`ResumeFailed` carries the driver's state afterwards; the
  caller (the agent) kills the process and falls back to a snapshot restore.

The suspended tier through the node agent (:class:`SuspendResume`): a replica is parked only
once its in-flight requests are done (it is deregistered first, so none arrive), it answers no
request while parked (not in the registry; its CUDA calls block in the driver), and the
registry shows the tier on the agent's own entry (:class:`ParkedTier`: which replicas are
parked, and the resume ETA, the p99 of this node's measured resumes), so a front door asking
for capacity tries that node first (agent/frontdoor/capacity.py ``nodes_from_registry``).  A
``restore`` of a model with a parked replica resumes it (path ``resume``) before any snapshot
is read (:meth:`SuspendResume.resume_parked`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from agent.clock import Clock, SystemClock
from agent.cluster.base import RESUME_P99_META_KEY, SUSPENDED_META_KEY
from agent.errors import ConfigError, CudaCheckpointError, DriverUnavailable
from agent.node.bounded import call_within
from agent.node.cuda_checkpoint import CudaCheckpointDriver, ProcessState
from agent.node.lifecycle import IllegalTransition, ReplicaState as S

if TYPE_CHECKING:
    import threading as _threading

    from agent.cluster.base import ServiceInstance
    from agent.node.registration import Registrar
    from agent.node.state import AgentConfig, ReplicaRecord

log = logging.getLogger("agent.node.agent")

T = TypeVar("T")

DEFAULT_LOCK_TIMEOUT_S = 60.0
DEFAULT_TOGGLE_TIMEOUT_S = 600.0


class ResumeFailed(CudaCheckpointError):
    """Restore or unlock failed; ``state`` is the driver's view afterwards (or None).

    The process must not serve: kill it and restore from a snapshot.
    """


@dataclass
class StepTimes:
    """Seconds each driver step took, by step name (``lock``, ``checkpoint``...)."""

    steps_s: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(self.steps_s.values())


class Suspender:
    """Suspend/resume process ids through a :class:`CudaCheckpointDriver`.

    ``lock_timeout_s`` goes to the driver (0 means wait forever); ``toggle_timeout_s`` bounds
    each blocking checkpoint/restore call.  Raises ConfigError for out-of-range timeouts.
    """

    def __init__(self, driver: CudaCheckpointDriver, *, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
                 toggle_timeout_s: float = DEFAULT_TOGGLE_TIMEOUT_S, clock: Clock | None = None) -> None:
        if lock_timeout_s < 0:
            raise ConfigError(f"lock_timeout_s={lock_timeout_s} is negative; limit >= 0",
                              name="lock_timeout_s", value=lock_timeout_s, limit=0)
        if toggle_timeout_s <= 0:
            raise ConfigError(f"toggle_timeout_s={toggle_timeout_s} must be > 0",
                              name="toggle_timeout_s", value=toggle_timeout_s, limit=0)
        self.driver = driver
        self.lock_timeout_s = lock_timeout_s
        self.toggle_timeout_s = toggle_timeout_s
        self.clock = clock or SystemClock()

    def _timed(self, times: StepTimes, step: str, fn: Callable[[], T]) -> T:
        start = self.clock.now()
        try:
            return call_within(fn, self.toggle_timeout_s, step)
        except TimeoutError:
            raise CudaCheckpointError(
                f"{step} did not finish within toggle_timeout_s={self.toggle_timeout_s}",
                call=step, result=None, name="timeout", value=self.toggle_timeout_s,
                limit=self.toggle_timeout_s) from None
        finally:
            times.steps_s[step] = self.clock.now() - start

    def state(self, pid: int) -> ProcessState | None:
        """The driver's state for ``pid``, or None when it cannot say."""
        try:
            return self.driver.get_state(pid)
        except CudaCheckpointError:
            return None

    def suspend(self, pid: int) -> StepTimes:
        """Lock + checkpoint ``pid``. Raises CudaCheckpointError (process left RUNNING when the
        driver allows) or DriverUnavailable."""
        times = StepTimes()
        self._timed(times, "lock", lambda: self.driver.lock(pid, self.lock_timeout_s))
        try:
            self._timed(times, "checkpoint", lambda: self.driver.checkpoint(pid))
        except CudaCheckpointError:
            if self.state(pid) == ProcessState.LOCKED:
                self.driver.unlock(pid)
            raise
        return times

    def resume(self, pid: int, gpu_pairs: Sequence[tuple[bytes, bytes]] = ()) -> StepTimes:
        """Restore + unlock ``pid``. Raises ResumeFailed (state attached) or DriverUnavailable."""
        times = StepTimes()
        for step, fn in (("restore", lambda: self.driver.restore(pid, gpu_pairs)),
                         ("unlock", lambda: self.driver.unlock(pid))):
            try:
                self._timed(times, step, fn)
            except CudaCheckpointError as exc:
                if isinstance(exc, (ResumeFailed, DriverUnavailable)):
                    raise
                state = self.state(pid)
                raise ResumeFailed(
                    f"resume of pid {pid} failed at {step}: {exc.message}; process state now "
                    f"{state.name if state is not None else 'unknown'}; kill it and restore "
                    "from a snapshot", call=getattr(exc, "call", step),
                    result=getattr(exc, "result", None), name=getattr(exc, "name", None),
                    pid=pid, step=step, state=state) from exc
        return times


class ParkedTier:
    """This node's suspended tier as its registry entry shows it.

    ``window``: how many of the latest resumes the ETA is taken over.  :meth:`eta_s` is their
    p99 (nearest rank: the smallest measured time with at least 99 % of the window at or below
    it), None before the first resume: an ETA is a measurement or nothing."""

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ConfigError(f"ParkedTier window={window} must be >= 1", name="window",
                              value=window, limit=1)
        self._resumes_s: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def record_resume(self, seconds: float) -> None:
        with self._lock:
            self._resumes_s.append(float(seconds))

    def eta_s(self) -> float | None:
        with self._lock:
            ordered = sorted(self._resumes_s)
        if not ordered:
            return None
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    def meta(self, parked: Sequence[tuple[str, str, str]]) -> dict[str, str]:
        """Registry meta for ``parked`` ``(model, version, replica)``: ``suspended`` =
        ``model@version:replica`` joined by commas, ``resume_p99_s`` = the ETA in seconds
        (``repr`` of a float; "" before any resume was measured)."""
        eta = self.eta_s()
        return {SUSPENDED_META_KEY: ",".join(f"{m}@{v}:{r}" for m, v, r in sorted(parked)),
                RESUME_P99_META_KEY: "" if eta is None else repr(round(eta, 4))}


class SuspendView(Protocol):
    """What suspend/resume needs of the node agent's state (agent/node/state.py)."""

    @property
    def registrar(self) -> Registrar: ...
    @property
    def config(self) -> AgentConfig: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def lock(self) -> _threading.RLock: ...
    @property
    def replicas(self) -> dict[str, ReplicaRecord]: ...
    @property
    def agent_id(self) -> str: ...
    def rec(self, replica_id: str) -> ReplicaRecord: ...
    def record(self, rec: ReplicaRecord, snapshot_id: str | None = None) -> None: ...
    def replica_instance(self, rec: ReplicaRecord) -> ServiceInstance: ...
    def agent_meta(self) -> dict[str, str]: ...


class SuspendResume:
    """The node agent's ``suspend``/``resume`` ops over :class:`Suspender` (None: this node
    cannot suspend).  ``restore(model, device)`` brings a replica up from a snapshot when a
    resume fails (the node agent's restore ladder); ``sleep`` waits between in-flight polls
    (the clock's, in tests); ``tier`` keeps the measured resume times (the registry's ETA)."""

    def __init__(self, state: SuspendView, suspender: Suspender | None,
                 restore: Callable[[str, str | None], dict[str, Any]], *,
                 sleep: Callable[[float], None] | None = None,
                 tier: ParkedTier | None = None) -> None:
        import time

        self.state, self.suspender, self._restore = state, suspender, restore
        self._sleep = sleep or time.sleep
        self.tier = tier or ParkedTier()

    def _need_suspender(self, rec: ReplicaRecord, op: str) -> tuple[Suspender, int]:
        """The suspender and the replica's pid for ``op`` ("suspend" or "resume"); ConfigError
        (409) naming the op, the replica and why when this node or replica cannot do it."""
        if self.suspender is None or rec.handle is None or rec.handle.pid is None:
            verb = {"suspend": "suspended", "resume": "resumed"}[op]
            raise ConfigError(
                f"replica {rec.lifecycle.replica_id} cannot be {verb}: "
                + ("this node has no CUDA checkpoint support (GPU nodes only)"
                   if self.suspender is None else "it has no process of its own"),
                name=op, value=rec.lifecycle.replica_id, limit="GPU replica process")
        return self.suspender, rec.handle.pid

    def suspend(self, replica_id: str) -> dict[str, Any]:
        """Park the replica's device memory in host RAM (lock + checkpoint); it stops serving.

        It is deregistered first, then its in-flight requests may finish for up to
        ``drain_timeout_s`` (a request frozen mid-decode would be served late).  Raises
        ConfigError (not suspendable, or still busy past that bound: it is registered again
        and keeps serving), CudaCheckpointError (it keeps serving)."""
        st = self.state
        rec = st.rec(replica_id)
        suspender, pid = self._need_suspender(rec, "suspend")
        if rec.lifecycle.state is not S.WARM:
            raise IllegalTransition(
                f"replica {replica_id} is {rec.lifecycle.state.value}; only a warm replica "
                "can be suspended", replica=replica_id,
                value=(rec.lifecycle.state.value, S.SUSPENDED.value), limit=[S.WARM.value])
        st.registrar.drop(replica_id)
        try:
            self._quiesce(rec)
            times = suspender.suspend(pid)
        except (CudaCheckpointError, ConfigError):
            st.registrar.want(st.replica_instance(rec))
            raise
        rec.lifecycle.move(S.SUSPENDED, "lock+checkpoint")
        st.record(rec)
        self._publish_tier()
        return {**rec.describe(), "steps_s": times.steps_s}

    def _quiesce(self, rec: ReplicaRecord) -> None:
        """Wait (``drain_poll_s`` steps, at most ``drain_timeout_s``) until ``rec`` has no
        request in flight; ConfigError naming the count when it still has some."""
        cfg, clock = self.state.config, self.state.clock
        assert rec.handle is not None        # _need_suspender checked it
        start = clock.now()
        while (busy := rec.handle.in_flight()) > 0:
            if clock.now() - start >= cfg.drain_timeout_s:
                raise ConfigError(
                    f"replica {rec.lifecycle.replica_id} still has {busy} requests in flight "
                    f"after drain_timeout_s={cfg.drain_timeout_s}; not suspended",
                    name="in_flight", value=busy, limit=0)
            self._sleep(cfg.drain_poll_s)

    def parked(self, model: str | None = None) -> list[ReplicaRecord]:
        """The suspended replicas' records (of ``model`` when given), oldest first."""
        with self.state.lock:
            return [r for r in self.state.replicas.values() if r.lifecycle.state is S.SUSPENDED
                    and (model is None or r.spec.name == model)]

    def _publish_tier(self) -> None:
        self.state.registrar.update_meta(self.state.agent_id, self.state.agent_meta())

    def resume_parked(self, model: str) -> dict[str, Any] | None:
        """Resume the newest parked replica of ``model`` (the fastest way up: no snapshot is
        read); None when none is parked, or this node cannot resume.  A resume that fails
        restores from a snapshot instead (:meth:`resume`)."""
        if self.suspender is None:
            return None
        parked = self.parked(model)
        if not parked:
            return None
        return self.resume(parked[-1].lifecycle.replica_id)

    def resume(self, replica_id: str) -> dict[str, Any]:
        """Restore + unlock.  A failed resume kills the process and restores the model from
        its snapshot instead (the answer then describes the new replica)."""
        st = self.state
        rec = st.rec(replica_id)
        suspender, pid = self._need_suspender(rec, "resume")
        if rec.lifecycle.state is not S.SUSPENDED:
            raise IllegalTransition(
                f"replica {replica_id} is {rec.lifecycle.state.value}, not suspended",
                replica=replica_id, value=(rec.lifecycle.state.value, S.WARM.value),
                limit=[S.SUSPENDED.value])
        start = st.clock.now()
        try:
            times = suspender.resume(pid)
        except ResumeFailed as exc:
            log.error("%s; killing pid %d and restoring from a snapshot", exc, pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            rec.lifecycle.move(S.DEAD, f"resume failed: {exc.name}")
            st.record(rec)
            self._publish_tier()
            return {**self._restore(rec.spec.name, rec.device), "resume_failed": str(exc)}
        self.tier.record_resume(st.clock.now() - start)
        rec.lifecycle.move(S.WARM, "restore+unlock")
        rec.path = "resume"     # registry meta came_up: the front door counts the tier
        st.record(rec)
        st.registrar.want(st.replica_instance(rec))
        self._publish_tier()
        return {**rec.describe(load=True), "steps_s": times.steps_s}
