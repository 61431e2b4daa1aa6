"""The admission queues of the request path: holding, draining, re-checking, expiring.

:class:`Queues` holds a request that no warm replica can start within its warm budget when
capacity in sight (the :class:`~agent.frontdoor.planner.QueuePlanner`'s slots) can start it
within its deadline, else refuses it (429 with ``retry_after_ms``, naming the deadline
that applied) at once; it dispatches held requests earliest deadline first as replicas can
start them, refuses those whose prediction went bad (429, as soon as known) and answers
those whose deadline passed (504, logged with the prediction it broke).  One held while
nothing of its model is warm waits for the start under way and is served when that replica
comes up, never refused or expired at its deadline.  Each model's queue is its
:class:`~agent.frontdoor.model_state.ModelState`'s ``queue``; answers and dispatches go
through a :class:`QueueOwner` (the request path).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from agent.clock import Clock
from agent.errors import Overloaded
from agent.frontdoor.admission import AdmissionQueue, Pending
from agent.frontdoor.capacity import RestoreGate, RestoreTimes
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.model_state import ModelStates, RestoreRecord
from agent.frontdoor.planner import QueuePlanner
from agent.frontdoor.ratelog import RateLimitedLog
from agent.frontdoor.router import ReplicaLoad, Router
from agent.telemetry import Telemetry
from agent.wire import refusals

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.request import Flight

log = logging.getLogger("agent.frontdoor.request_path")

DRAIN_SKIP = 32    # queued requests passed over per drain when the head cannot go yet
EXACT_QUEUE = 32   # longer queues: a new request is placed after len(queue) slots
RECHECK_MAX = 128  # queued requests re-checked each time, earliest deadline first
RETRY_AFTER_UNKNOWN_MS = 1000
"""The floor of a 429's ``retry_after_ms`` when the capacity that would serve the request is
a start nothing has timed yet (no restore of the model measured, no cold boot of it either),
and its value when no capacity is in sight at all: about one registry refresh and one
restore decision, after which the front door knows more.  (Without it the ETA of an
unmeasured start is "now", and clients were told to retry after 1 ms.)"""


class QueueOwner(Protocol):
    """Where held requests go out (the request path)."""

    def dispatch(self, flight: Flight, replica: ReplicaLoad, predicted_s: float,
                 now: float | None = None) -> None:
        """Send ``flight`` to ``replica`` (predicted TTFT ``predicted_s`` from now)."""
        ...

    def fail(self, flight: Flight, code: int, reason: str, path: str = "refused",
             retry_after_ms: int | None = None, predicted_ttft_ms: float | None = None,
             refusal: str | None = None) -> None:
        """Answer ``flight`` with an error (its final answer); ``refusal``: why, as one of
        agent/wire/refusals.py's codes."""
        ...


class RestoreAsker(Protocol):
    """What the queues ask of the restores side (:class:`~agent.frontdoor.restores.Restores`)."""

    def maybe_restore(self, model: str) -> None:
        ...

    def after_refusal(self, model: str) -> None:
        ...


class DeadlineNames(Protocol):
    """What set a request's deadlines (:class:`~agent.frontdoor.budgets.Budgets`)."""

    def deadline_names(self, model: str, deadline_ms: float | None,
                       prompt_tokens: int = 0) -> tuple[str, str]:
        ...


