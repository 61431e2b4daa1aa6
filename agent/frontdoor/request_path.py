"""The front door's one request path: both entrances (msgpack/TCP, HTTP) hand it requests.

An entrance validates and authenticates a request in its own wire form, builds a
:class:`GenerateRequest` and calls :meth:`RequestPath.submit` with a :class:`Sink` that turns
the answers back into its wire form.  Everything after that is here and shared: routing,
admission (deadline from arrival, earliest deadline first), capacity requests, the replica
links, telemetry.  :meth:`Flight.cancel` (the client went away) takes a queued request out
of its queue, or tells the replica to stop a dispatched one and frees its slot.

State machine of one ``generate`` request (deadline from arrival; SLOs per model and path)::

    submit ──► 404 / 413 / 503 (answered at once)
       │
       ├─ nobody queued, a warm replica's predicted TTFT within the warm SLO ─► DISPATCHED
       │      (lowest predicted TTFT; ``deadline_ms`` = time left)   nothing streamed:
       │                                                    │  replica 429, 503 or  │
       │                                                    │  link lost (reroute.py)┐
       │                                                    ├─ another replica ◄──┤
       │                                                    └─ tokens…, done      │
       │                                                       (link lost: 503)   │
       └─ else: can capacity arriving (restore ETA p99 per tier, restores in flight  │
          with their remaining ETA, the queue ahead) start it within the restore SLO?◄┘
              no ─► 429 + retry_after_ms at once
              yes ─► QUEUED (earliest deadline first) ─┬─ a replica can start it in time ─► DISPATCHED
                     asks for capacity (measured       ├─ prediction gone bad: 429 when known
                     sustainable concurrency)          ├─ deadline passed: 504, logged with
                                                       │  the prediction it broke (never sent)
                                                       └─ every restore failed: 503

Routing and admission are the pure :class:`~agent.frontdoor.router.Router` and
:class:`~agent.frontdoor.admission.AdmissionQueue`; this module wires them to the replica
links.  The registry is read off the request path (a watcher thread) into the router's view.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from agent.clock import Clock
from agent.cluster.base import ServiceInstance
from agent.errors import Overloaded
from agent.frontdoor.admission import AdmissionQueue, Pending
from agent.frontdoor.planner import QueuePlanner
from agent.frontdoor.ratelog import RateLimitedLog
from agent.frontdoor.request import SAMPLING_FIELDS, Flight, GenerateRequest, Sink
from agent.frontdoor.reroute import Reroute, _client_error, _retry_ms
from agent.frontdoor.restores import Restores
from agent.frontdoor.capacity import CapacityRequester, RestoreGate, RestoreTimes
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.links import Connector, ReplicaLink, open_socket
from agent.frontdoor.router import ReplicaLoad, Router
from agent.telemetry import Telemetry

__all__ = ["RequestPath", "GenerateRequest", "Sink", "Flight", "SAMPLING_FIELDS"]

log = logging.getLogger(__name__)

class RequestPath(QueuePlanner, Restores, Reroute):
    """Owns the router, the admission queues, the replica links and the capacity requests;
    :meth:`submit` is the one way in."""

    def __init__(self, config: FrontDoorConfig, *, clock: Clock, telemetry: Telemetry,
                 capacity: CapacityRequester | None = None,
                 connector: Connector = open_socket) -> None:
        self.config = config
        self.connector = connector  # opens a replica link (TCP/Unix; the simulator's own)
        self.clock = clock
        self.telemetry = telemetry
        self.capacity = capacity
        self.router = Router(config.prior_speed)
        self.gate = RestoreGate(per_model=config.restores_per_model,
                                overall=config.restores_overall)
        self.queues: dict[str, AdmissionQueue] = {}
        self.links: dict[str, ReplicaLink] = {}
        self.known_models: set[str] = set(config.models)
        self.last_restore: dict[str, tuple[float, str, float | None]] = {}
        self.came_up: dict[str, tuple[float, str, float | None]] = {}  # replica -> restore
        self._capped_until: dict[str, float] = {}  # model -> clock time to ask for capacity again
        self._capped: dict[str, int] = {}   # model -> warm replicas when a node answered at cap
        self.restore_times = RestoreTimes()
        self._deadline_ms = dict(config.models)  # model -> default deadline (ms)
        self.counts = {"requests": 0, "dispatched": 0, "done": 0, "errors": 0, "cancelled": 0,
                       "shed_429": 0, "expired_504": 0, "late_first_token": 0,
                       "replica_429": 0, "rerouted": 0}
        self._shape: dict[str, list[float]] = {}   # model -> [mean prompt, mean max_tokens]
        self._max_seqs: dict[str, int] = {}        # model -> largest replica's slots seen
        self._max_kv: dict[str, int] = {}          # model -> largest replica's KV seen (tokens)
        self._rechecked_s: dict[str, float] = {}   # model -> when its queue was last re-checked
        self._slot_cache: dict[str, tuple[float, list, float]] = {}
        self._per_replica_cache: dict[str, tuple[float, int]] = {}
        self._first_seen: dict[str, float] = {}    # replica id -> when it entered the view
        self._budgets: dict[str, tuple[float, float]] = {}  # model -> (warm, restore) s
        self._late_log = RateLimitedLog(log, "first tokens past their deadline", clock=clock,
                                        interval_s=config.accept_log_interval_s)
        self._expired_log = RateLimitedLog(log, "504s (deadline passed while queued)",
                                           clock=clock, interval_s=config.accept_log_interval_s)
        self.arrivals: dict[str, int] = {}  # generate requests per model (predictor input)
        # per model: [requests that arrived with no warm replica, those of them not served
        # within their SLO] (predictor input: is a release SLO-safe?)
        self.cold: dict[str, list[int]] = {}
        self.queued_models: set[str] = set()
        self._upserted: dict[str, float] = {}  # replica id -> when a restore reported it
        self.stopping = False
        self._drain_until_s: float | None = None
        self._restore_tasks: set[asyncio.Task] = set()  # held: the loop keeps weak references

    # --- the way in ------------------------------------------------------------------

    def submit(self, req: GenerateRequest, sink: Sink) -> Flight:
        """Take one validated request; its answers go to ``sink`` (perhaps before this
        returns: a refusal is immediate).  Returns the handle to cancel it with."""
        self.counts["requests"] += 1
        now = self.clock.now()
        flight = Flight(self, req, sink, now)
        model = req.model
        if self.stopping:
            left_s = (self._drain_until_s or now) - now
            self._fail(flight, 503, "front door shutting down (draining): not taking new "
                       "requests; another front door takes them",
                       retry_after_ms=max(1, round(max(left_s, 1.0) * 1000)))
            return flight
        if model not in self.known_models:  # (not counted by model: names are the client's)
            self._fail(flight, 404, f"unknown model {model!r}")
            return flight
        self.arrivals[model] = self.arrivals.get(model, 0) + 1
        if model not in self.cold:
            self.cold[model] = [0, 0]
        prompt = flight.prompt_tokens = req.prompt_tokens
        need = flight.need_tokens = prompt + req.max_tokens  # KV need
        shape = self._shape.get(model)
        if shape is None:
            shape = self._shape[model] = [float(prompt), float(req.max_tokens)]
        else:
            shape[0] += (prompt - shape[0]) * _SHAPE_GAIN
            shape[1] += (req.max_tokens - shape[1]) * _SHAPE_GAIN
        warm_s, restore_s = self._budgets_s(model, req.deadline_ms)
        flight.deadline_s = flight.warm_deadline_s = now + warm_s
        queue = self.queues.get(model)
        found = None
        if not queue:
            found = self.router.choose_predicted(model, need, prompt)
            if found is not None and found[1] <= warm_s:
                self._dispatch(flight, found[0], found[1], now)
                return flight
        warm = self.router.warm(model)
        # the largest replica now, or the largest seen (none warm: a restore brings up the
        # same replicas, so a request that no replica of the model can hold is 413, not 429)
        largest = max((r.kv_capacity_tokens for r in warm), default=0) or \
            self._max_kv.get(model, 0)
        if largest and need > largest:
            self._fail(flight, 413, f"request needs {need} KV tokens; the largest replica of "
                       f"{model!r} holds {largest}")
            return flight
        if not warm:   # (after the 413: one no replica can hold says nothing of keep-alive)
            flight.cold = True
            self.cold[model][0] += 1
        if self.capacity is None and not warm:
            self._fail(flight, 503, f"model {model!r}: no warm replica and no capacity "
                       f"requester configured")
            return flight
        flight.deadline_s = now + restore_s
        self._hold(flight, found[1] if found is not None else None)
        return flight

    def _budgets_s(self, model: str, deadline_ms: float | None) -> tuple[float, float]:
        """(warm, restore) time budgets (s from arrival) for a request of ``model``: its own
        ``deadline_ms`` for both, else each path's SLO capped by the model's default
        deadline (:class:`FrontDoorConfig`)."""
        if deadline_ms:
            return deadline_ms / 1000.0, deadline_ms / 1000.0
        budgets = self._budgets.get(model)
        if budgets is None:  # cached; dropped when a restore of the model is measured
            default_s = self._deadline_ms.get(model, self.config.default_deadline_ms) / 1000.0
            warm_s, restore_s = self.config.slo_s(model)
            if self.restore_times.p99_ms(model) is None:
                # Nothing restored yet: the first restore may be a cold boot (minutes, no
                # snapshot yet), which no restore-path SLO covers; the default deadline does.
                restore_s = default_s
            budgets = self._budgets[model] = (min(default_s, warm_s), min(default_s, restore_s))
        return budgets

    def _hold(self, flight: Flight, warm_pred_s: float | None) -> None:
        """Queue ``flight`` if capacity can start it before its deadline, else 429 at once.
        ``warm_pred_s``: the best warm replica's prediction (for the refusal's reason)."""
        model, now = flight.model, self.clock.now()
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = AdmissionQueue(
                model, clock=self.clock, max_depth=self.config.max_queue_depth,
                max_wait_s=self.config.max_wait_s)
        # the queue ahead (earlier deadlines) takes its slots first
        if len(queue) <= _EXACT_QUEUE:
            before, skip = [p.payload for p in queue.ordered()
                            if p.deadline_s <= flight.deadline_s], 0
        else:  # a long queue: the ones ahead are taken to hold the first slots
            before, skip = [], len(queue)
        # Admitted with a margin: one decode step at a full batch (the slot model's quantum
        # of error) and one re-check interval, so that a small error is a 429 now, not later.
        margin_s = self.config.recheck_s + self.router.prior(model).decode_step_s(
            self._max_seqs.get(model, 0) or self.config.default_max_seqs)
        predicted, first = self._assign(model, before + [flight], now, margin_s, skip)
        ttft_s = predicted[-1]
        if ttft_s is None:
            left_ms = (flight.deadline_s - now) * 1000.0
            # a replica already warm must make the warm-hit budget, not this one (planner)
            warm = ("no warm replica with a free slot" if warm_pred_s is None else
                    f"best warm replica predicted {warm_pred_s * 1000:.0f} ms, past the "
                    f"warm-hit budget of {(flight.warm_deadline_s - now) * 1000:.0f} ms")
            cap = "no capacity in sight can start it in time"
            retry_ms = max(1, round(((first if first < float("inf") else now + 1.0) - now)
                                    * 1000))
            self.counts["shed_429"] += 1
            self._fail(flight, 429, f"model {model!r}: cannot start within {left_ms:.0f} ms "
                       f"(the TTFT SLO from arrival): {warm}, {cap}, "
                       f"{len(queue)} queued ahead", retry_after_ms=retry_ms)
            if not self.gate.in_flight.get(model) and now >= self._capped_until.get(model, 0.0):
                self._restore_for(model, 1)  # demand seen: capacity for the next ones
            return
        flight.predicted_ttft_s = now - flight.arrival_s + ttft_s
        pending = Pending(flight.req.request_id, model, now, flight.deadline_s,
                          flight.need_tokens, flight)
        pending.predicted_ttft_s = flight.predicted_ttft_s
        try:
            queue.offer(pending)
        except Overloaded as err:
            self.counts["shed_429"] += 1
            self._fail(flight, 429, err.message, retry_after_ms=err.retry_after_ms)
            return
        flight.pending = pending
        self.queued_models.add(model)
        self.telemetry.queue_depth(model, len(queue))
        self._maybe_restore(model)

    def cancel(self, flight: Flight) -> None:
        """Forget ``flight`` (its client is gone): out of its queue, or cancelled at the
        replica (``cancel`` op) with its slot freed in the router's view."""
        if flight.over:
            return
        flight.over = True
        self.counts["cancelled"] += 1
        if flight.pending is not None:
            queue = self.queues[flight.model]
            queue.cancel(flight.pending)
            flight.pending = None
            self.telemetry.queue_depth(flight.model, len(queue))
            return
        link = self.links.get(flight.replica_id)
        if link is not None and flight.replica_rid in link.in_flight:
            link.cancel(flight.replica_rid)
            self.router.on_complete(link.replica_id, flight.need_tokens, flight.prompt_tokens,
                                    flight.ttft_s is not None)
            if self.queues.get(flight.model):
                self._drain(flight.model)

    def refused(self, request_id: Any, model: str, code: int) -> None:
        """Count a request an entrance refused itself (400, 401) before :meth:`submit`."""
        self.counts["errors"] += 1
        self.telemetry.event(request_id, model, "refused", code, 0.0, None, None, False)

    # --- dispatch and answers --------------------------------------------------------

    def _dispatch(self, flight: Flight, replica: ReplicaLoad, predicted_s: float,
                  now: float | None = None) -> None:
        """Send ``flight`` to ``replica`` (predicted TTFT ``predicted_s`` from now) with
        ``deadline_ms``: the time left for its first token (contract point 3)."""
        rid = replica.replica_id
        link = self.links.get(rid)
        if link is None or link.closed:
            link = self._connect(replica)
        if now is None:
            now = self.clock.now()
        flight.replica_id = rid
        flight.predicted_ttft_s = now - flight.arrival_s + predicted_s
        flight.sent_s, flight.sent_predicted_s = now, predicted_s
        flight.sent_slowdown = replica.slowdown
        self.router.on_dispatch(rid, flight.need_tokens, flight.prompt_tokens)
        self.counts["dispatched"] += 1
        deadline_s = flight.warm_deadline_s
        if flight.deadline_s != deadline_s:  # held: which path's deadline depends on the replica
            deadline_s = self._deadline_for(flight, rid)
        left_ms = (deadline_s - now) * 1000.0
        message = flight.req.replica_message()
        message["deadline_ms"] = left_ms if left_ms > 1.0 else 1.0
        flight.replica_rid = link.dispatch(flight, message)

    def _connect(self, replica: ReplicaLoad) -> ReplicaLink:
        loop = asyncio.get_running_loop()
        link = ReplicaLink(self, replica.replica_id, self.config.replica_limits)
        self.links[replica.replica_id] = link

        async def connect() -> None:
            try:
                await self.connector(link, replica.address)
            except OSError as exc:
                link.closed = True
                self.replica_failed(link, f"cannot connect to replica {replica.address}: {exc}")
        loop.create_task(connect())
        return link

    def on_answer(self, link: ReplicaLink, flight: Flight, message: dict) -> None:
        """A message from a replica for ``flight``: hand it to the flight's sink."""
        kind = message.get("type")
        if kind == "tokens":
            if flight.ttft_s is None:
                self._first_token(flight, self.clock.now())
            flight.sink.tokens(message)
            return
        now = self.clock.now()
        del link.in_flight[flight.replica_rid]
        had_first = flight.ttft_s is not None
        self.router.on_complete(link.replica_id, flight.need_tokens, flight.prompt_tokens,
                                had_first)
        if kind != "done" and not had_first and message.get("code") in (429, 503):
            if message.get("code") == 429:
                self._replica_refused(link, flight, message)
            else:
                self._replica_leaving(link, flight, message)
            return
        if not had_first and kind == "done":
            self._first_token(flight, now)
        flight.over = True
        self._settle_path(flight)
        ttft_ms = None if flight.ttft_s is None else (flight.ttft_s - flight.arrival_s) * 1000.0
        late = flight.ttft_s is None or flight.ttft_s > flight.deadline_s
        if kind != "done":   # an error misses the SLO, unless it is the client's (4xx, not 429)
            c = message.get("code")
            late = late and flight.ttft_s is not None if _client_error(c) else True
        if flight.cold and late:
            self.cold[flight.model][1] += 1
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
            flight.sink.error(code, str(message.get("reason", "replica error")),
                              _retry_ms(message.get("retry_after_ms")))
        self.telemetry.event(flight.req.request_id, flight.model, flight.path, code,
                             flight.queue_wait_ms, flight.restore_ms, ttft_ms if code == 200 else None,
                             flight.ttft_s is None or flight.ttft_s > flight.deadline_s,
                             predicted_ttft_ms=_ms(flight.predicted_ttft_s))
        if self.queues.get(flight.model):
            self._drain(flight.model)

    def _first_token(self, flight: Flight, now: float) -> None:
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
            self._late_log.warning("request %r for model %r: first token %.0f ms after arrival, past its "
                        "deadline %.0f ms; predicted %.0f ms at replica %s",
                        flight.req.request_id, flight.model, (now - flight.arrival_s) * 1000,
                        (flight.deadline_s - flight.arrival_s) * 1000,
                        (flight.predicted_ttft_s or 0.0) * 1000, flight.replica_id)

    def _settle_path(self, flight: Flight) -> None:
        """A request that arrived before the replica serving it was brought up waited for that
        restore: it takes the restore's path.  (The registry may show the new replica, and the
        queue dispatch to it, before the restore's answer reaches this front door.)"""
        came_up = self.came_up.get(flight.replica_id)
        if flight.path == "warm_hit" and came_up is not None and flight.arrival_s <= came_up[0]:
            flight.path, flight.restore_ms = came_up[1], came_up[2]

    def _fail(self, flight: Flight, code: int, reason: str, path: str = "refused",
              retry_after_ms: int | None = None, predicted_ttft_ms: float | None = None) -> None:
        """Answer ``flight`` with an error (its final answer) and record it."""
        if flight.over:
            return
        flight.over = True
        flight.pending = None
        self.counts["errors"] += 1
        if flight.cold and code in (429, 503, 504):
            self.cold[flight.model][1] += 1
        flight.sink.error(code, reason, retry_after_ms)
        self.telemetry.event(flight.req.request_id, flight.model, path, code, 0.0, None, None,
                             code == 504, reason=reason, predicted_ttft_ms=predicted_ttft_ms)

    # --- queues and restores ---------------------------------------------------------

    def _drain(self, model: str) -> None:
        """Dispatch queued requests earliest deadline first while a replica can start them
        within their deadlines.  A request that no replica can take now (its warm deadline
        passed, its restore not in) does not hold back the ones behind it: up to
        ``_DRAIN_SKIP`` such are passed over."""
        queue = self.queues[model]
        now = self.clock.now()
        restored = self.last_restore.get(model)
        while queue:
            head = queue.peek()
            if head is None:
                break
            found = self._choose_in_time(head.payload, now)
            if found is None:
                self._drain_past_heads(queue, now, restored)
                break
            queue.pop_earliest()
            self._send_queued(head.payload, found, now, restored)
        self.telemetry.queue_depth(model, len(queue))

    def _drain_past_heads(self, queue: AdmissionQueue, now: float, restored) -> None:
        for p in queue.ordered()[1:_DRAIN_SKIP + 1]:
            if not self.router.choose(p.model, p.need_tokens):
                return                                   # no slot anywhere: nothing to do
            found = self._choose_in_time(p.payload, now)
            if found is None:
                continue
            queue.cancel(p)                              # out of the heap (lazily)
            self._send_queued(p.payload, found, now, restored)

    def _send_queued(self, flight: Flight, found: tuple[ReplicaLoad, float], now: float,
                     restored) -> None:
        flight.pending = None
        flight.queue_wait_ms = (now - flight.arrival_s) * 1000.0
        if restored is not None and restored[0] >= flight.arrival_s:
            flight.path, flight.restore_ms = restored[1], restored[2]
        self._dispatch(flight, found[0], found[1])

    def _recheck(self, model: str) -> None:
        """Refuse (429) every queued request whose prediction has gone bad: the capacity in
        sight now (restores failed or late, sequences running longer than estimated) cannot
        start it before its deadline."""
        queue = self.queues.get(model)
        if not queue:
            return
        now = self.clock.now()
        self._slot_cache.pop(model, None)
        held = queue.ordered(_RECHECK_MAX)  # the rest are checked as they move up
        predicted, first = self._assign(model, [p.payload for p in held], now)
        for p, ttft_s in zip(held, predicted, strict=True):
            flight: Flight = p.payload
            if ttft_s is not None:
                continue
            queue.cancel(p)
            self.counts["shed_429"] += 1
            was = (flight.predicted_ttft_s or 0.0) * 1000
            self._fail(flight, 429, f"model {model!r}: queued with a predicted TTFT of "
                       f"{was:.0f} ms; capacity now in sight cannot start it within its "
                       f"deadline ({(p.deadline_s - now) * 1000:.0f} ms left)",
                       retry_after_ms=max(1, round(((first if first < float("inf")
                                                     else now + 1.0) - now) * 1000)))
        self.telemetry.queue_depth(model, len(queue))

    def expire_queued(self) -> None:
        """Answer queued requests past their deadline (504: a prediction was wrong, logged
        with it) or wait bound (429); every ``recheck_s`` re-check each queue against the
        capacity then in sight (:meth:`_recheck`)."""
        now = self.clock.now()
        for model in list(self.queued_models):
            queue = self.queues[model]
            for p in queue.expire():
                flight: Flight = p.payload
                if p.deadline_s <= now:
                    self.counts["expired_504"] += 1
                    waited_ms = (now - p.arrival_s) * 1000
                    predicted = (f"{p.predicted_ttft_s * 1000:.0f} ms"
                                 if p.predicted_ttft_s is not None else "none")
                    self._expired_log.warning(
                        "504 for request %r of model %r: deadline %.0f ms passed while queued; "
                        "its predicted TTFT was %s (restore p99 %s ms)", p.request_id, model,
                        (p.deadline_s - p.arrival_s) * 1000, predicted,
                        self.restore_times.p99_ms(model))
                    self._fail(flight, 504, f"deadline passed after {waited_ms:.0f} ms queued "
                               f"for model {model!r} (predicted TTFT {predicted})",
                               predicted_ttft_ms=_ms(p.predicted_ttft_s))
                else:
                    self.counts["shed_429"] += 1
                    self._fail(flight, 429, f"waited max_wait_s({queue.max_wait_s}) for "
                               f"model {model!r}", retry_after_ms=queue.retry_after_ms())
            if queue and now - self._rechecked_s.get(model, float("-inf")) >= self.config.recheck_s:
                self._rechecked_s[model] = now
                self._recheck(model)
            if not queue:
                self.queued_models.discard(model)
            self.telemetry.queue_depth(model, len(queue))

    # --- shutdown ----------------------------------------------------------------------

    def begin_stop(self, drain_until_s: float | None = None) -> None:
        """Drain: take no new requests (503 with ``retry_after_ms`` until ``drain_until_s``,
        when this front door is gone); answer every queued one 503 (never sent to a replica)."""
        self.stopping = True
        self._drain_until_s = drain_until_s
        for model in self.queues:
            self.refuse_queued(model, f"front door shutting down: request for model "
                                      f"{model!r} was queued and never sent to a replica")
        self.queued_models.clear()

    def tick_logs(self, final: bool = False) -> None:
        """Summarise rate-limited log lines whose interval is over (all, when ``final``)."""
        for rl in (self._late_log, self._expired_log):
            rl.flush() if final else rl.tick()

    def dispatched(self) -> int:
        """Requests at replicas, not yet answered."""
        return sum(len(link.in_flight) for link in self.links.values())

    def fail_dispatched(self, reason: str) -> None:
        """Answer every request still at a replica 503 with ``reason`` and close the links."""
        for link in list(self.links.values()):
            self.replica_failed(link, reason.format(replica=link.replica_id), retry=False)

    # --- the replica view ----------------------------------------------------------------

    def upsert(self, load: ReplicaLoad) -> None:
        """Put a reported load in the router, raised to at least what this front door has
        dispatched to the replica and not yet seen answered (a report may predate them)."""
        link = self.links.get(load.replica_id)
        if link is not None and link.in_flight:
            ours = list(link.in_flight.values())
            waiting = [f for f in ours if f.ttft_s is None]
            load.active_seqs = max(load.active_seqs, len(ours))
            load.kv_used_tokens = max(load.kv_used_tokens, sum(f.need_tokens for f in ours))
            load.waiting_seqs = max(load.waiting_seqs, len(waiting))
            load.queued_prefill_tokens = max(load.queued_prefill_tokens,
                                             sum(f.prompt_tokens for f in waiting))
        if load.max_seqs > self._max_seqs.get(load.model, 0):
            self._max_seqs[load.model] = load.max_seqs
        if load.kv_capacity_tokens > self._max_kv.get(load.model, 0):
            self._max_kv[load.model] = load.kv_capacity_tokens
        self._slot_cache.pop(load.model, None)
        if self.router.get(load.replica_id) is None:
            self._first_seen[load.replica_id] = self.clock.now()
            while len(self._first_seen) > 4096:       # oldest first out
                del self._first_seen[next(iter(self._first_seen))]
        self.router.upsert(load)

    def apply_replicas(self, instances: list[ServiceInstance]) -> None:
        """Replace the router's view with these passing replicas.  A replica's reported use
        is raised to at least what this front door has dispatched to it; one missing from
        the list leaves the view unless a restore reported it within the last
        3 x ``registry_poll_s`` (it may not be registered yet)."""
        seen = set()
        for inst in instances:
            try:
                load = ReplicaLoad.from_instance(inst)
            except ValueError as exc:
                log.warning("ignoring replica: %s", exc)
                continue
            seen.add(load.replica_id)
            self.known_models.add(load.model)
            self.upsert(load)
        now = self.clock.now()
        grace_s = 3 * self.config.registry_poll_s
        for model in self.router.models():
            for load in self.router.warm(model):
                if load.replica_id not in seen and now - self._upserted.get(
                        load.replica_id, -grace_s) >= grace_s:
                    self.router.remove(load.replica_id)
                    self._upserted.pop(load.replica_id, None)
        for rid, link in list(self.links.items()):  # gone and idle: hang up
            if rid not in seen and not link.in_flight and self.router.get(rid) is None:
                del self.links[rid]
                link.closed = True
                if link.transport is not None:
                    link.transport.close()
        for model in list(self.queued_models):
            if self.queues[model]:
                self._drain(model)

    def info(self, op: str, connections: int = 0) -> dict:
        """The answer to ``health``, ``models`` or ``stats`` (docs/protocol.md)."""
        if op == "health":
            return {"status": "ok", "connections": connections}
        if op == "models":
            return {m: {"warm": len(self.router.warm(m)),
                        "queued": len(self.queues.get(m) or ())}
                    for m in sorted(self.known_models)}
        # every known model from 0: a reader's first reading is its baseline, so a counter
        # that first appeared at 1 would hide the model's first request (and cold arrival)
        models = sorted(self.known_models | set(self.arrivals))
        return {**self.counts, "arrivals": {m: self.arrivals.get(m, 0) for m in models},
                "connections": connections,
                "cold": {m: dict(zip(("arrivals", "misses"), self.cold.get(m, (0, 0)), strict=True))
                         for m in models},
                "restores_in_flight": self.gate.total,
                "queued": {m: len(q) for m, q in self.queues.items() if q},
                "replicas": {r.replica_id: {"model": r.model, "active_seqs": r.active_seqs,
                                            "kv_used_tokens": r.kv_used_tokens,
                                            "kv_capacity_tokens": r.kv_capacity_tokens}
                             for m in self.router.models() for r in self.router.warm(m)}}


_DRAIN_SKIP = 32    # queued requests passed over per drain when the head cannot go yet
_EXACT_QUEUE = 32   # longer queues: a new request is placed after len(queue) slots
_RECHECK_MAX = 128  # queued requests re-checked each time, earliest deadline first
_SHAPE_GAIN = 0.05  # EWMA gain of the per-model mean prompt and max_tokens (~20 requests)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
