"""Sending requests to replicas: the link to each, the dispatch, and the first token.

:class:`Dispatcher` opens a :class:`~agent.frontdoor.links.ReplicaLink` to a replica on first
use (its answers and failures go to the links' :class:`~agent.frontdoor.links.LinkOwner`, the
request path; the connect is bounded by the time the request that opened it has left,
:func:`~agent.frontdoor.links.connect_timeout_s`), sends a request with the time left for its
first token, hands it to the :class:`Watching` that bounds the wait for that first token
(agent/frontdoor/first_token.py), and keeps the router's accounting of the replica's prefill
queue as first tokens arrive.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from agent.clock import Clock
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.links import Connector, LinkOwner, ReplicaLink, connect_timeout_s
from agent.frontdoor.model_state import RestoreRecord
from agent.frontdoor.ratelog import RateLimitedLog
from agent.frontdoor.router import ReplicaLoad, Router

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.request import Flight

log = logging.getLogger("agent.frontdoor.request_path")


class Deadlines(Protocol):
    """Which path's deadline a request has at a replica (the
    :class:`~agent.frontdoor.planner.QueuePlanner`)."""

    def deadline_for(self, flight: Flight, replica_id: str) -> float:
        ...


class CameUp(Protocol):
    """Which restore brought a replica up (the
    :class:`~agent.frontdoor.replica_view.ReplicaView`)."""

    def came_up(self, replica_id: str) -> RestoreRecord | None:
        ...


class Watching(Protocol):
    """What bounds a dispatched request's wait for its first token
    (:class:`~agent.frontdoor.first_token.FirstTokenWatch`)."""

    def watch(self, flight: Flight, load: ReplicaLoad, predicted_s: float, now: float) -> None:
        ...


class Dispatcher:
    """Requests out to replicas and their first tokens in (module docstring)."""

    def __init__(self, config: FrontDoorConfig, clock: Clock, router: Router,
                 links: dict[str, ReplicaLink], counts: dict[str, int], deadlines: Deadlines,
                 replicas: CameUp, connector: Connector, link_owner: LinkOwner,
                 watch: Watching) -> None:
        self.config = config
        self.clock = clock
        self.router = router
        self.links = links
        self.counts = counts
        self.deadlines = deadlines
        self.replicas = replicas
        self.connector = connector   # opens a replica link (TCP/Unix; the simulator's own)
        self.link_owner = link_owner
        self.watch = watch
        self._tasks: set[asyncio.Task] = set()
        self._late_log = RateLimitedLog(log, "first tokens past their deadline", clock=clock,
                                        interval_s=config.accept_log_interval_s)

    def dispatch(self, flight: Flight, replica: ReplicaLoad, predicted_s: float,
                 now: float | None = None) -> None:
        """Send ``flight`` to ``replica`` (predicted TTFT ``predicted_s`` from now) with
        ``deadline_ms``: the time left for its first token (the replica refuses, 429, what
        it predicts it cannot start within it); none for a request held for its model's
        start from zero (``Flight.cold``: it is served when that replica comes up)."""
        rid = replica.replica_id
        if now is None:
            now = self.clock.now()
        deadline_s = flight.warm_deadline_s
        if flight.deadline_s != deadline_s:  # held: which path's deadline depends on the replica
            deadline_s = self.deadlines.deadline_for(flight, rid)
        link = self.links.get(rid)
        if link is None or link.closed:
            link = self.connect(replica, None if flight.cold else deadline_s - now)
        flight.replica_id = rid
        flight.predicted_ttft_s = now - flight.arrival_s + predicted_s
        flight.sent_s, flight.sent_predicted_s = now, predicted_s
        flight.sent_slowdown = replica.slowdown
        self.router.on_dispatch(rid, flight.need_tokens, flight.prompt_tokens)
        self.counts["dispatched"] += 1
        left_ms = (deadline_s - now) * 1000.0
        message = flight.req.replica_message()
        if not flight.cold:   # one held for its model's start is served, late or not
            message["deadline_ms"] = left_ms if left_ms > 1.0 else 1.0
        flight.replica_rid = link.dispatch(flight, message)
        self.watch.watch(flight, replica, predicted_s, now)

    def connect(self, replica: ReplicaLoad, left_s: float | None = None) -> ReplicaLink:
        """A new link to ``replica``, connecting in the background within
        :func:`~agent.frontdoor.links.connect_timeout_s` of ``left_s`` (the time the request
        that opens it has left; None: it has no deadline there).  A failure or timeout to
        connect is the link's failure: its requests are placed again."""
        loop = asyncio.get_running_loop()
        link = ReplicaLink(self.link_owner, replica.replica_id, self.config.replica_limits)
        self.links[replica.replica_id] = link

        timeout_s = connect_timeout_s(left_s)

        async def connect() -> None:
            try:
                await asyncio.wait_for(self.connector(link, replica.address), timeout_s)
            except OSError as exc:   # TimeoutError included
                link.closed = True
                self.link_owner.replica_failed(
                    link, f"cannot connect to replica {replica.address} within "
                          f"{timeout_s:.2f} s: {type(exc).__name__}: {exc}")
        task = loop.create_task(connect())
        self._tasks.add(task)    # held until it ends: the loop keeps tasks weakly
        task.add_done_callback(self._tasks.discard)
        return link

    def first_token(self, flight: Flight, now: float) -> None:
        """``flight``'s first token came at ``now``: the replica's queued prefill goes into
        its active context (the router's accounting), its TTFT into the replica's measured
        error, and a first token past its deadline is counted and logged."""
        flight.ttft_s = now
        load = self.router.get(flight.replica_id)
        if load is not None:  # Router.on_first_token, inlined (once per request)
            prompt = flight.prompt_tokens
            if load.waiting_seqs > 0:
                load.waiting_seqs -= 1
            left = load.queued_prefill_tokens - prompt
            load.queued_prefill_tokens = left if left > 0 else 0
            load.active_ctx_tokens += prompt
            load.observe_ttft(flight.sent_predicted_s, now - flight.sent_s, flight.sent_slowdown)
        if now > flight.deadline_s:  # a prediction was wrong: say which
            self.counts["late_first_token"] += 1
            self._late_log.warning(
                "request %r for model %r: first token %.0f ms after arrival, past its "
                "deadline %.0f ms; predicted %.0f ms at replica %s",
                flight.req.request_id, flight.model, (now - flight.arrival_s) * 1000,
                (flight.deadline_s - flight.arrival_s) * 1000,
                (flight.predicted_ttft_s or 0.0) * 1000, flight.replica_id)

    def settle_path(self, flight: Flight) -> None:
        """A request that arrived before the replica serving it was brought up waited for that
        restore: it takes the restore's path.  (The registry may show the new replica, and the
        queue dispatch to it, before the restore's answer reaches this front door.)"""
        came_up = self.replicas.came_up(flight.replica_id)
        if flight.path == "warm_hit" and came_up is not None and flight.arrival_s <= came_up.at_s:
            flight.path, flight.restore_ms = came_up.path, came_up.restore_ms

    def tick_log(self, final: bool = False) -> None:
        """Summarise the rate-limited late-first-token log line (at once when ``final``)."""
        self._late_log.flush() if final else self._late_log.tick()

    def dispatched(self) -> int:
        """Requests at replicas, not yet answered."""
        return sum(len(link.in_flight) for link in self.links.values())
