"""A request's end: the replica's ``done`` or error, the front door's own refusal, or its
client leaving.

:class:`Answers` is where every request of the request path ends (exactly once): it marks the
:class:`~agent.frontdoor.request.Flight` over, counts it, decides whether it met its SLO
(attainment counts the SLO, base + prefill, not the deadline it was admitted by; an error
misses it unless it is the client's own, 4xx but 429), hands the answer to the flight's sink
and records the telemetry event.  A request whose client left is taken out of its queue, or
cancelled at its replica (:meth:`Answers.cancelled`).  A queue an end freed room for is
drained through an :class:`AnswerOwner` (the request path's queue side).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from agent.frontdoor.model_state import ModelStates
from agent.frontdoor.router import Router
from agent.frontdoor.reroute import _client_error, _retry_ms
from agent.telemetry import Telemetry
from agent.wire.refusals import known_refusal

log = logging.getLogger("agent.frontdoor.request_path")

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.links import ReplicaLink
    from agent.frontdoor.request import Flight


class AnswerOwner(Protocol):
    """What an answer lets go on (the request path's :class:`~agent.frontdoor.queues.Queues`)."""

    def drain(self, model: str) -> None:
        """Dispatch what the freed slot can start."""
        ...


class Settling(Protocol):
    """The :class:`~agent.frontdoor.dispatch.Dispatcher`'s path bookkeeping."""

    def settle_path(self, flight: Flight) -> None:
        ...


class Answers:
    """Final answers and their records (module docstring)."""

    def __init__(self, telemetry: Telemetry, models: ModelStates, counts: dict[str, int],
                 dispatcher: Settling, queues: AnswerOwner, router: Router,
                 links: dict[str, ReplicaLink]) -> None:
        self.telemetry = telemetry
        self.models = models
        self.counts = counts
        self.dispatcher = dispatcher
        self.queues = queues
        self.router = router
        self.links = links

    def cancelled(self, flight: Flight) -> None:
        """Forget ``flight`` (its client is gone; no answer is sent): out of its queue, or
        cancelled at the replica (``cancel`` op) with its slot freed in the router's view."""
        if flight.over:
            return
        flight.over = True
        self.counts["cancelled"] += 1
        if flight.pending is not None:
            queue = self.models.of(flight.model).queue
            assert queue is not None   # a pending flight is in its model's queue
            queue.cancel(flight.pending)
            flight.pending = None
            self.telemetry.queue_depth(flight.model, len(queue))
            return
        link = self.links.get(flight.replica_id)
        if link is not None and flight.replica_rid in link.in_flight:
            link.cancel(flight.replica_rid)
            self.router.on_complete(link.replica_id, flight.need_tokens, flight.prompt_tokens,
                                    flight.ttft_s is not None)
            if self.models.queue(flight.model):
                self.queues.drain(flight.model)

    def final(self, link: ReplicaLink, flight: Flight, message: dict, now: float) -> None:
        """The replica's last message for ``flight`` (``done`` or ``error``; its first token,
        if any, already recorded) goes to the sink: ``done`` with the front door's times
        (``ttft_ms``, ``total_ms``, ``queue_wait_ms``, ``predicted_ttft_ms``, ms from
        arrival) and the path and replica that served it; an error with the replica's code
        (500 when it is not an int), reason, ``retry_after_ms`` and refusal code.  Nothing
        for a flight already answered or cancelled (logged: a client gets one final answer,
        and a cold request counts as at most one miss, so misses never exceed cold arrivals
        in the counters the predictor reads)."""
        kind = message.get("type")
        if flight.over:
            log.warning("replica %s sent a second final answer (%r) for request %r, already "
                        "answered or cancelled; dropped", link.replica_id, kind,
                        flight.req.request_id)
            return
        flight.over = True
        self.dispatcher.settle_path(flight)
        ttft_ms = None if flight.ttft_s is None else (flight.ttft_s - flight.arrival_s) * 1000.0
        late = flight.ttft_s is None or flight.ttft_s > flight.slo_s
        if kind != "done":   # an error misses the SLO, unless it is the client's (4xx, not 429)
            c = message.get("code")
            late = late and flight.ttft_s is not None if _client_error(c) else True
        if flight.cold and late:
            self.models.of(flight.model).cold_misses += 1
        refusal = None
        if kind == "done":
            self.counts["done"] += 1
            message["ttft_ms"] = ttft_ms
            message["total_ms"] = (now - flight.arrival_s) * 1000.0
            message["path"] = flight.path
            message["replica"] = link.replica_id
            message["queue_wait_ms"] = flight.queue_wait_ms
            message["predicted_ttft_ms"] = _ms(flight.predicted_ttft_s)
            code = 200
            flight.sink.done(message)
        else:
            self.counts["errors"] += 1
            code = message.get("code", 500)
            if type(code) is not int:
                code = 500
            refusal = known_refusal(message.get("refusal"))   # the replica's, if it gave one
            flight.sink.error(code, str(message.get("reason", "replica error")),
                              _retry_ms(message.get("retry_after_ms")), refusal)
        self.telemetry.event(flight.req.request_id, flight.model, flight.path, code,
                             flight.queue_wait_ms, flight.restore_ms,
                             ttft_ms if code == 200 else None,
                             flight.ttft_s is None or flight.ttft_s > flight.slo_s,
                             reason=refusal, predicted_ttft_ms=_ms(flight.predicted_ttft_s),
                             done=message if code == 200 else None,
                             token_gaps=flight.token_gaps)
        if self.models.queue(flight.model):
            self.queues.drain(flight.model)

    def fail(self, flight: Flight, code: int, reason: str, path: str = "refused",
             retry_after_ms: int | None = None, predicted_ttft_ms: float | None = None,
             refusal: str | None = None) -> None:
        """Answer ``flight`` with an error (its final answer) and record it; ``refusal``: why,
        as one of agent/wire/refusals.py's codes, set where the refusal was decided (it goes to
        the sink, and to telemetry as the rejection's ``reason`` label).  Nothing for a
        flight already answered or cancelled."""
        if flight.over:
            return
        flight.over = True
        flight.pending = None
        self.counts["errors"] += 1
        if flight.cold and code in (429, 503, 504):
            self.models.of(flight.model).cold_misses += 1
        flight.sink.error(code, reason, retry_after_ms, refusal)
        self.telemetry.event(flight.req.request_id, flight.model, path, code, 0.0, None, None,
                             code == 504, reason=refusal or reason,
                             predicted_ttft_ms=predicted_ttft_ms)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
