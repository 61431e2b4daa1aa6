"""A dispatched request whose replica gives no first token in time: moved once, or answered.

A replica can stop answering after it accepted a request (SIGSTOP, a livelock, a swap storm, a
process that took the frame and never replies) while its connection stays open: nothing
breaks, so :mod:`agent.frontdoor.reroute` never hears of it.  :class:`FirstTokenWatch` bounds
that wait.  At dispatch each request gets, from what admission predicted for it at that
replica, its **silence bound**::

    sent + max(floor_s, SILENT_FACTOR x predicted_s + SILENT_STEPS x step_s)

``predicted_s`` is the router's predicted TTFT there (the replica's queue and reported speed,
with its measured slowdown, agent/frontdoor/router.py), ``step_s`` the replica's decode step
at a full batch at that speed and slowdown (the speed model's quantum of error), ``floor_s``
the model's warm TTFT SLO (2 s by default: a replica is never called silent before a request
could have met its SLO there, whatever the host's scheduling noise).  A replica that is only
slow shows it in the slowdown it measures long before this (each first token updates it);
one silent past the bound has stopped.  The numbers are constants of the rule, not fits:
twice the prediction (which already carries the replica's p99 slowdown) and eight steps (the
speed model's error quantum, agent/frontdoor/router.py ``observe_ttft``, eight times over).

Without a first token by then, a replica that sent nothing at all on its link since the
request was sent is silent: it is taken out of routing (:attr:`FirstTokenWatch.suspects`;
the registry's view does not bring it back) until it answers a ``health`` probe on its link
(sent every ``probe_every_s``), and every request at it is cancelled there (``cancel`` op:
KV slots freed, late answers dropped).  Each not started is placed again, once, on a replica
that can start it before its deadline (nothing was streamed, so nothing wrong is served; one
held for its model's start from zero, ``Flight.cold``, on any replica), else answered: 504
``deadline`` when its deadline has passed, 503 ``replica_failed`` with ``retry_after_ms``
when it has not.  One whose answer had begun to stream is answered 503 ``replica_failed``.
A link whose requests all stream already is scanned every ``probe_every_s``: silent past
twice the time to the soonest expected end of its streams (plus the same steps, at least
the floor), it is silent in the same way (:meth:`FirstTokenWatch._scan_streams`).
A replica that did send something meanwhile (tokens of other requests) is alive and only
late for this one: the wait is extended by the same bound, and its late first token is
counted (``late_first_token``) and the SLO miss recorded, never hidden.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from agent.clock import Clock
from agent.frontdoor.model_state import ModelStates
from agent.frontdoor.ratelog import RateLimitedLog
from agent.frontdoor.router import ReplicaLoad, Router
from agent.wire import refusals

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.links import ReplicaLink
    from agent.frontdoor.request import Flight

log = logging.getLogger("agent.frontdoor.request_path")

SILENT_FACTOR = 2.0
"""A replica is silent past this many times the TTFT predicted for the request there (the
prediction already carries the replica's measured p99 slowdown)."""
SILENT_STEPS = 8
"""... plus this many of its decode steps at a full batch (observe_ttft's error quantum)."""
RETRY_AFTER_MIN_MS = 1000
"""``retry_after_ms`` of a 503 ``replica_failed`` when no other replica could take the
request (about a registry refresh: the view may hold another replica by then)."""


class WatchOwner(Protocol):
    """What the watch places and answers requests through (the request path)."""

    def dispatch(self, flight: Flight, replica: ReplicaLoad, predicted_s: float,
                 now: float | None = None) -> None:
        ...

    def fail(self, flight: Flight, code: int, reason: str, path: str = "refused",
             retry_after_ms: int | None = None, predicted_ttft_ms: float | None = None,
             refusal: str | None = None) -> None:
        ...


class Placing(Protocol):
    """Where a request can go now (:class:`~agent.frontdoor.planner.QueuePlanner`)."""

    def choose_in_time(self, flight: Flight, now: float) -> tuple[ReplicaLoad, float] | None:
        ...


def silent_after_s(load: ReplicaLoad, predicted_s: float, prior_step_s: float,
                   floor_s: float) -> float:
    """Seconds after dispatch past which a replica that gave no first token is silent
    (module docstring): ``max(floor_s, SILENT_FACTOR x predicted_s + SILENT_STEPS x
    step_s)``, ``step_s`` its decode step at a full batch (``prior_step_s`` when it reported
    no speed) times its measured slowdown."""
    speed = load.speed
    step_s = (speed.decode_step_s(max(1, load.max_seqs), load.active_ctx_tokens)
              if speed is not None else prior_step_s) * load.slowdown
    return max(floor_s, SILENT_FACTOR * max(0.0, predicted_s) + SILENT_STEPS * step_s)


class FirstTokenWatch:
    """The bound on a dispatched request's wait for its first token (module docstring).

    ``links``: the request path's replica links (a suspect's is probed through it);
    ``suspects``: replica id -> when it was found silent (shared with the
    :class:`~agent.frontdoor.replica_view.ReplicaView`, which keeps them out of the view);
    ``slo_s(model)``: its (warm, restore) TTFT SLOs in s, the warm one the bound's floor;
    ``back(load)``: puts a suspect that answered its probe back in the view (its load as it
    was taken out: a registry without changes, a Consul blocking query, would not)."""

    def __init__(self, clock: Clock, router: Router, models: ModelStates,
                 links: dict[str, ReplicaLink], counts: dict[str, int], planner: Placing,
                 owner: WatchOwner, suspects: dict[str, float], probe_every_s: float,
                 slo_s: Callable[[str], tuple[float, float]],
                 back: Callable[[ReplicaLoad], None], log_interval_s: float = 10.0) -> None:
        self.clock = clock
        self.router = router
        self.models = models
        self.links = links
        self.counts = counts
        self.planner = planner
        self.owner = owner
        self.suspects = suspects
        self.probe_every_s = probe_every_s
        self.slo_s = slo_s
        self.back = back
        self._loads: dict[str, ReplicaLoad] = {}   # suspect -> its load when taken out
        self._heap: list[tuple[float, int, Flight, str, int, float]] = []
        self._seq = itertools.count()
        self._probed: dict[str, float] = {}   # suspect -> when it was last probed
        self._scanned_s = float("-inf")       # when the streams were last scanned
        self._log = RateLimitedLog(log, "replicas silent after a dispatch", clock=clock,
                                   interval_s=log_interval_s)

    @property
    def watching(self) -> bool:
        """Whether a request, a stream or a suspect replica needs :meth:`check` soon."""
        return bool(self._heap or self.suspects
                    or any(getattr(link, "in_flight", None) for link in self.links.values()))

    def watch(self, flight: Flight, load: ReplicaLoad, predicted_s: float, now: float) -> None:
        """``flight`` was just sent to ``load``'s replica with ``predicted_s`` (s from now)."""
        prior_step_s = self.router.prior(load.model).decode_step_s(max(1, load.max_seqs))
        bound_s = silent_after_s(load, predicted_s, prior_step_s, self.slo_s(load.model)[0])
        self._push(flight, load.replica_id, now, bound_s)

    def _push(self, flight: Flight, rid: str, now: float, bound_s: float) -> None:
        """Look at ``flight`` again at its silence bound, and at the latest :meth:`grace_s`
        past its deadline (a request is answered by then whatever its replica does)."""
        at = min(now + bound_s, flight.deadline_s + self.grace_s(flight))
        heapq.heappush(self._heap, (at, next(self._seq), flight, rid, flight.replica_rid,
                                    bound_s))

    def check(self, now: float) -> None:
        """Act on every wait that ended by ``now`` (module docstring), and probe suspects."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _at, _n, flight, rid, link_rid, bound_s = heapq.heappop(heap)
            if flight.over or flight.ttft_s is not None or flight.replica_id != rid \
                    or flight.replica_rid != link_rid:
                continue    # answered, streaming, or placed elsewhere since
            self._ended(flight, rid, now, bound_s)
        self._scan_streams(now)
        for rid in list(self.suspects):
            if now - self._probed.get(rid, float("-inf")) >= self.probe_every_s:
                self._probe(rid, now)

    def answered(self, replica_id: str, message: dict) -> None:
        """``replica_id`` answered a probe with ``message``: back in routing, with its load as
        it was taken out until its next report (agent/frontdoor/replica_view.py), unless its
        ``health`` says it is not ok, or that its engine has been in one call
        (``engine_busy_s``) for longer than a new request's silence bound there (its event
        loop answers, its engine does not)."""
        if replica_id not in self.suspects:
            return
        load = self._loads.get(replica_id)
        result = message.get("result")
        health = result if isinstance(result, dict) else {}
        busy: Any = health.get("engine_busy_s", 0.0)
        if message.get("type") == "result" and (health.get("ok") is False or (
                type(busy) in (int, float) and load is not None
                and busy > self._bound_now_s(load))):
            return                       # still out; probed again every probe_every_s
        del self.suspects[replica_id]
        self._probed.pop(replica_id, None)
        self._loads.pop(replica_id, None)
        if load is not None and self.router.get(replica_id) is None:
            self.back(load)
        log.warning("replica %s answers again; back in routing", replica_id)

    def _bound_now_s(self, load: ReplicaLoad) -> float:
        """A new request's silence bound at ``load``'s replica (its predicted TTFT)."""
        prior = self.router.prior(load.model)
        return silent_after_s(load, load.predict_ttft_s(0, prior),
                              prior.decode_step_s(max(1, load.max_seqs)),
                              self.slo_s(load.model)[0])

    def forget(self, replica_id: str) -> None:
        """``replica_id``'s link broke: it leaves the view anyway; the registry decides."""
        self.suspects.pop(replica_id, None)
        self._probed.pop(replica_id, None)
        self._loads.pop(replica_id, None)

    def _ended(self, flight: Flight, rid: str, now: float, bound_s: float) -> None:
        """``flight``'s wait at ``rid`` passed its bound of ``bound_s``.  A replica that sent
        anything on its link since ``flight`` was sent (a probe's answer too) is alive and
        only late for it: the wait is extended by the same bound (its first token, when it
        comes, is counted late), up to :meth:`grace_s` past the request's deadline, when it
        is answered 504 (:meth:`_expire`).  One that sent nothing is silent (:meth:`_silent`)."""
        link = self.links.get(rid)
        heard = getattr(link, "heard_s", float("-inf")) > flight.sent_s
        if now >= flight.deadline_s + self.grace_s(flight):
            self._expire(flight, link, rid, now)   # a replica alive but starving it
            return
        if heard:
            self._push(flight, rid, now, bound_s)
            return
        self._silent(link, flight, rid, now)

    def grace_s(self, flight: Flight) -> float:
        """How long past its deadline a dispatched request may still wait for a first token
        from a replica that is alive: the model's warm TTFT SLO (the silence bound's floor;
        the bound itself grows with a replica's measured slowdown, without limit)."""
        return self.slo_s(flight.model)[0]

    def _expire(self, flight: Flight, link: ReplicaLink | None, rid: str, now: float) -> None:
        """``flight``'s deadline passed with no first token from ``rid``: cancelled there
        (nothing was streamed, so nothing is lost or wrong) and answered 504 ``deadline``."""
        if link is not None:
            link.cancel(flight.replica_rid)    # frees its slot; a late answer is dropped
        self.router.on_complete(rid, flight.need_tokens, flight.prompt_tokens, False)
        self._answer_504(flight, rid, now)

    def _answer_504(self, flight: Flight, rid: str, now: float) -> None:
        self.counts["deadline_after_dispatch"] += 1
        self.owner.fail(flight, 504, f"no first token from replica {rid} within "
                        f"{(now - flight.sent_s) * 1000:.0f} ms of dispatch (predicted "
                        f"{flight.sent_predicted_s * 1000:.0f} ms); the request's deadline of "
                        f"{(flight.deadline_s - flight.arrival_s) * 1000:.0f} ms passed",
                        path=flight.path, refusal=refusals.DEADLINE)

    def _silent(self, link: ReplicaLink | None, flight: Flight, rid: str, now: float,
                quiet_s: float | None = None) -> None:
        """``rid`` said nothing since ``flight`` was sent (for ``quiet_s``; default: since
        then): out of routing until it answers a probe; every request at it (none had a
        message since either) is cancelled there, those not started placed again once or
        answered, those streaming answered 503."""
        quiet_ms = (now - flight.sent_s if quiet_s is None else quiet_s) * 1000.0
        self.counts["silent_replica"] += 1
        if rid not in self.suspects:
            self.suspects[rid] = now
            load = self.router.get(rid)
            if load is not None:
                self._loads[rid] = load
            self._log.warning("replica %s sent nothing for %.0f ms with %d requests in flight "
                              "(request %r predicted a first token in %.0f ms); out of "
                              "routing until it answers a probe", rid, quiet_ms,
                              len(link.in_flight) if link is not None else 1,
                              flight.req.request_id, flight.sent_predicted_s * 1000.0)
        stuck = [flight] if link is None else \
            [f for f in link.in_flight.values() if f is not flight] + [flight]
        quiet_s = now - flight.sent_s if quiet_s is None else quiet_s
        # Each not started moves, once, to a replica that can start it in time.  One that
        # cannot keeps waiting here one more bound (a replica only slow still answers its
        # probe, and then it waits to its deadline): silent through that too, it is answered
        # 503.  One past its deadline is answered 504.
        waited = {id(f) for f in stuck if f.silent_moved}
        moves: dict[int, tuple[ReplicaLoad, float]] = {}
        for f in stuck:
            if f.ttft_s is None and not f.silent_moved and now < f.deadline_s and not f.over:
                f.silent_moved = True
                f.tried = (f.tried or set()) | {rid}
                found = self.planner.choose_in_time(f, now)
                if found is not None:
                    moves[id(f)] = found

        def waits(f: Flight) -> bool:
            return (f.ttft_s is None and id(f) not in moves and now < f.deadline_s
                    and not f.over and not (f is flight and id(f) in waited))
        for f in stuck:
            if link is not None and not waits(f):
                link.cancel(f.replica_rid)     # frees its slot; a late answer is dropped
        self.router.remove(rid)             # its load goes: what it held goes with it
        self.models.forget_slots()
        for f in stuck:
            if waits(f):
                if id(f) not in waited:        # one waiting already has its own look due
                    self._push(f, rid, now, quiet_s)
                continue
            if f.over:
                continue
            if f.ttft_s is not None:   # part of its answer was streamed: never sent again
                self.owner.fail(f, 503, f"replica {rid} went silent mid-stream (nothing for "
                                f"{quiet_ms:.0f} ms)", path=f.path,
                                refusal=refusals.REPLICA_FAILED)
            elif id(f) in moves:
                self.counts["rerouted"] += 1
                self.owner.dispatch(f, moves[id(f)][0], moves[id(f)][1], now)
            elif now >= f.deadline_s:
                self._answer_504(f, rid, now)
            else:
                self.owner.fail(f, 503, f"replica {rid} gave no first token within "
                                f"{(now - f.sent_s) * 1000:.0f} ms of dispatch (predicted "
                                f"{f.sent_predicted_s * 1000:.0f} ms), said nothing since, "
                                f"and no other replica can start the request before its "
                                f"deadline", path=f.path, retry_after_ms=RETRY_AFTER_MIN_MS,
                                refusal=refusals.REPLICA_FAILED)

    def _scan_streams(self, now: float) -> None:
        """Every ``probe_every_s``: a link whose requests have all begun to stream (no first
        token watched) is silent too once it sent nothing for ``max(floor, SILENT_FACTOR x
        (the soonest expected end of its streams, from its last message) + SILENT_STEPS x
        step_s)``: a stream's end is its first token plus ``max_tokens`` decode steps at a
        full batch (slowdown included).  A replica may send its tokens one step at a time or
        in one message at the end; either way it has said something by then."""
        if now - self._scanned_s < self.probe_every_s:
            return
        self._scanned_s = now
        for rid, link in list(self.links.items()):
            in_flight = getattr(link, "in_flight", None)
            load = self.router.get(rid)
            if not in_flight or load is None or rid in self.suspects:
                continue
            flights = list(in_flight.values())
            last_s = max([getattr(link, "heard_s", float("-inf"))]
                         + [f.sent_s for f in flights])
            prior = self.router.prior(load.model)
            step_s = (load.speed or prior).decode_step_s(max(1, load.max_seqs),
                                                         load.active_ctx_tokens) * load.slowdown
            ends = [f.ttft_s + f.req.max_tokens * step_s for f in flights
                    if f.ttft_s is not None]
            if len(ends) < len(flights):
                continue      # one waits for its first token: its own bound watches it
            bound_s = max(self.slo_s(load.model)[0], SILENT_FACTOR * max(0.0, min(ends) - last_s)
                          + SILENT_STEPS * step_s)
            if now - last_s > bound_s:
                self._silent(link, flights[-1], rid, now, now - last_s)

    def _probe(self, rid: str, now: float) -> None:
        self._probed[rid] = now
        link = self.links.get(rid)
        probe = getattr(link, "probe", None)   # a simulator's link may have none
        if probe is not None and not link.closed:  # type: ignore[union-attr]
            probe()

    def tick_log(self, final: bool = False) -> None:
        """Summarise the rate-limited silent-replica log line (at once when ``final``)."""
        self._log.flush() if final else self._log.tick()
