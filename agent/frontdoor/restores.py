"""Asking for capacity from the request path: how many restores, and what their end means.

A mixin of :class:`~agent.frontdoor.request_path.RequestPath`; it reads and updates the
path's ``capacity`` (the :class:`~agent.frontdoor.capacity.CapacityRequester`), ``gate``,
``restore_times``, ``queues``, ``router``, ``last_restore``, ``came_up``, ``known_models``,
``_deadline_ms``, ``_max_seqs``, ``_upserted``, ``_capped_until`` and ``_capped``, and calls its
``_drain``, ``_recheck``, ``_fail``, ``_per_replica`` and ``upsert``.  The number asked for
comes from the queue over one replica's measured sustainable concurrency at the SLO
(docs/architecture.md, "Capacity from measured rates"), not from KV slots.
"""

from __future__ import annotations

import asyncio
import logging

from agent.errors import RewarmError
from agent.frontdoor.capacity import NODE_PATHS

log = logging.getLogger("agent.frontdoor.request_path")


class Restores:
    """Restores asked for, their outcomes and what they measure (module docstring)."""

    def _maybe_restore(self, model: str) -> None:
        """Ask for the replicas the queue needs: its length over one replica's measured
        sustainable concurrency at the SLO (:meth:`_per_replica`), less restores in flight."""
        if self.capacity is None or self.clock.now() < self._capped_until.get(model, 0.0):
            return
        self._restore_for(model, self.gate.wanted(model, len(self.queues[model]),
                                                  self._per_replica(model)))

    def _probe_restore(self, model: str) -> None:
        """After a node answered at its cap: ask once more (one restore, not a queue's worth)
        if requests still wait and nothing is in flight."""
        if self.queues.get(model) and not self.gate.in_flight.get(model):
            self._restore_for(model, 1)

    def _restore_for(self, model: str, n: int) -> None:
        if self.capacity is None:
            return
        now = self.clock.now()
        self._slot_cache.pop(model, None)
        for _ in range(min(n, self.gate.room(model))):
            self.gate.started(model, now)
            # a reference is kept until it ends: the event loop holds tasks weakly, and one
            # awaiting a future nothing else refers to would be collected mid-restore (its
            # ``finally`` then ends the restore in the gate's count: capacity vanishes)
            task = asyncio.get_running_loop().create_task(self._restore(model))
            self._restore_tasks.add(task)
            task.add_done_callback(self._restore_tasks.discard)
        self.telemetry.restores_in_flight(self.gate.total)

    async def _restore(self, model: str) -> None:
        ok = False
        started = self.clock.now()
        before = {r.replica_id for r in self.router.warm(model)}
        try:
            result = await self.capacity.request_restore(model)
            ok = True
            if result.replica is None:   # it came through the registry (a scaler): which tier?
                result.path = self._came_up(model, before, result.path)
            self.telemetry.restore_outcome(model, True)
            now = self.clock.now()
            self.last_restore[model] = (now, result.path, result.restore_ms)
            if result.path != "warm_hit":  # an existing replica's answer measures nothing
                self._capped.pop(model, None)  # and a new replica ends the cap
                self._restore_measured(model, result.restore_ms or (now - started) * 1000.0,
                                       result.path)
            if result.replica is not None:
                self._max_seqs[model] = max(self._max_seqs.get(model, 0),
                                            result.replica.max_seqs)
                self.upsert(result.replica)
                if result.path != "warm_hit":
                    self.came_up[result.replica.replica_id] = (now, result.path, result.restore_ms)
                    while len(self.came_up) > 1024:       # oldest first out
                        del self.came_up[next(iter(self.came_up))]
                self.known_models.add(model)
                self._upserted[result.replica.replica_id] = self.clock.now()
            warm = len(self.router.warm(model))
            if result.path == "warm_hit" and warm:
                # The node is at its replica cap: until one of the ``warm`` replicas (the
                # answer's included) leaves, admission counts no capacity that could be
                # restored (:meth:`_at_cap`).  None in view (a scale-in raced the answer):
                # no cap, or it could never be seen to lift.
                self._capped[model] = warm
        except Exception as exc:  # the requester's failure, whatever it is, ends this restore
            log.warning("restore of %s failed: %s", model, exc)
            reason = exc.message if isinstance(exc, RewarmError) else str(exc)
            self.telemetry.restore_outcome(model, False, reason)
        finally:
            self.gate.finished(model)
            self._slot_cache.pop(model, None)
            self.telemetry.restores_in_flight(self.gate.total)
        queue = self.queues.get(model)
        if not queue:
            return
        self._drain(model)
        self._recheck(model)
        if ok:
            if queue and result.path == "warm_hit":
                # Asking again at once would spin; queued requests go as it frees slots.
                backoff_s = self.config.at_capacity_backoff_s
                self._capped_until[model] = self.clock.now() + backoff_s
                asyncio.get_running_loop().call_later(backoff_s, self._probe_restore, model)
            elif queue:
                self._maybe_restore(model)
        elif not self.gate.in_flight.get(model) and not self.router.warm(model):
            # nothing can succeed now: say so promptly
            self.refuse_queued(model, f"model {model!r}: no capacity can be restored: {reason}")

    def _at_cap(self, model: str) -> bool:
        """Whether ``model``'s last restore was answered by an existing replica (its node at
        the replica cap) and no warm replica of it has left since (of the most seen while
        capped).  Then a request that the warm replicas cannot start in time is refused at
        arrival: admitted on a restore the node cannot make, it would be refused at the
        next re-check (most late 429s of the live replay at 3x load were such requests).
        Asking again (at most every ``at_capacity_backoff_s``, while demand is seen) still
        finds capacity that returns; a restore that makes a replica ends it."""
        most = self._capped.get(model)
        if most is None:
            return False
        warm = len(self.router.warm(model))
        if warm < most:          # one left (drained, died): its slot may be free now
            del self._capped[model]
            return False
        self._capped[model] = warm   # the most seen while capped (one restoring came up)
        return True

    def refuse_queued(self, model: str, reason: str) -> None:
        """Answer every request queued for ``model`` 503 with ``reason`` (never dispatched)."""
        for p in self.queues[model].drain():
            self._fail(p.payload, 503, reason)
        self.telemetry.queue_depth(model, 0)

    def _came_up(self, model: str, before: set[str], path: str) -> str:
        """The path of the replica of ``model`` that appeared since ``before`` (its node
        agent's ``came_up`` meta, agent/frontdoor/capacity.py's NODE_PATHS), else ``path``:
        a cold boot through Nomad must not count as a snapshot restore's ETA."""
        for load in self.router.warm(model):
            if load.replica_id not in before and load.came_up in NODE_PATHS:
                return NODE_PATHS[load.came_up]
        return path

    def _restore_measured(self, model: str, restore_ms: float,
                          path: str = "snapshot_restore") -> None:
        self.restore_times.record(model, restore_ms, path)
        self._budgets.pop(model, None)
        if model not in self.config.models:
            self._deadline_ms[model] = max(
                self.config.default_deadline_ms,
                self.config.deadline_per_restore_p99 * self.restore_times.p99_ms(model))