class Queues:
    """The per-model admission queues and what moves requests through them (module docstring)."""

    def __init__(self, config: FrontDoorConfig, clock: Clock, telemetry: Telemetry,
                 router: Router, models: ModelStates, counts: dict[str, int],
                 restore_times: RestoreTimes, planner: QueuePlanner, restores: RestoreAsker,
                 owner: QueueOwner, budgets: DeadlineNames, gate: RestoreGate) -> None:
        self.config = config
        self.clock = clock
        self.telemetry = telemetry
        self.router = router
        self.models = models
        self.counts = counts
        self.restore_times = restore_times
        self.planner = planner
        self.restores = restores
        self.owner = owner
        self.budgets = budgets
        self.gate = gate
        self.queued_models: set[str] = set()   # models whose queue may hold requests
        self._expired_log = RateLimitedLog(log, "504s (deadline passed while queued)",
                                           clock=clock, interval_s=config.accept_log_interval_s)

    def hold(self, flight: Flight, warm_pred_s: float | None) -> None:
        """Queue ``flight`` if capacity can start it before its deadline, else 429 at once.
        ``warm_pred_s``: the best warm replica's prediction (for the refusal's reason)."""
        model, now = flight.model, self.clock.now()
        state = self.models.of(model)
        queue = state.queue
        if queue is None:
            queue = state.queue = AdmissionQueue(
                model, clock=self.clock, max_depth=self.config.max_queue_depth,
                max_wait_s=self.config.max_wait_s)
        # the queue ahead (earlier deadlines) takes its slots first
        if len(queue) <= EXACT_QUEUE:
            before, skip = [p.payload for p in queue.ordered()
                            if p.deadline_s <= flight.deadline_s], 0
        else:  # a long queue: the ones ahead are taken to hold the first slots
            before, skip = [], len(queue)
        # Admitted with a margin: one decode step at a full batch (the slot model's quantum
        # of error) and one re-check interval, so that a small error is a 429 now, not later.
        margin_s = self.config.recheck_s + self.router.prior(model).decode_step_s(
            state.max_seqs or self.config.default_max_seqs)
        ttft_s, first, queue_late = self.planner.admit(model, before, flight, now, margin_s,
                                                       skip)
        if ttft_s is None and queue_late:   # within its deadline, but the queue makes it late
            retry_ms = self.retry_after_ms(model, first, now)
            self.counts["shed_429"] += 1
            self.owner.fail(flight, 429, f"model {model!r}: {queue_late}",
                            retry_after_ms=retry_ms, refusal=refusals.DEADLINE_UNREACHABLE)
            self.restores.after_refusal(model)
            return
        if ttft_s is None:
            warm_name, restore_name = self.budgets.deadline_names(
                model, flight.req.deadline_ms, flight.prompt_tokens)
            # a replica already warm must make the warm-hit budget, not this one (planner);
            # with no new replica in sight the warm path's deadline is the one that applied
            if self.planner.etas_s(model, now):
                left_ms, name = (flight.deadline_s - now) * 1000.0, restore_name
                cap = "no capacity in sight can start it in time"
            else:
                left_ms, name = (flight.warm_deadline_s - now) * 1000.0, warm_name
                cap = "no new replica can be started now"
            warm = ("no warm replica with a free slot" if warm_pred_s is None else
                    f"best warm replica predicted {warm_pred_s * 1000:.0f} ms, past the "
                    f"warm-hit budget of {(flight.warm_deadline_s - now) * 1000:.0f} ms")
            retry_ms = self.retry_after_ms(model, first, now)
            self.counts["shed_429"] += 1
            self.owner.fail(flight, 429, f"model {model!r}: cannot start within {left_ms:.0f} ms "
                            f"({name}): {warm}, {cap}, "
                            f"{len(queue)} queued ahead", retry_after_ms=retry_ms,
                            refusal=refusals.DEADLINE_UNREACHABLE)
            self.restores.after_refusal(model)  # demand seen: capacity for the next ones
            return
        flight.predicted_ttft_s = now - flight.arrival_s + ttft_s
        pending = Pending(flight.req.request_id, model, now, flight.deadline_s,
                          flight.need_tokens, flight)
        pending.predicted_ttft_s = flight.predicted_ttft_s
        # Nothing warm and no deadline of the client's own: it waits for the start under way
        # (a cold boot's length is unknown until one is measured), admitted because that
        # start can still make its default deadline; it is served when the replica comes up,
        # late or not, up to the model's default deadline (never the capacity requester's
        # timeout, minutes): then it is answered 429 with the start's estimate as
        # retry_after_ms (expire_queued).  A client's own deadline_ms is kept.
        pending.awaits_start = flight.cold and flight.req.deadline_ms is None
        if pending.awaits_start:
            pending.deadline_s = max(flight.deadline_s, flight.arrival_s + state.deadline_ms / 1000.0)
        try:
            queue.offer(pending)
        except Overloaded as err:
            self.counts["shed_429"] += 1
            self.owner.fail(flight, 429, err.message, retry_after_ms=err.retry_after_ms,
                            refusal=err.refusal)
            return
        flight.pending = pending
        self.queued_models.add(model)
        self.telemetry.queue_depth(model, len(queue))
        self.restores.maybe_restore(model)
        if len(queue) == 1 and warm_pred_s is not None:
            self.drain(model)   # admitted late with a replica that can take it now: sent now

    def retry_after_ms(self, model: str, first_s: float, now: float) -> int:
        """``retry_after_ms`` of a 429 for ``model`` whose earliest slot is at ``first_s``
        (clock s; inf: none in sight): the time to it, from measured figures only.  While no
        restore of the model is measured the new replicas' slots are "now" (their ETA is
        unknown), so the time is to the earliest warm replica's slot, or to the start's
        estimate if sooner: the oldest start in flight (else now) plus the model's measured
        cold-boot p99, at least ``RETRY_AFTER_UNKNOWN_MS`` (also the answer with nothing in
        sight)."""
        inf = float("inf")
        if self.restore_times.p99_ms(model) is None:
            warm_s = next((slot[0] for slot in self.planner.slots(model, now).slots
                           if slot[3]), inf)
            start_s = now + RETRY_AFTER_UNKNOWN_MS / 1000.0
            cold_ms = self.restore_times.p99_ms(model, "cold_boot")
            if cold_ms is not None:
                started = self.gate.started_s.get(model)
                start_s = max(start_s, (started[0] if started else now) + cold_ms / 1000.0)
            first_s = min(warm_s, start_s)
        if first_s == inf:
            first_s = now + RETRY_AFTER_UNKNOWN_MS / 1000.0
        return max(1, round((first_s - now) * 1000))

    def drain(self, model: str) -> None:
        """Dispatch queued requests earliest deadline first while a replica can start them
        within their deadlines.  A request that no replica can take now (its warm deadline
        passed, its restore not in) does not hold back the ones behind it: up to
        ``DRAIN_SKIP`` such are passed over."""
        state = self.models.of(model)
        queue = state.queue
        if queue is None:
            return
        now = self.clock.now()
        restored = state.last_restore
        while queue:
            head = queue.peek()
            if head is None:
                break
            found = self.planner.choose_in_time(head.payload, now)
            if found is None:
                self._drain_past_heads(queue, now, restored)
                break
            queue.pop_earliest()
            self._send_queued(head.payload, found, now, restored)
        self.telemetry.queue_depth(model, len(queue))

    def drain_all(self) -> None:
        """:meth:`drain` every model that has requests queued (the view changed)."""
        for model in list(self.queued_models):
            if self.models.queue(model):
                self.drain(model)

    def _drain_past_heads(self, queue: AdmissionQueue, now: float,
                          restored: RestoreRecord | None) -> None:
        for p in queue.ordered()[1:DRAIN_SKIP + 1]:
            if not self.router.choose(p.model, p.need_tokens):
                return                                   # no slot anywhere: nothing to do
            found = self.planner.choose_in_time(p.payload, now)
            if found is None:
                continue
            queue.cancel(p)                              # out of the heap (lazily)
            self._send_queued(p.payload, found, now, restored)

    def _send_queued(self, flight: Flight, found: tuple[ReplicaLoad, float], now: float,
                     restored: RestoreRecord | None) -> None:
        flight.pending = None
        flight.queue_wait_ms = (now - flight.arrival_s) * 1000.0
        if restored is not None and restored[0] >= flight.arrival_s:
            flight.path, flight.restore_ms = restored[1], restored[2]
        self.owner.dispatch(flight, found[0], found[1])

    def recheck(self, model: str) -> None:
        """Refuse (429) every queued request whose prediction has gone bad: the capacity in
        sight now (restores failed or late, sequences running longer than estimated) cannot
        start it before its deadline.  One that awaits its model's start from zero
        (``Pending.awaits_start``) is not refused: it was admitted on that start, which it
        waits for."""
        state = self.models.of(model)
        queue = state.queue
        if not queue:
            return
        now = self.clock.now()
        state.slot_plan = None
        held = queue.ordered(RECHECK_MAX)  # the rest are checked as they move up
        predicted, first = self.planner.assign(model, [p.payload for p in held], now)
        for p, ttft_s in zip(held, predicted, strict=True):
            flight: Flight = p.payload
            if ttft_s is not None or p.awaits_start:
                continue
            queue.cancel(p)
            self.counts["shed_429"] += 1
            was = (flight.predicted_ttft_s or 0.0) * 1000
            name = self.budgets.deadline_names(model, flight.req.deadline_ms,
                                               flight.prompt_tokens)[1]
            self.owner.fail(flight, 429, f"model {model!r}: queued with a predicted TTFT of "
                            f"{was:.0f} ms; capacity now in sight cannot start it within its "
                            f"deadline of {(p.deadline_s - p.arrival_s) * 1000:.0f} ms "
                            f"({name}; {(p.deadline_s - now) * 1000:.0f} ms left)",
                            retry_after_ms=self.retry_after_ms(model, first, now),
                            refusal=refusals.DEADLINE_UNREACHABLE)
        self.telemetry.queue_depth(model, len(queue))

    def expire_queued(self) -> None:
        """Answer queued requests past their deadline (504: a prediction was wrong, logged
        with it) or wait bound (429), and those held for their model's start from zero past
        the model's default deadline (429, ``retry_after_ms`` from the start's estimate);
        every ``recheck_s`` re-check each queue against the capacity then in sight
        (:meth:`recheck`) and ask for the restores the rest needs (``maybe_restore``)."""
        now = self.clock.now()
        for model in list(self.queued_models):
            state = self.models.of(model)
            queue = state.queue
            assert queue is not None   # a model is queued once its queue is made
            for p in queue.expire():
                flight: Flight = p.payload
                if p.awaits_start:   # the start from zero is not up by the default deadline
                    self.counts["shed_429"] += 1
                    self.owner.fail(flight, 429, f"model {model!r}: no replica came up within "
                                    f"its default deadline of "
                                    f"{(p.deadline_s - p.arrival_s) * 1000:.0f} ms (the start "
                                    f"from zero goes on; retry after it)",
                                    retry_after_ms=self.retry_after_ms(
                                        model, self.planner.slots(model, now).first_s, now),
                                    refusal=refusals.DEADLINE_UNREACHABLE)
                elif p.deadline_s <= now:
                    self.counts["expired_504"] += 1
                    waited_ms = (now - p.arrival_s) * 1000
                    predicted = (f"{p.predicted_ttft_s * 1000:.0f} ms"
                                 if p.predicted_ttft_s is not None else "none")
                    self._expired_log.warning(
                        "504 for request %r of model %r: deadline %.0f ms passed while queued; "
                        "its predicted TTFT was %s (restore p99 %s ms)", p.request_id, model,
                        (p.deadline_s - p.arrival_s) * 1000, predicted,
                        self.restore_times.p99_ms(model))
                    self.owner.fail(flight, 504, f"deadline passed after {waited_ms:.0f} ms queued "
                                    f"for model {model!r} (predicted TTFT {predicted})",
                                    predicted_ttft_ms=_ms(p.predicted_ttft_s),
                                    refusal=refusals.DEADLINE)
                else:
                    self.counts["shed_429"] += 1
                    self.owner.fail(flight, 429, f"waited max_wait_s({queue.max_wait_s}) for "
                                    f"model {model!r}", retry_after_ms=queue.retry_after_ms(),
                                    refusal=refusals.MAX_WAIT)
            if queue and now - state.rechecked_s >= self.config.recheck_s:
                state.rechecked_s = now
                self.recheck(model)
                # admission counts the restores that could start as capacity in sight: once
                # the warm replicas' own slots no longer serve the queue in time (a prediction
                # gone bad, a burst still arriving), those restores are asked for
                if queue:
                    self.restores.maybe_restore(model)
            if not queue:
                self.queued_models.discard(model)
            self.telemetry.queue_depth(model, len(queue))

    def refuse_queued(self, model: str, reason: str, refusal: str) -> None:
        """Answer every request queued for ``model`` 503 with ``reason`` and ``refusal``
        (its code, agent/wire/refusals.py): none of them was dispatched."""
        queue = self.models.queue(model)
        if queue is not None:
            for p in queue.drain():
                self.owner.fail(p.payload, 503, reason, refusal=refusal)
        self.telemetry.queue_depth(model, 0)

    def tick_log(self, final: bool = False) -> None:
        """Summarise the rate-limited 504 log line (at once when ``final``)."""
        self._expired_log.flush() if final else self._expired_log.tick()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
