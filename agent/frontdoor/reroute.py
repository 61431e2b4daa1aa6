"""A request that a replica did not start: another replica, a restore, or 429 — never lost.

:class:`Reroute` places such a request again through a :class:`RerouteOwner` (the request
path: dispatch, hold, fail) with the :class:`~agent.frontdoor.planner.QueuePlanner`'s choice
of replica.

A dispatched request can come back with nothing streamed in three ways:

- the replica refused it (429: it predicts it cannot start it within its ``deadline_ms``,
  the ``generate`` op's contract: a replica refuses what it cannot start in time rather
  than answer late); predictions for that replica carry the difference until its next report;
- the replica is going away (503: it is draining or shutting down — the predictor's
  scale-in through the node agent, a SIGTERM — while the front door's view, refreshed every
  registry poll, still listed it); it leaves the view;
- the link broke (connection lost or refused, a garbled answer); it leaves the view.

Each is placed again as it would be at arrival, with its deadlines still counted from
arrival: on a replica it has not tried that starts it in time, else held when capacity in
sight can start it within the restore path's deadline, else refused 429 with
``retry_after_ms``.  A request whose answer had begun to stream is never sent again (the
client has part of an answer): it is answered 503.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

from agent.clock import Clock
from agent.frontdoor.budgets import Budgets
from agent.frontdoor.model_state import ModelStates
from agent.frontdoor.planner import CapacityInSight, QueuePlanner
from agent.frontdoor.router import ReplicaLoad, Router
from agent.wire import refusals

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.links import ReplicaLink
    from agent.frontdoor.request import Flight

RETRY_AFTER_MS = 1000
"""``retry_after_ms`` of a 429 for a request no capacity could take after its replica went
away, when the replica named none (about one registry refresh and a restore decision)."""
RETRY_AFTER_MAX_MS = 3_600_000
"""The longest ``retry_after_ms`` a replica's answer may pass on to a client (an hour); one
that is not an integer in [1, this] is garbage and the front door's own default is sent."""


def _client_error(code: Any) -> bool:
    """Whether a replica's error ``code`` is the client's (4xx but 429): no SLO was missed."""
    return type(code) is int and 400 <= code < 500 and code != 429


def _retry_ms(value: Any) -> int | None:
    """A replica's ``retry_after_ms`` if it is an integer in [1, RETRY_AFTER_MAX_MS], else None."""
    return value if type(value) is int and 1 <= value <= RETRY_AFTER_MAX_MS else None


class RerouteOwner(Protocol):
    """What :class:`Reroute` places requests through (the request path)."""

    stopping: bool   # draining: nothing is placed again

    def dispatch(self, flight: Flight, replica: ReplicaLoad, predicted_s: float,
                 now: float | None = None) -> None:
        ...

    def hold(self, flight: Flight, warm_pred_s: float | None) -> None:
        ...

    def fail(self, flight: Flight, code: int, reason: str, path: str = "refused",
             retry_after_ms: int | None = None, predicted_ttft_ms: float | None = None,
             refusal: str | None = None) -> None:
        ...


class Reroute:
    """Placing unstarted requests again (module docstring)."""

    def __init__(self, clock: Clock, router: Router, links: dict[str, ReplicaLink],
                 counts: dict[str, int], models: ModelStates, planner: QueuePlanner,
                 budgets: Budgets, capacity: CapacityInSight, owner: RerouteOwner) -> None:
        self.clock = clock
        self.router = router
        self.links = links
        self.counts = counts
        self.models = models
        self.planner = planner
        self.budgets = budgets
        self.capacity = capacity
        self.owner = owner

    def replica_refused(self, link: ReplicaLink, flight: Flight, message: dict) -> None:
        """The replica predicted it cannot start ``flight`` in time (429): predictions for
        it carry the difference until its next report, and ``flight`` is placed again."""
        self.counts["replica_429"] += 1
        load = self.router.get(link.replica_id)
        theirs: Any = message.get("predicted_ttft_ms")   # the replica's number, checked here
        if (load is not None and type(theirs) in (int, float) and math.isfinite(theirs)
                and theirs >= 0 and flight.predicted_ttft_s):
            ours_s = flight.predicted_ttft_s - (flight.queue_wait_ms / 1000.0)
            load.penalty_s = max(load.penalty_s, theirs / 1000.0 - ours_s)
        self._place_again(flight, link.replica_id, str(message.get("reason", "replica refused")),
                          _retry_ms(message.get("retry_after_ms")))

    def replica_leaving(self, link: ReplicaLink, flight: Flight, message: dict) -> None:
        """The replica answered 503 before ``flight``'s first token (draining, shutting
        down): it takes no more requests, so it leaves the view, and ``flight`` is placed
        again."""
        self.counts["rerouted"] += 1
        self.router.remove(link.replica_id)
        self.models.forget_slots()
        self._place_again(flight, link.replica_id,
                          f"replica {link.replica_id}: {message.get('reason', 'unavailable')}",
                          _retry_ms(message.get("retry_after_ms")))

    def replica_failed(self, link: ReplicaLink, reason: str, retry: bool = True,
                       refusal: str = refusals.REPLICA_FAILED) -> None:
        """The link broke: the replica leaves the view until the registry shows it again;
        its requests with nothing streamed yet are placed again (unless ``retry`` is False
        or this front door is stopping), the others answered 503 with ``refusal``."""
        link.closed = True
        if self.links.get(link.replica_id) is link:
            del self.links[link.replica_id]
        self.router.remove(link.replica_id)
        self.models.forget_slots()
        failed, link.in_flight = list(link.in_flight.values()), {}
        for flight in failed:
            if retry and not self.owner.stopping and flight.ttft_s is None and not flight.over:
                self.counts["rerouted"] += 1
                self._place_again(flight, link.replica_id, reason)
            else:
                self.owner.fail(flight, 503, reason, path=flight.path, refusal=refusal)
        if link.transport is not None:
            link.transport.close()

    def _place_again(self, flight: Flight, replica_id: str, reason: str,
                     retry_after_ms: Any = None) -> None:
        """Place ``flight`` (not started at ``replica_id``) as at arrival (module
        docstring): another replica in time, else held, else 429."""
        flight.tried = (flight.tried or set()) | {replica_id}
        found = self.planner.choose_in_time(flight, self.clock.now())
        if found is not None:
            self.owner.dispatch(flight, found[0], found[1])
            return
        if self.capacity.can_restore:
            _warm_s, restore_s = self.budgets.budgets_s(flight.model, flight.req.deadline_ms,
                                                        flight.prompt_tokens)
            flight.deadline_s = flight.arrival_s + restore_s
            self.owner.hold(flight, None)
            return
        self.counts["shed_429"] += 1
        self.owner.fail(flight, 429, f"model {flight.model!r}: not started at replica {replica_id} "
                        f"({reason}) and no other replica can start it in time",
                        retry_after_ms=retry_after_ms or RETRY_AFTER_MS,
                        refusal=refusals.DEADLINE_UNREACHABLE)
