"""Asking for capacity from the request path: how many restores, and what their end means.

:class:`Restores` owns the :class:`~agent.frontdoor.capacity.CapacityRequester` and the
restore tasks.  The number asked for comes from the queue over one replica's measured
sustainable concurrency at the SLO (:meth:`agent.frontdoor.budgets.Budgets.per_replica`),
not from KV slots.  A restore's end is reported to a :class:`RestoreOwner` (the request
path: it drains and re-checks the model's queue), its replica to a :class:`Registering`
(the :class:`~agent.frontdoor.replica_view.ReplicaView`), and what it measured to a
:class:`Measuring` (the :class:`~agent.frontdoor.budgets.Budgets`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from agent.clock import Clock
from agent.errors import RewarmError
from agent.frontdoor.capacity import NODE_PATHS, CapacityRequester, RestoreGate
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.model_state import ModelStates, RestoreRecord
from agent.frontdoor.router import Router
from agent.telemetry import Telemetry
from agent.wire import refusals

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.router import ReplicaLoad

log = logging.getLogger("agent.frontdoor.request_path")


class RestoreOwner(Protocol):
    """What a restore's end is reported to (the request path's queue side)."""

    def drain(self, model: str) -> None:
        """Dispatch what the new capacity can start."""
        ...

    def recheck(self, model: str) -> None:
        """Refuse queued requests that capacity in sight no longer starts in time."""
        ...

    def refuse_queued(self, model: str, reason: str, refusal: str) -> None:
        """Answer every queued request of ``model`` 503 with ``reason`` and ``refusal``."""
        ...


class Registering(Protocol):
    """Where a restored replica goes (:class:`~agent.frontdoor.replica_view.ReplicaView`)."""

    def restored(self, model: str, load: ReplicaLoad, record: RestoreRecord) -> None:
        ...


class Measuring(Protocol):
    """Sizing and measurement (:class:`~agent.frontdoor.budgets.Budgets`)."""

    def per_replica(self, model: str) -> int:
        ...

    def restore_measured(self, model: str, restore_ms: float, path: str = ...) -> None:
        ...


class RestoresNeeded(Protocol):
    """The restores a queue needs (the planner's
    :meth:`~agent.frontdoor.planner.QueuePlanner.restores_needed`)."""

    def __call__(self, model: str, flights: list, now: float, room: int) -> int:
        ...


RETRY_FIRST_S = 0.25
"""Seconds before asking again after one failed restore while requests wait."""
RETRY_MAX_S = 10.0
"""The longest wait between asks after failed restores in a row.  The wait doubles per
failure from RETRY_FIRST_S up to this (exponential backoff, as Nomad's own reschedule
policy's ``delay_function = "exponential"`` capped at ``max_delay``,
developer.hashicorp.com/nomad/docs/job-specification/reschedule): a requester that refuses
at once (a scaler at its policy's maximum) is otherwise asked again on every re-check,
tens of times a second, for as long as requests wait."""

RECHECK_HELD = 128
"""Queued requests placed when judging the restores a queue needs (earliest deadline first;
a longer queue's tail is judged as it moves up)."""


class Restores:
    """Restores asked for, their outcomes and what they measure (module docstring)."""

    def __init__(self, config: FrontDoorConfig, clock: Clock, telemetry: Telemetry,
                 router: Router, gate: RestoreGate, models: ModelStates,
                 capacity: CapacityRequester | None, sizing: Measuring,
                 replicas: Registering, owner: RestoreOwner,
                 needed: RestoresNeeded | None = None) -> None:
        self.config = config
        self.clock = clock
        self.telemetry = telemetry
        self.router = router
        self.gate = gate
        self.models = models
        self.capacity = capacity
        self.sizing = sizing
        self.replicas = replicas
        self.owner = owner
        self.needed = needed   # the planner's count of the restores the queue needs
        self._tasks: set[asyncio.Task] = set()  # held: the loop keeps weak references

    @property
    def can_restore(self) -> bool:
        """Whether a capacity requester is configured."""
        return self.capacity is not None

    def maybe_restore(self, model: str) -> None:
        """Ask for the replicas the queue needs: the fewest more with which the replicas warm
        and those being restored start its requests in time (``needed``: the planner's
        :meth:`~agent.frontdoor.planner.QueuePlanner.restores_needed`), within the gate's
        room; without a planner, its length over one replica's measured sustainable
        concurrency at the SLO, less restores in flight.  A queue the capacity coming drains
        in time asks for nothing: a replica more is paid for only where the SLO needs it."""
        if self.capacity is None:
            return
        state = self.models.of(model)
        now = self.clock.now()
        if now < state.capped_until_s:
            return
        queue = state.queue
        if not queue:
            return
        if self.needed is None:
            self.restore_for(model, self.gate.wanted(model, len(queue),
                                                     self.sizing.per_replica(model)))
            return
        room = self.gate.room(model)
        if room > 0:
            self.restore_for(model, self.needed(
                model, [p.payload for p in queue.ordered(RECHECK_HELD)], now, room))

    def after_refusal(self, model: str) -> None:
        """A request of ``model`` was refused at arrival (429): demand is seen, so one
        restore is asked for the next ones, unless one is in flight or the node's cap
        backoff runs."""
        if not self.gate.in_flight.get(model) and \
                self.clock.now() >= self.models.of(model).capped_until_s - 1e-3:
            self.restore_for(model, 1)

    def _probe_restore(self, model: str) -> None:
        """After a node answered at its cap, or a restore failed: ask once more (one restore,
        not a queue's worth) if requests still wait, nothing is in flight and no later
        backoff runs."""
        if self.models.queue(model) and not self.gate.in_flight.get(model) and \
                self.clock.now() >= self.models.of(model).capped_until_s - 1e-3:
            self.restore_for(model, 1)

    def restore_for(self, model: str, n: int) -> None:
        """Start up to ``n`` restores of ``model`` (within the gate's room)."""
        if self.capacity is None:
            return
        now = self.clock.now()
        self.models.forget_slots(model)
        for _ in range(min(n, self.gate.room(model))):
            self.gate.started(model, now)
            # a reference is kept until it ends: the event loop holds tasks weakly, and one
            # awaiting a future nothing else refers to would be collected mid-restore (its
            # ``finally`` then ends the restore in the gate's count: capacity vanishes)
            task = asyncio.get_running_loop().create_task(self.restore(model))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self.telemetry.restores_in_flight(self.gate.total)

    async def restore(self, model: str) -> None:
        """One restore of ``model``: ask the requester, record what it measured and the
        replica it made, then let the queue use it (or refuse it when nothing can).  A
        failure with requests still queued holds further asks back (RETRY_FIRST_S doubling
        per failure in a row, at most RETRY_MAX_S), then asks once more for one replica."""
        ok = False
        retry_s = 0.0
        state = self.models.of(model)
        started = self.clock.now()
        before = {r.replica_id for r in self.router.warm(model)}
        try:
            assert self.capacity is not None   # restore_for starts none without one
            result = await self.capacity.request_restore(model)
            ok = True
            if result.replica is None:   # it came through the registry (a scaler): which tier?
                result.path = self._came_up(model, before, result.path)
            self.telemetry.restore_outcome(model, True)
            now = self.clock.now()
            record = state.last_restore = RestoreRecord(now, result.path, result.restore_ms)
            if result.path != "warm_hit":  # an existing replica's answer measures nothing
                self.sizing.restore_measured(model, result.restore_ms or (now - started) * 1000.0,
                                             result.path)
            if result.replica is not None:
                self.replicas.restored(model, result.replica, record)
            warm = len(self.router.warm(model))
            if result.path == "warm_hit" and warm:
                # The node is at its replica cap with ``warm`` replicas (the answer's
                # included): admission counts no restorable capacity beyond that many, now
                # and after replicas leave and come back (:meth:`replica_room`).  The latest
                # answer is the cap, lower too (a node left with its replicas: a cap kept at
                # its old height would admit every later burst on restores no node makes).
                # None in view (a scale-in raced the answer): no cap, or a wrong one of 0.
                state.replica_cap = warm
            elif result.path != "warm_hit" and state.replica_cap is not None \
                    and warm > state.replica_cap:
                state.replica_cap = None       # a restore went past it: capacity grew
        except Exception as exc:  # the requester's failure, whatever it is, ends this restore
            state.restore_failures += 1
            retry_s = min(RETRY_FIRST_S * 2.0 ** (state.restore_failures - 1), RETRY_MAX_S)
            log.warning("restore of %s failed (%d in a row; no restore asked for %.2f s): %s",
                        model, state.restore_failures, retry_s, exc)
            reason = exc.message if isinstance(exc, RewarmError) else str(exc)
            self.telemetry.restore_outcome(model, False, reason)
        else:
            state.restore_failures = 0
        finally:
            self.gate.finished(model)
            state.slot_plan = None
            self.telemetry.restores_in_flight(self.gate.total)
        queue = state.queue
        if not ok and queue:
            # held back before the re-check below, which would otherwise ask again at once
            state.capped_until_s = max(state.capped_until_s, self.clock.now() + retry_s)
            asyncio.get_running_loop().call_later(retry_s, self._probe_restore, model)
        if not queue:
            return
        self.owner.drain(model)
        self.owner.recheck(model)
        if ok:
            if queue and result.path == "warm_hit":
                # Asking again at once would spin; queued requests go as it frees slots.
                backoff_s = self.config.at_capacity_backoff_s
                state.capped_until_s = self.clock.now() + backoff_s
                asyncio.get_running_loop().call_later(backoff_s, self._probe_restore, model)
            elif queue:
                self.maybe_restore(model)
        elif not self.gate.in_flight.get(model) and not self.router.warm(model):
            # nothing can succeed now: say so promptly
            self.owner.refuse_queued(model, f"model {model!r}: no capacity can be restored: "
                                     f"{reason}", refusals.NO_CAPACITY)

    def replica_room(self, model: str) -> int | None:
        """How many more replicas of ``model`` can come up before its nodes' replica cap:
        the cap (the replicas in view when a node last answered a restore with one it had,
        ``warm_hit``) less the replicas in view; None before any such answer, or after a
        restore went past it (then its nodes had room again: a node joined).  The cap is
        kept while replicas leave and come back, so a model scaled to zero between bursts
        does not count, at its next burst, on capacity its nodes cannot give (requests
        admitted on it were refused at the next re-check, once the node's answer came).
        An ask beyond the cap still goes out, at most every ``at_capacity_backoff_s`` while
        demand is seen, so a node that joins is found."""
        state = self.models.get(model)
        if state is None or state.replica_cap is None:
            return None
        return state.replica_cap - len(self.router.warm(model))

    def at_cap(self, model: str) -> bool:
        """Whether ``model``'s replicas are at its nodes' replica cap (:meth:`replica_room`)."""
        room = self.replica_room(model)
        return room is not None and room <= 0

    def _came_up(self, model: str, before: set[str], path: str) -> str:
        """The path of the replica of ``model`` that appeared since ``before`` (its node
        agent's ``came_up`` meta, agent/frontdoor/capacity.py's NODE_PATHS), else ``path``:
        a cold boot through Nomad must not count as a snapshot restore's ETA."""
        for load in self.router.warm(model):
            if load.replica_id not in before and load.came_up in NODE_PATHS:
                return NODE_PATHS[load.came_up]
        return path
