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
       │      (lowest predicted TTFT; ``deadline_ms`` = time left)   replica 429 ─┐
       │                                                    ├─ another replica ◄──┤
       │                                                    └─ tokens…, done      │
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
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from agent.clock import Clock
from agent.cluster.base import ServiceInstance
from agent.errors import Overloaded, RewarmError
from agent.frontdoor.admission import (AdmissionQueue, Pending, capacity_etas_s, queued_ttft_s,
                                       slot_times_s)
from agent.frontdoor.capacity import CapacityRequester, RestoreGate, RestoreTimes
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.links import ReplicaLink
from agent.frontdoor.router import ReplicaLoad, Router
from agent.protocol import PROTOCOL_VERSION
from agent.telemetry import Telemetry

log = logging.getLogger(__name__)

# Sampling fields a request may carry, forwarded to the replica when set (contract point 6).
SAMPLING_FIELDS = ("seed", "stop", "temperature", "top_p", "top_k")


@dataclass(slots=True)
class GenerateRequest:
    """One validated ``generate`` request, whichever entrance it came through.

    ``request_id``: the client's id (telemetry, logs); ``tokens`` ([int], the prompt's token
    ids) or ``prompt`` (text; the replica tokenizes it), exactly one; ``max_tokens``: tokens
    to generate (>= 1); ``deadline_ms``: the client's TTFT deadline counted from arrival, or
    None for the model's default; ``tenant``: who sent it (None without auth).  Sampling
    fields (None: the replica's default) are forwarded as they are.
    """

    request_id: Any
    model: str
    tokens: list[int] | None
    prompt: str | None
    max_tokens: int
    deadline_ms: float | None = None
    tenant: str | None = None
    seed: int | None = None
    stop: list | None = None          # token ids (and, where the replica supports it, strings)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def from_message(cls, message: dict, tenant: str | None = None) -> "GenerateRequest":
        """From a ``generate`` map already checked by :func:`agent.protocol.validate_request`."""
        get = message.get
        return cls(message["id"], message["model"], get("tokens"), get("prompt"),
                   message["max_tokens"], get("deadline_ms"), tenant, get("seed"), get("stop"),
                   get("temperature"), get("top_p"), get("top_k"))

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens: exact for ``tokens``; for text ~3 characters per BPE token
        (an overestimate for English with a byte-level BPE vocabulary)."""
        return len(self.tokens) if self.tokens is not None else len(self.prompt or "") // 3 + 1

    def replica_message(self) -> dict:
        """The ``generate`` map sent to a replica (its ``id`` is set by the link)."""
        msg = {"v": PROTOCOL_VERSION, "op": "generate", "model": self.model,
               "max_tokens": self.max_tokens}
        if self.tokens is not None:
            msg["tokens"] = self.tokens
        else:
            msg["prompt"] = self.prompt
        if self.seed is not None:
            msg["seed"] = self.seed
        if self.stop is not None:
            msg["stop"] = self.stop
        if self.temperature is not None:
            msg["temperature"] = self.temperature
        if self.top_p is not None:
            msg["top_p"] = self.top_p
        if self.top_k is not None:
            msg["top_k"] = self.top_k
        return msg


class Sink(Protocol):
    """Where one request's answers go (an entrance's adapter).  Exactly one of :meth:`done`
    or :meth:`error` is called, last; none after the request was cancelled."""

    def tokens(self, message: dict) -> None:
        """A chunk: ``{"type": "tokens", "tokens": [int], "text"?: str}`` (its ``id`` is the
        replica link's own: the sink puts its client's id in)."""
        ...

    def done(self, message: dict) -> None:
        """The end: ``{"type": "done", "n_tokens", "text"?, "ttft_ms", "total_ms", "path",
        "replica", "queue_wait_ms"}`` (times measured here, from arrival)."""
        ...

    def error(self, code: int, reason: str, retry_after_ms: int | None = None) -> None:
        """A refusal or failure: HTTP-like ``code`` (400..504), ``reason`` naming the value
        and the limit, ``retry_after_ms`` with 429 and 503."""
        ...


class Flight:
    """One request inside the front door, from submit to its final answer (or cancel)."""

    __slots__ = ("owner", "req", "sink", "model", "arrival_s", "deadline_s", "need_tokens",
                 "prompt_tokens", "path", "restore_ms", "queue_wait_ms", "replica_id",
                 "replica_rid", "ttft_s", "pending", "over", "predicted_ttft_s", "tried")

    def __init__(self, owner: "RequestPath", req: GenerateRequest, sink: Sink,
                 arrival_s: float) -> None:
        self.owner, self.req, self.sink, self.model = owner, req, sink, req.model
        self.arrival_s = arrival_s
        self.deadline_s = arrival_s
        self.need_tokens = 0
        self.prompt_tokens = 0
        self.predicted_ttft_s: float | None = None  # from arrival, when it was last placed
        self.tried: set[str] | None = None          # replicas that refused it (429)
        self.path = "warm_hit"
        self.restore_ms: float | None = None
        self.queue_wait_ms = 0.0
        self.replica_id = ""
        self.replica_rid = 0
        self.ttft_s: float | None = None
        self.pending: Pending | None = None
        self.over = False  # answered (done/error) or cancelled

    def cancel(self) -> None:
        """The client went away: forget this request (no answer is sent)."""
        self.owner.cancel(self)


class RequestPath:
    """Owns the router, the admission queues, the replica links and the capacity requests;
    :meth:`submit` is the one way in."""

    def __init__(self, config: FrontDoorConfig, *, clock: Clock, telemetry: Telemetry,
                 capacity: CapacityRequester | None = None) -> None:
        self.config = config
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
        self.restore_times = RestoreTimes()
        self._deadline_ms = dict(config.models)  # model -> default deadline (ms)
        self.counts = {"requests": 0, "dispatched": 0, "done": 0, "errors": 0, "cancelled": 0,
                       "shed_429": 0, "expired_504": 0, "late_first_token": 0,
                       "replica_429": 0}
        self._shape: dict[str, list[float]] = {}   # model -> [mean prompt, mean max_tokens]
        self._max_seqs: dict[str, int] = {}        # model -> largest replica's slots seen
        self._recheck_at: dict[str, float] = {}    # model -> when a restore in flight is due
        self._slot_cache: dict[str, tuple[float, list[float], list[float]]] = {}
        self._event_kw = _keywords(telemetry.event)
        self.arrivals: dict[str, int] = {}  # generate requests per model (predictor input)
        self.queued_models: set[str] = set()
        self._upserted: dict[str, float] = {}  # replica id -> when a restore reported it
        self.stopping = False

    # --- the way in ------------------------------------------------------------------

    def submit(self, req: GenerateRequest, sink: Sink) -> Flight:
        """Take one validated request; its answers go to ``sink`` (perhaps before this
        returns: a refusal is immediate).  Returns the handle to cancel it with."""
        self.counts["requests"] += 1
        now = self.clock.now()
        flight = Flight(self, req, sink, now)
        model = req.model
        if self.stopping:
            self._fail(flight, 503, "front door shutting down: not taking new requests",
                       retry_after_ms=1000)
            return flight
        if model not in self.known_models:  # (not counted by model: names are the client's)
            self._fail(flight, 404, f"unknown model {model!r}")
            return flight
        self.arrivals[model] = self.arrivals.get(model, 0) + 1
        prompt = flight.prompt_tokens = req.prompt_tokens
        need = flight.need_tokens = prompt + req.max_tokens  # KV need
        shape = self._shape.get(model)
        if shape is None:
            shape = self._shape[model] = [float(prompt), float(req.max_tokens)]
        shape[0] += (prompt - shape[0]) * _SHAPE_GAIN
        shape[1] += (req.max_tokens - shape[1]) * _SHAPE_GAIN
        warm_s, restore_s = self._budgets_s(model, req.deadline_ms)
        flight.deadline_s = now + warm_s
        queue = self.queues.get(model)
        found = None
        if not queue:
            found = self.router.choose_predicted(model, need, prompt)
            if found is not None and found[1] <= warm_s:
                self._dispatch(flight, found[0], found[1])
                return flight
        warm = self.router.warm(model)
        if warm and need > max(r.kv_capacity_tokens for r in warm):
            largest = max(r.kv_capacity_tokens for r in warm)
            self._fail(flight, 413, f"request needs {need} KV tokens; the largest replica of "
                       f"{model!r} holds {largest}")
            return flight
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
        default_s = self._deadline_ms.get(model, self.config.default_deadline_ms) / 1000.0
        warm_s, restore_s = self.config.slo_s(model)
        return min(default_s, warm_s), min(default_s, restore_s)

    def _hold(self, flight: Flight, warm_pred_s: float | None) -> None:
        """Queue ``flight`` if capacity can start it before its deadline, else 429 at once.
        ``warm_pred_s``: the best warm replica's prediction (for the refusal's reason)."""
        model, now = flight.model, self.clock.now()
        queue = self.queues.get(model)
        if queue is None:
            queue = self.queues[model] = AdmissionQueue(
                model, clock=self.clock, max_depth=self.config.max_queue_depth,
                max_wait_s=self.config.max_wait_s)
        slots, etas = self._slots(model, now)
        ttft_s = queued_ttft_s(now, slots, len(queue),
                               self.router.prior(model).prefill_s(flight.prompt_tokens))
        if ttft_s is None or now + ttft_s > flight.deadline_s:
            left_ms = (flight.deadline_s - now) * 1000.0
            warm = ("no warm replica with a free slot" if warm_pred_s is None else
                    f"best warm replica predicted {warm_pred_s * 1000:.0f} ms")
            cap = ("no capacity in sight" if ttft_s is None else
                   f"waiting for capacity predicted {ttft_s * 1000:.0f} ms")
            retry_ms = max(1, round(((slots[0] if slots else now + 1.0) - now) * 1000))
            self.counts["shed_429"] += 1
            self._fail(flight, 429, f"model {model!r}: cannot start within {left_ms:.0f} ms "
                       f"(the TTFT SLO from arrival): {warm}, {cap}, "
                       f"{len(queue)} queued ahead", retry_after_ms=retry_ms,
                       predicted_ttft_ms=None if ttft_s is None else ttft_s * 1000.0)
            if not self.gate.in_flight.get(model) and not self.router.warm(model):
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

    def _etas_s(self, model: str, now: float) -> list[float]:
        """When new replicas of ``model`` are expected (restores in flight, and those that
        could start now), soonest first (:func:`capacity_etas_s`)."""
        p99, p50 = self.restore_times.p99_ms(model), self.restore_times.p50_ms(model)
        startable = self.gate.room(model) if self.capacity is not None else 0
        return capacity_etas_s(now, self.gate.started_s.get(model, []),
                               None if p50 is None else p50 / 1000.0,
                               None if p99 is None else p99 / 1000.0, startable)

    def _slots(self, model: str, now: float) -> tuple[list[float], list[float]]:
        """(slot times, restore ETAs) for ``model``'s queue (:func:`slot_times_s`): the
        expected end of each request at its warm replicas (dispatch + predicted TTFT +
        max_tokens decode steps at the replica's batch) and the new replicas' slots.
        Cached for ``tick_s`` (a burst of arrivals shares one computation)."""
        cached = self._slot_cache.get(model)
        if cached is not None and now - cached[0] < self.config.tick_s:
            return cached[1], cached[2]
        prior = self.router.prior(model)
        frees = []
        for load in self.router.warm(model):
            link = self.links.get(load.replica_id)
            if link is None or not link.in_flight:
                continue
            step_s = (load.speed or prior).decode_step_s(max(1, load.active_seqs),
                                                         load.active_ctx_tokens)
            for f in link.in_flight.values():
                end = f.arrival_s + (f.predicted_ttft_s or 0.0) + f.req.max_tokens * step_s
                frees.append(end if end > now else now + step_s)
        etas = self._etas_s(model, now)
        mean_prompt = self._shape.get(model, (1.0, 1.0))[0]
        slots = slot_times_s(frees, etas, self._per_replica(model),
                             prior.prefill_s(int(mean_prompt)))
        self._slot_cache[model] = (now, slots, etas)
        return slots, etas

    def _per_replica(self, model: str) -> int:
        """Requests one new replica of ``model`` serves within the warm SLO: its sustainable
        concurrency (agent/speed.py) at the model's mean prompt and max_tokens, with the
        model's prior speed, within the largest replica's slots seen."""
        prompt, gen = self._shape.get(model, (1.0, 1.0))
        max_seqs = self._max_seqs.get(model, 0) or max(
            (r.max_seqs for r in self.router.warm(model)), default=self.config.default_max_seqs)
        return self.router.prior(model).sustainable_concurrency(
            self.config.slo_s(model)[0], prompt, gen, max_seqs)

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
        self._event(request_id, model, "refused", code, 0.0, None, None, False)

    # --- dispatch and answers --------------------------------------------------------

    def _dispatch(self, flight: Flight, replica: ReplicaLoad, predicted_s: float) -> None:
        """Send ``flight`` to ``replica`` (predicted TTFT ``predicted_s`` from now) with
        ``deadline_ms``: the time left for its first token (contract point 3)."""
        link = self.links.get(replica.replica_id)
        if link is None or link.closed:
            link = self._connect(replica)
        now = self.clock.now()
        flight.replica_id = replica.replica_id
        flight.predicted_ttft_s = now - flight.arrival_s + predicted_s
        self.router.on_dispatch(replica.replica_id, flight.need_tokens, flight.prompt_tokens)
        self.counts["dispatched"] += 1
        message = flight.req.replica_message()
        message["deadline_ms"] = max(1.0, (flight.deadline_s - now) * 1000.0)
        flight.replica_rid = link.dispatch(flight, message)

    def _connect(self, replica: ReplicaLoad) -> ReplicaLink:
        loop = asyncio.get_running_loop()
        link = ReplicaLink(self, replica.replica_id, self.config.replica_limits)
        self.links[replica.replica_id] = link
        host, _, port = replica.address.rpartition(":")

        async def connect() -> None:
            try:
                if host:
                    await loop.create_connection(lambda: link, host, int(port))
                else:
                    await loop.create_unix_connection(lambda: link, replica.address)
            except OSError as exc:
                link.closed = True
                self.replica_failed(link, f"cannot connect to replica {replica.address}: {exc}")
        loop.create_task(connect())
        return link

    def on_answer(self, link: ReplicaLink, flight: Flight, message: dict) -> None:
        """A message from a replica for ``flight``: hand it to the flight's sink."""
        kind = message.get("type")
        now = self.clock.now()
        if kind == "tokens":
            if flight.ttft_s is None:
                self._first_token(flight, now)
            flight.sink.tokens(message)
            return
        del link.in_flight[flight.replica_rid]
        had_first = flight.ttft_s is not None
        self.router.on_complete(link.replica_id, flight.need_tokens, flight.prompt_tokens,
                                had_first)
        if kind != "done" and not had_first and message.get("code") == 429:
            self._replica_refused(link, flight, message)
            return
        if not had_first and kind == "done":
            self._first_token(flight, now)
        flight.over = True
        self._settle_path(flight)
        ttft_ms = None if flight.ttft_s is None else (flight.ttft_s - flight.arrival_s) * 1000.0
        if kind == "done":
            self.counts["done"] += 1
            message["ttft_ms"] = ttft_ms
            message["total_ms"] = (now - flight.arrival_s) * 1000.0
            message["path"] = flight.path
            message["replica"] = link.replica_id
            message["queue_wait_ms"] = flight.queue_wait_ms
            code = 200
            flight.sink.done(message)
        else:
            self.counts["errors"] += 1
            code = message.get("code", 500)
            if type(code) is not int:
                code = 500
            flight.sink.error(code, str(message.get("reason", "replica error")),
                              message.get("retry_after_ms"))
        self._event(flight.req.request_id, flight.model, flight.path, code,
                    flight.queue_wait_ms, flight.restore_ms, ttft_ms if code == 200 else None,
                    flight.ttft_s is None or flight.ttft_s > flight.deadline_s,
                    predicted_ttft_ms=_ms(flight.predicted_ttft_s))
        if self.queues.get(flight.model):
            self._drain(flight.model)

    def _first_token(self, flight: Flight, now: float) -> None:
        flight.ttft_s = now
        self.router.on_first_token(flight.replica_id, flight.prompt_tokens)
        if now > flight.deadline_s:  # a prediction was wrong: say which
            self.counts["late_first_token"] += 1
            log.warning("request %r for model %r: first token %.0f ms after arrival, past its "
                        "deadline %.0f ms; predicted %.0f ms at replica %s",
                        flight.req.request_id, flight.model, (now - flight.arrival_s) * 1000,
                        (flight.deadline_s - flight.arrival_s) * 1000,
                        (flight.predicted_ttft_s or 0.0) * 1000, flight.replica_id)

    def _replica_refused(self, link: ReplicaLink, flight: Flight, message: dict) -> None:
        """The replica predicted it cannot start ``flight`` in time (429, contract point 3):
        another replica that can, else hold it if capacity can still make its deadline,
        else 429.  Predictions for that replica carry the difference until its next report."""
        self.counts["replica_429"] += 1
        load = self.router.get(link.replica_id)
        theirs = message.get("predicted_ttft_ms")
        if load is not None and isinstance(theirs, (int, float)) and flight.predicted_ttft_s:
            ours_s = flight.predicted_ttft_s - (flight.queue_wait_ms / 1000.0)
            load.penalty_s = max(load.penalty_s, theirs / 1000.0 - ours_s)
        flight.tried = (flight.tried or set()) | {link.replica_id}
        now = self.clock.now()
        found = self.router.choose_predicted(flight.model, flight.need_tokens,
                                             flight.prompt_tokens, flight.tried)
        if found is not None and now + found[1] <= flight.deadline_s:
            self._dispatch(flight, found[0], found[1])
            return
        if self.capacity is not None:
            self._hold(flight, None if found is None else found[1])
            return
        self.counts["shed_429"] += 1
        retry = message.get("retry_after_ms")
        self._fail(flight, 429, str(message.get("reason", "replica refused")),
                   retry_after_ms=retry if type(retry) is int else None)

    def _settle_path(self, flight: Flight) -> None:
        """A request that arrived before the replica serving it was brought up waited for that
        restore: it takes the restore's path.  (The registry may show the new replica, and the
        queue dispatch to it, before the restore's answer reaches this front door.)"""
        came_up = self.came_up.get(flight.replica_id)
        if flight.path == "warm_hit" and came_up is not None and flight.arrival_s <= came_up[0]:
            flight.path, flight.restore_ms = came_up[1], came_up[2]

    def replica_failed(self, link: ReplicaLink, reason: str) -> None:
        """The link broke: its requests get 503 and the replica leaves the view until the
        registry shows it again."""
        link.closed = True
        if self.links.get(link.replica_id) is link:
            del self.links[link.replica_id]
        self.router.remove(link.replica_id)
        failed, link.in_flight = list(link.in_flight.values()), {}
        for flight in failed:
            self._fail(flight, 503, reason, path=flight.path)
        if link.transport is not None:
            link.transport.close()

    def _fail(self, flight: Flight, code: int, reason: str, path: str = "refused",
              retry_after_ms: int | None = None, predicted_ttft_ms: float | None = None) -> None:
        """Answer ``flight`` with an error (its final answer) and record it."""
        if flight.over:
            return
        flight.over = True
        flight.pending = None
        self.counts["errors"] += 1
        flight.sink.error(code, reason, retry_after_ms)
        self._event(flight.req.request_id, flight.model, path, code, 0.0, None, None,
                    code == 504, reason=reason, predicted_ttft_ms=predicted_ttft_ms)

    def _event(self, *args: Any, **kw: Any) -> None:
        """Telemetry's event, with the keywords it knows (``reason``, ``predicted_ttft_ms``
        arrive with the ops branch's telemetry; older telemetry is called without them)."""
        self.telemetry.event(*args, **{k: v for k, v in kw.items() if k in self._event_kw})

    # --- queues and restores ---------------------------------------------------------

    def _drain(self, model: str) -> None:
        """Dispatch queued requests earliest deadline first while a replica can start the
        head within its deadline."""
        queue = self.queues[model]
        now = self.clock.now()
        restored = self.last_restore.get(model)
        while queue:
            head = queue.peek()
            flight: Flight = head.payload
            found = self.router.choose_predicted(model, head.need_tokens, flight.prompt_tokens,
                                                 flight.tried or frozenset())
            if found is None or now + found[1] > head.deadline_s:
                break
            queue.pop_earliest()
            flight.pending = None
            flight.queue_wait_ms = (now - flight.arrival_s) * 1000.0
            if restored is not None and restored[0] >= flight.arrival_s:
                flight.path, flight.restore_ms = restored[1], restored[2]
            self._dispatch(flight, found[0], found[1])
        self.telemetry.queue_depth(model, len(queue))

    def _recheck(self, model: str) -> None:
        """Refuse (429) every queued request whose prediction has gone bad: the capacity in
        sight now (restores failed, or late) cannot start it before its deadline."""
        queue = self.queues.get(model)
        if not queue:
            return
        now = self.clock.now()
        self._slot_cache.pop(model, None)
        slots, etas = self._slots(model, now)
        prior = self.router.prior(model)
        ahead = 0
        for p in queue.ordered():
            flight: Flight = p.payload
            ttft_s = queued_ttft_s(now, slots, ahead, prior.prefill_s(flight.prompt_tokens))
            if ttft_s is not None and now + ttft_s <= p.deadline_s:
                ahead += 1
                continue
            queue.cancel(p)
            self.counts["shed_429"] += 1
            was = (flight.predicted_ttft_s or 0.0) * 1000
            self._fail(flight, 429, f"model {model!r}: queued with a predicted TTFT of "
                       f"{was:.0f} ms; capacity now in sight cannot start it within its "
                       f"deadline ({(p.deadline_s - now) * 1000:.0f} ms left)",
                       retry_after_ms=max(1, round(((slots[0] if slots else now + 1.0) - now)
                                                   * 1000)))
        self.telemetry.queue_depth(model, len(queue))

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
        for _ in range(min(n, self.gate.room(model))):
            self.gate.started(model, now)
            asyncio.get_running_loop().create_task(self._restore(model))
        self.telemetry.restores_in_flight(self.gate.total)
        p99 = self.restore_times.p99_ms(model)
        starts = self.gate.started_s.get(model)
        if p99 is not None and starts:
            self._recheck_at[model] = min(starts) + p99 / 1000.0

    async def _restore(self, model: str) -> None:
        ok = False
        started = self.clock.now()
        try:
            result = await self.capacity.request_restore(model)
            ok = True
            self._restore_outcome(model, True)
            now = self.clock.now()
            self.last_restore[model] = (now, result.path, result.restore_ms)
            if result.path != "warm_hit":  # an existing replica's answer measures nothing
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
        except Exception as exc:  # the requester's failure, whatever it is, ends this restore
            log.warning("restore of %s failed: %s", model, exc)
            reason = exc.message if isinstance(exc, RewarmError) else str(exc)
            self._restore_outcome(model, False, reason)
        finally:
            self.gate.finished(model)
            self._recheck_at.pop(model, None)
            self.telemetry.restores_in_flight(self.gate.total)
        queue = self.queues.get(model)
        if not queue:
            return
        self._drain(model)
        self._recheck(model)
        if ok:
            if queue and result.path == "warm_hit":
                # The node is at its replica cap and answered with a replica it already had:
                # asking again at once would spin; queued requests go as it frees slots.
                backoff_s = self.config.at_capacity_backoff_s
                self._capped_until[model] = self.clock.now() + backoff_s
                asyncio.get_running_loop().call_later(backoff_s, self._probe_restore, model)
            elif queue:
                self._maybe_restore(model)
        elif not self.gate.in_flight.get(model) and not self.router.warm(model):
            # nothing can succeed now: say so promptly
            self.refuse_queued(model, f"model {model!r}: no capacity can be restored: {reason}")

    def refuse_queued(self, model: str, reason: str) -> None:
        """Answer every request queued for ``model`` 503 with ``reason`` (never dispatched)."""
        for p in self.queues[model].drain():
            self._fail(p.payload, 503, reason)
        self.telemetry.queue_depth(model, 0)

    def _restore_outcome(self, model: str, ok: bool, reason: str | None = None) -> None:
        hook = getattr(self.telemetry, "restore_outcome", None)  # the ops branch's readiness
        if hook is not None:
            hook(model, ok, reason) if reason is not None else hook(model, ok)

    def _restore_measured(self, model: str, restore_ms: float,
                          path: str = "snapshot_restore") -> None:
        self.restore_times.record(model, restore_ms, path)
        if model not in self.config.models:
            self._deadline_ms[model] = max(
                self.config.default_deadline_ms,
                self.config.deadline_per_restore_p99 * self.restore_times.p99_ms(model))

    def expire_queued(self) -> None:
        """Answer queued requests past their deadline (504: a prediction was wrong, logged
        with it) or wait bound (429); re-check a model's queue when a restore it counts on
        passes its p99 without arriving."""
        now = self.clock.now()
        for model in list(self.queued_models):
            queue = self.queues[model]
            due = self._recheck_at.get(model)
            if due is not None and now >= due:
                del self._recheck_at[model]
                self._recheck(model)
            for p in queue.expire():
                flight: Flight = p.payload
                if p.deadline_s <= now:
                    self.counts["expired_504"] += 1
                    waited_ms = (now - p.arrival_s) * 1000
                    predicted = (f"{p.predicted_ttft_s * 1000:.0f} ms"
                                 if p.predicted_ttft_s is not None else "none")
                    log.warning("504 for request %r of model %r: deadline %.0f ms passed while "
                                "queued; its predicted TTFT was %s (restore p99 %s ms)",
                                p.request_id, model, (p.deadline_s - p.arrival_s) * 1000,
                                predicted, self.restore_times.p99_ms(model))
                    self._fail(flight, 504, f"deadline passed after {waited_ms:.0f} ms queued "
                               f"for model {model!r} (predicted TTFT {predicted})",
                               predicted_ttft_ms=_ms(p.predicted_ttft_s))
                else:
                    self.counts["shed_429"] += 1
                    self._fail(flight, 429, f"waited max_wait_s({queue.max_wait_s}) for "
                               f"model {model!r}", retry_after_ms=queue.retry_after_ms())
            if not queue:
                self.queued_models.discard(model)
            self.telemetry.queue_depth(model, len(queue))

    # --- shutdown ----------------------------------------------------------------------

    def begin_stop(self) -> None:
        """Take no new requests; answer every queued one 503 (never sent to a replica)."""
        self.stopping = True
        for model in self.queues:
            self.refuse_queued(model, f"front door shutting down: request for model "
                                      f"{model!r} was queued and never sent to a replica")
        self.queued_models.clear()

    def dispatched(self) -> int:
        """Requests at replicas, not yet answered."""
        return sum(len(link.in_flight) for link in self.links.values())

    def fail_dispatched(self, reason: str) -> None:
        """Answer every request still at a replica 503 with ``reason`` and close the links."""
        for link in list(self.links.values()):
            self.replica_failed(link, reason.format(replica=link.replica_id))

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
        return {**self.counts, "arrivals": dict(self.arrivals), "connections": connections,
                "restores_in_flight": self.gate.total,
                "queued": {m: len(q) for m, q in self.queues.items() if q},
                "replicas": {r.replica_id: {"model": r.model, "active_seqs": r.active_seqs,
                                            "kv_used_tokens": r.kv_used_tokens,
                                            "kv_capacity_tokens": r.kv_capacity_tokens}
                             for m in self.router.models() for r in self.router.warm(m)}}


_SHAPE_GAIN = 0.05  # EWMA gain of the per-model mean prompt and max_tokens (~20 requests)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _keywords(fn: Any) -> frozenset:
    """The keyword-only parameters ``fn`` accepts."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return frozenset({"reason", "predicted_ttft_ms"})
    return frozenset(p.name for p in params if p.kind is p.KEYWORD_ONLY)
