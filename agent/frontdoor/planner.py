"""Where queued requests will start: the capacity in sight as slots, and each request's place.

The queue-side half of admission.  :class:`QueuePlanner` reads the warm replicas (the
router, and the requests in flight on each replica link), the restores in flight and
startable (the :class:`~agent.frontdoor.capacity.RestoreGate`, the measured restore
times, and :class:`CapacityInSight`), and each model's
:class:`~agent.frontdoor.model_state.ModelState` (its request shape, largest replica, and
the cached slots).  The pure arithmetic is in :mod:`agent.frontdoor.admission`
(:func:`capacity_etas_s`, :func:`slot_times_s`).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Protocol

from agent.clock import Clock
from agent.frontdoor.admission import capacity_etas_s, fluid_starts_s, slot_times_s
from agent.frontdoor.capacity import RestoreGate, RestoreTimes
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.model_state import ModelStates, Slot, SlotPlan
from agent.frontdoor.router import ReplicaLoad, Router

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.links import ReplicaLink
    from agent.frontdoor.request import Flight


class CapacityInSight(Protocol):
    """What the planner asks of the restores side (:class:`~agent.frontdoor.restores.Restores`)."""

    @property
    def can_restore(self) -> bool:
        """Whether a capacity requester is configured (restores can be asked for)."""
        ...

    def replica_room(self, model: str) -> int | None:
        """How many more replicas of ``model`` can come up before its nodes' replica cap
        (None: no cap seen)."""
        ...


class ReplicaArrivals(Protocol):
    """When each replica entered the view (:class:`~agent.frontdoor.replica_view.ReplicaView`)."""

    def first_seen(self, replica_id: str) -> float:
        ...


class Sizing(Protocol):
    """One new replica's size and a request's SLOs (:class:`~agent.frontdoor.budgets.Budgets`)."""

    def per_replica(self, model: str) -> int:
        ...

    def slos_s(self, model: str, prompt_tokens: int = 0) -> tuple[float, float]:
        ...


class QueuePlanner:
    """Slots, ETAs and per-request placement (module docstring)."""

    def __init__(self, config: FrontDoorConfig, clock: Clock, router: Router,
                 links: dict[str, ReplicaLink], gate: RestoreGate, restore_times: RestoreTimes,
                 models: ModelStates, sizing: Sizing, arrivals: ReplicaArrivals,
                 capacity: CapacityInSight) -> None:
        self.config = config
        self.clock = clock
        self.router = router
        self.links = links
        self.gate = gate
        self.restore_times = restore_times
        self.models = models
        self.sizing = sizing
        self.arrivals = arrivals
        self.capacity = capacity
        self._arrivals: dict[str, list[tuple[float, int]]] = {}   # (time, arrivals so far)

    def etas_s(self, model: str, now: float, *, started_only: bool = False,
               startable: int | None = None) -> list[float]:
        """When new replicas of ``model`` are expected, soonest first
        (:func:`capacity_etas_s`): the restores in flight, and those the restores side
        would start for the queue with one more request in it; no more than the room left
        under its nodes' replica cap once one was seen (:meth:`CapacityInSight.replica_room`:
        an ask beyond it is a probe, most likely answered by a replica already counted, and
        a request admitted on it would be refused later, when the answer comes).
        ``started_only``: the restores in flight alone; ``startable``: that many more instead
        of the restores side's own count (within the room)."""
        room = self.capacity.replica_room(model)
        if room is not None and room <= 0:
            return []
        p99, p50 = self.restore_times.p99_ms(model), self.restore_times.p50_ms(model)
        more = 0
        started = self.gate.started_s.get(model, [])
        if startable is not None:
            more = startable
        elif self.capacity.can_restore and not started_only:
            queue = self.models.queue(model)
            more = self.gate.wanted(model, (len(queue) if queue else 0) + 1,
                                    self.sizing.per_replica(model))
        if room is not None:
            started = started[:room]
            more = min(more, room - len(started))
        startable = more
        return capacity_etas_s(now, started, None if p50 is None else p50 / 1000.0,
                               None if p99 is None else p99 / 1000.0, startable)

    def slots(self, model: str, now: float) -> SlotPlan:
        """The slots for ``model``'s queue, soonest first, as ``(time, when its replica was
        first seen, its decode step, its replica id)``: the expected end of each request at
        the warm replicas (dispatch + predicted TTFT + max_tokens decode steps at a full
        batch, then the step in progress), the free slots now, and the slots of the replicas
        being restored or that could be (:func:`slot_times_s`; first seen: never, so usable
        on the restore path; replica id "": their prefills one after another are in their
        times already).  Also the earliest time, for ``retry_after_ms`` (inf: none), and per
        warm replica when the prefills queued there are done (the step in progress, then the
        queued prompts: the router's own accounting, as a direct dispatch is predicted): a
        replica prefills one prompt at a time, so a slot there starts no sooner.  Cached for
        ``tick_s`` (a burst of arrivals shares one computation) in the model's
        :attr:`~agent.frontdoor.model_state.ModelState.slot_plan`."""
        state = self.models.of(model)
        cached = state.slot_plan
        if cached is not None and now - cached.at_s < self.config.tick_s:
            return cached
        prior = self.router.prior(model)
        slots: list[Slot] = []
        busy: dict[str, float] = {}
        for load in self.router.warm(model):
            link = self.links.get(load.replica_id)
            if link is None:
                continue
            # its batch fills as the queue drains into it: steps at a full batch (an upper
            # bound, so a wrong estimate errs towards refusing at arrival, not later)
            speed = load.speed or prior
            step_s = speed.decode_step_s(load.max_seqs, load.active_ctx_tokens
                                         * max(1, load.max_seqs) // max(1, load.active_seqs))
            seen = self.arrivals.first_seen(load.replica_id)
            rid = load.replica_id
            busy[rid] = now + load.predict_ttft_s(0, prior) - speed.prefill_overhead_s
            idle = load.max_seqs - load.active_seqs
            if idle > 0:  # free now: they start after the step in progress
                slots.extend([(now + speed.decode_step_s(load.active_seqs,
                                                         load.active_ctx_tokens), seen,
                               step_s, rid)] * idle)
            for f in link.in_flight.values():
                first = f.ttft_s if f.ttft_s is not None else \
                    f.arrival_s + (f.predicted_ttft_s or 0.0)
                end = first + f.req.max_tokens * step_s
                if end <= now:  # overdue: the estimate was wrong; expect the overrun again
                    end = now + (now - end)
                slots.append((end + step_s, seen, step_s, rid))
        slots.extend(self._new_replica_slots(model, now, self.etas_s(model, now)))
        slots.sort()  # sorted: a valid heap as it is
        plan = state.slot_plan = SlotPlan(now, slots, slots[0][0] if slots else float("inf"),
                                          busy)
        return plan

    def _new_replica_slots(self, model: str, now: float, etas: list[float]) -> list[Slot]:
        """Slots of new replicas due at ``etas`` (:func:`slot_times_s`): first seen never
        (usable on the restore path) and replica id "" (their prefills one after another are
        in their times already)."""
        per_replica = self.sizing.per_replica(model)
        held = self.router.held_prior(model)   # new replicas: the model's measured error too
        fresh_step = held.decode_step_s(per_replica)
        mean_prompt = self.models.of(model).mean_shape()[0]
        inf = float("inf")
        return [(t, inf, fresh_step, "")
                for t in slot_times_s([], etas, per_replica, held, mean_prompt)]

    def admit(self, model: str, before: list[Flight], flight: Flight, now: float,
              margin_s: float = 0.0, ahead: int = 0) -> tuple[float | None, float, str]:
        """Whether ``flight`` joins ``model``'s queue behind ``before`` (the queued requests
        with earlier deadlines, or ``ahead`` more of them taken by count): its predicted TTFT
        from now (None: refused), the earliest slot's time (for ``retry_after_ms``) and, when
        refused by the rule below though its deadline could be made, the reason.

        A request the planner can start before its deadline is admitted (:meth:`assign`),
        on time or late, except a late one (predicted past its SLO) while arrivals outpace
        the capacity in sight: ``lambda >= X``, utilisation ``rho >= 1``
        (:meth:`_arrival_rps` over the request's warm deadline, the time a late admission's
        wait lingers, against :meth:`capacity_rps`).  By Little's law the work queued ahead,
        ``L`` requests, waits ``W = L / X``; with ``rho >= 1`` that queue never drains,
        wherever it waits (here or in a replica's prefill queue), so each late admission
        adds ``1 / X`` to the wait of every request that follows: it spends the capacity that
        would serve a later request on time to serve this one late.  With ``rho < 1`` the
        backlog (a one-off burst, a restore still coming, one long request in the way)
        drains, and a late answer beats a refusal: the deadline, not the SLO, decides it.
        The SLO is the path's (:meth:`~agent.frontdoor.budgets.Budgets.slos_s`): the warm
        SLO on a replica up before the request arrived, the restore SLO on one brought up
        since."""
        predicted, fresh, first = self._place(model, before + [flight], now, margin_s, ahead)
        ttft_s = predicted[-1]
        arrival_rps = self._arrival_rps(model, now, flight.warm_deadline_s - flight.arrival_s)
        if ttft_s is None:
            return ttft_s, first, ""
        warm_slo_s, restore_slo_s = self.sizing.slos_s(model, flight.prompt_tokens)
        slo_s = restore_slo_s if fresh[-1] else warm_slo_s
        waited_s = now - flight.arrival_s
        if waited_s + ttft_s <= slo_s:
            return ttft_s, first, ""
        serve_rps = self.capacity_rps(model, now)
        if serve_rps is not None and arrival_rps > 0.0 and arrival_rps >= serve_rps:
            return None, first, (
                f"predicted {(waited_s + ttft_s) * 1000:.0f} ms, past its SLO of "
                f"{slo_s * 1000:.0f} ms, while arrivals ({arrival_rps:.1f}/s) outpace what "
                f"the replicas in sight serve ({serve_rps:.1f}/s): a late admission would "
                f"only make every later request later")
        return ttft_s, first, ""

    def _arrival_rps(self, model: str, now: float, window_s: float) -> float:
        """``model``'s arrivals per second over the last ``window_s`` (its
        :class:`~agent.frontdoor.model_state.ModelState` ``arrivals`` count, sampled at most
        every ``tick_s``; before a whole window is seen, the arrivals since the first sample
        over the window: an underestimate, never
        a burst's instantaneous rate; where no sample was taken near the window's start,
        over the span since the one before it)."""
        count = self.models.of(model).arrivals
        samples = self._arrivals.setdefault(model, [])
        if not samples or now - samples[-1][0] >= self.config.tick_s:
            samples.append((now, count))
        cut = now - max(window_s, self.config.tick_s)
        while len(samples) > 1 and samples[1][0] <= cut:
            samples.pop(0)          # keep the newest sample at or before the window's start
        span_s = max(window_s, self.config.tick_s)
        if samples[0][0] > cut:       # the first sample is inside the window
            return (count - samples[0][1]) / span_s
        return (count - samples[0][1]) / max(span_s, now - samples[0][0])

    def capacity_rps(self, model: str, now: float) -> float | None:
        """Requests per second the replicas of ``model`` in sight complete (warm, being
        restored, and those the restores side would start, :meth:`etas_s`) at the model's
        mean request shape: what each sustained while backlogged (agent/throughput.py,
        :meth:`Router.sustained_rps`), else its speed profile's service rate at its
        sustainable batch (:meth:`Sizing.per_replica`); None before the model's shape is
        known."""
        state = self.models.of(model)
        if state.shape is None:
            return None
        prompt, gen = state.mean_shape()
        batch = max(1, self.sizing.per_replica(model))
        total = sum(self.router.sustained_rps(load, prompt, gen, batch)
                    for load in self.router.warm(model))
        restoring = len(self.etas_s(model, now))
        return total + restoring * self.router.new_replica_rps(model, prompt, gen, batch)

    def assign(self, model: str, flights: list[Flight], now: float,
                margin_s: float = 0.0, ahead: int = 0) -> tuple[list[float | None], float]:
        """Predicted TTFTs from now (None: no capacity in sight makes its deadline) of
        ``flights`` (earliest deadline first), each taking the soonest slot that those before
        it left and that it can use in time: a slot on a replica up before the request
        arrived within its warm deadline, a new replica's within its restore-path deadline.
        Its prefill starts when the slot is free and its replica has prefilled the prompts
        queued there and those placed there before it (one prompt at a time).
        A slot taken frees again once that request's ``max_tokens`` are decoded.  ``ahead``
        more requests (not given one by one: a long queue) are taken to hold the first
        ``ahead`` slots.  The last flight must make its deadlines with ``margin_s`` to spare
        (admission; see :meth:`agent.frontdoor.queues.Queues.hold`).  Also returns the
        earliest slot's time."""
        predicted, _fresh, first = self._place(model, flights, now, margin_s, ahead)
        return predicted, first

    def restores_needed(self, model: str, flights: list[Flight], now: float,
                        room: int) -> int:
        """The fewest new replicas (at most ``room``) with which the replicas warm and those
        being restored start the most of ``flights`` (earliest deadline first) before their
        deadlines: 0 for a queue the capacity coming drains in time, and no replica more for
        requests no number of them would serve in time (what a restore is asked for, so a
        replica more is paid for only where the SLO needs it).  Where the model's replicas
        measured what they sustain backlogged, by that rate (:meth:`_short_by_rate`: a
        queue's requests start as fast as replicas sustain, whatever each one's predicted
        TTFT, which counts every error against it); else placed as :meth:`assign` places
        them.  A replica more never starts fewer of them in time, so the count is found by
        bisection: the queue is placed at most ``2 + log2(room)`` times, not ``room + 1``
        (this runs on every held arrival and every re-check)."""
        measured = self.router.model_capacity(model) is not None

        def short_with(n: int) -> int:
            if measured:
                return self._short_by_rate(model, flights, now, n)
            predicted = self._place(model, flights, now, 0.0, 0, new_replicas=n)[0]
            return sum(1 for t in predicted if t is None)

        short = short_with(0)
        if short == 0 or room <= 0:
            return 0
        best = short_with(room)
        if best >= short:         # no number of replicas starts one more in time
            return 0
        lo, hi = 0, room          # short_with(lo) > best, short_with(hi) == best
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if short_with(mid) <= best:
                hi = mid
            else:
                lo = mid
        return hi

    def _short_by_rate(self, model: str, flights: list[Flight], now: float,
                       new_replicas: int) -> int:
        """How many of ``flights`` (earliest deadline first) would not start in time if every
        replica started requests as fast as it sustains backlogged
        (:func:`~agent.frontdoor.admission.fluid_starts_s`): the warm ones from now, behind
        the prompts already waiting there; those being restored, and ``new_replicas`` more,
        from their ETAs.  A request starting before the first new replica is due is held
        to its warm-path deadline, a later one to its restore-path deadline, each after its
        own prefill."""
        prompt, gen = self.models.of(model).mean_shape()
        batch = max(1, self.sizing.per_replica(model))
        warm = self.router.warm(model)
        capacity = [(now, self.router.sustained_rps(load, prompt, gen, batch)) for load in warm]
        etas = self.etas_s(model, now, startable=new_replicas)
        fresh = self.router.new_replica_rps(model, prompt, gen, batch)
        capacity += [(eta, fresh) for eta in etas]
        ahead = sum(load.waiting_seqs for load in warm)
        speed = self.router.prior(model)   # measured rates: no prediction error to pad
        first_new = etas[0] if etas else float("inf")
        short = 0
        for flight, start in zip(flights, fluid_starts_s(now, ahead, capacity, len(flights)),
                                 strict=True):
            deadline = flight.warm_deadline_s if start < first_new else flight.deadline_s
            if start + speed.prefill_s(flight.prompt_tokens) > deadline:
                short += 1
        return short

    def _place(self, model: str, flights: list[Flight], now: float, margin_s: float,
               ahead: int, new_replicas: int | None = None,
               ) -> tuple[list[float | None], list[bool], float]:
        """:meth:`assign`, and per flight whether its slot is on a replica brought up since
        it arrived (the restore path's SLO applies there).  ``new_replicas``: on the warm
        replicas, those being restored and that many more that could start now (None: the
        capacity the planner counts, :meth:`slots`)."""
        slots, first, busy = self.slots(model, now)[1:]
        if new_replicas is not None:
            slots = sorted([slot for slot in slots if slot[3]] + self._new_replica_slots(
                model, now, self.etas_s(model, now, startable=new_replicas)))
        busy = dict(busy)
        held = self.router.held_prior(model)
        if ahead < len(slots):
            heap = slots[ahead:]      # a suffix of a sorted list: still a heap
        elif slots:
            # deeper than one slot each: the slots are reused in rounds, each round one
            # request's decode (the model's mean max_tokens, at the slot's step) later
            rounds, start = divmod(ahead, len(slots))
            gen = self.models.of(model).mean_shape()[1] + 1.0
            heap = [(t + rounds * gen * step, seen, step, r) for t, seen, step, r in slots[start:]]
            heap += [(t + (rounds + 1) * gen * step, seen, step, r)
                     for t, seen, step, r in slots[:start]]
            heapq.heapify(heap)
        else:
            heap = []
        out: list[float | None] = []
        fresh: list[bool] = []
        last = len(flights) - 1
        for k, flight in enumerate(flights):
            own = held.prefill_s(flight.prompt_tokens)
            spare = margin_s if k == last else 0.0
            found, passed, new = None, [], False
            while heap:
                slot = heapq.heappop(heap)
                t, seen, step_s, rid = slot
                if now + max(0.0, t - now) + own + spare > flight.deadline_s:
                    passed.append(slot)       # no later slot is sooner
                    break
                begin = max(t, busy.get(rid, t)) if rid else t  # its replica's prefills first
                ttft_s = max(0.0, begin - now) + own
                if now + ttft_s + spare <= flight.deadline_s and (
                        seen > flight.arrival_s or now + ttft_s + spare <= flight.warm_deadline_s):
                    found, new = ttft_s, seen > flight.arrival_s
                    if rid:
                        busy[rid] = begin + self._prefill_gap_s(rid, own)
                    heapq.heappush(heap, (now + ttft_s + (flight.req.max_tokens + 1) * step_s,
                                          seen, step_s, rid))
                    break
                passed.append(slot)
            for slot in passed:
                heapq.heappush(heap, slot)
            out.append(found)
            fresh.append(new)
        return out, fresh, first

    def _prefill_gap_s(self, replica_id: str, own_s: float) -> float:
        """How much later the next queued prompt can start at ``replica_id`` once one that
        takes ``own_s`` to prefill alone has started: ``own_s`` (one call after another: an
        upper bound), or sooner where the replica measured what it sustains backlogged
        (agent/throughput.py): prompts start as fast as requests leave it, ``1 / rps``
        (shared calls, batching and its overheads in it)."""
        load = self.router.get(replica_id)
        if load is None or load.backlog is None:
            return own_s
        return min(own_s, 1.0 / load.backlog.rps)

    def choose_in_time(self, flight: Flight, now: float) -> tuple[ReplicaLoad, float] | None:
        """The replica with the lowest predicted TTFT that starts ``flight`` within its
        deadline there (:meth:`deadline_for`): among all, else among those brought up since
        it arrived (the warm path's deadline may have passed, the restore path's not).  A
        request that found nothing of its model warm (``Flight.cold``) was held for the
        start that brings one up: any replica serves it, in time or late."""
        exclude: set[str] | frozenset[str] = flight.tried or frozenset()
        found = self.router.choose_predicted(flight.model, flight.need_tokens,
                                             flight.prompt_tokens, exclude)
        if found is None:
            return None
        if flight.cold:
            return found
        if now + found[1] <= self.deadline_for(flight, found[0].replica_id):
            return found
        if now > flight.warm_deadline_s:
            old = {r.replica_id for r in self.router.warm(flight.model)
                   if self.arrivals.first_seen(r.replica_id) <= flight.arrival_s}
            found = self.router.choose_predicted(flight.model, flight.need_tokens,
                                                 flight.prompt_tokens, old | set(exclude))
            if found is not None and now + found[1] <= flight.deadline_s:
                return found
        return None

    def deadline_for(self, flight: Flight, replica_id: str) -> float:
        """``flight``'s deadline at this replica: the restore path's when the replica was
        first seen after the request arrived, else the warm path's."""
        if self.arrivals.first_seen(replica_id) > flight.arrival_s:
            return flight.deadline_s
        return flight.warm_deadline_s
