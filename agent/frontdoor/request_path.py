"""The front door's one request path: both entrances (msgpack/TCP, HTTP) hand it requests.

An entrance validates and authenticates a request in its own wire form, builds a
:class:`GenerateRequest` and calls :meth:`RequestPath.submit` with a :class:`Sink` that turns
the answers back into its wire form.  Everything after that is here and shared: routing,
admission (deadline from arrival, earliest deadline first), capacity requests, the replica
links, telemetry.  :meth:`Flight.cancel` (the client went away) takes a queued request out
of its queue, or tells the replica to stop a dispatched one and frees its slot.

State machine of one ``generate`` request::

    submit ──► 404 / 503 (answered at once)
       │
       ├─ warm replica with headroom, nobody queued ─► DISPATCHED ─► tokens…, done
       │
       └─ else ─► QUEUED (per-model deadline heap) ─┬─ replica warm/freed ─► DISPATCHED
                   │ full / wait too long: 429      ├─ deadline passed: 504 (never sent)
                   └─ asks for a restore (capped)   └─ every restore failed: 503

Routing and admission are the pure :class:`~agent.frontdoor.router.Router` and
:class:`~agent.frontdoor.admission.AdmissionQueue`; this module wires them to the replica
links.  The registry is read off the request path (a watcher thread) into the router's view.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from agent.clock import Clock
from agent.cluster.base import ServiceInstance
from agent.errors import Overloaded, RewarmError
from agent.frontdoor.admission import AdmissionQueue, Pending
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
    messages: list | None = None      # chat turns [{role, content}] instead of tokens/prompt

    @classmethod
    def from_message(cls, message: dict, tenant: str | None = None) -> "GenerateRequest":
        """From a ``generate`` map already checked by :func:`agent.protocol.validate_request`."""
        get = message.get
        return cls(message["id"], message["model"], get("tokens"), get("prompt"),
                   message["max_tokens"], get("deadline_ms"), tenant, get("seed"), get("stop"),
                   get("temperature"), get("top_p"), get("top_k"), get("messages"))

    @property
    def prompt_tokens(self) -> int:
        """Prompt length in tokens: exact for ``tokens``; for text ~3 characters per BPE token
        (an overestimate for English with a byte-level BPE vocabulary)."""
        if self.tokens is not None:
            return len(self.tokens)
        if self.messages is not None:  # the chat template adds a few tokens per turn
            return sum(len(m["content"]) // 3 + 8 for m in self.messages) + 8
        return len(self.prompt or "") // 3 + 1

    def replica_message(self) -> dict:
        """The ``generate`` map sent to a replica (its ``id`` is set by the link)."""
        msg = {"v": PROTOCOL_VERSION, "op": "generate", "model": self.model,
               "max_tokens": self.max_tokens}
        if self.tokens is not None:
            msg["tokens"] = self.tokens
        elif self.messages is not None:
            msg["messages"] = self.messages
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
                 "path", "restore_ms", "queue_wait_ms", "replica_id", "replica_rid", "ttft_s",
                 "pending", "over")

    def __init__(self, owner: "RequestPath", req: GenerateRequest, sink: Sink,
                 arrival_s: float) -> None:
        self.owner, self.req, self.sink, self.model = owner, req, sink, req.model
        self.arrival_s = arrival_s
        self.deadline_s = arrival_s
        self.need_tokens = 0
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
        self.router = Router()
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
        self.counts = {"requests": 0, "dispatched": 0, "done": 0, "errors": 0, "cancelled": 0}
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
        # KV need: prompt tokens + max_tokens.
        need = flight.need_tokens = req.prompt_tokens + req.max_tokens
        deadline_ms = req.deadline_ms or self._deadline_ms.get(
            model, self.config.default_deadline_ms)
        flight.deadline_s = now + deadline_ms / 1000.0
        queue = self.queues.get(model)
        if not queue:
            replica = self.router.choose(model, need)
            if replica is not None:
                self._dispatch(flight, replica)
                return flight
        warm = self.router.warm(model)
        if warm and need > max(r.kv_capacity_tokens for r in warm):
            largest = max(r.kv_capacity_tokens for r in warm)
            self._fail(flight, 413, f"request needs {need} KV tokens; the largest replica of "
                       f"{model!r} holds {largest}")
            return flight
        if queue is None:
            queue = self.queues[model] = AdmissionQueue(
                model, clock=self.clock, max_depth=self.config.max_queue_depth,
                max_wait_s=self.config.max_wait_s)
        if self.capacity is None and not warm:
            self._fail(flight, 503, f"model {model!r}: no warm replica and no capacity "
                       f"requester configured")
            return flight
        p99_ms = self.restore_times.p99_ms(model)
        queue.expected_wait_s = p99_ms / 1000.0 if p99_ms and not warm else 0.0
        pending = Pending(req.request_id, model, now, flight.deadline_s, need, flight)
        try:
            queue.offer(pending)
        except Overloaded as err:
            self._fail(flight, 429, err.message, retry_after_ms=err.retry_after_ms)
            return flight
        flight.pending = pending
        self.queued_models.add(model)
        self.telemetry.queue_depth(model, len(queue))
        self._maybe_restore(model)
        return flight

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
            self.router.on_complete(link.replica_id, flight.need_tokens)
            if self.queues.get(flight.model):
                self._drain(flight.model)

    def refused(self, request_id: Any, model: str, code: int) -> None:
        """Count a request an entrance refused itself (400, 401) before :meth:`submit`."""
        self.counts["errors"] += 1
        self.telemetry.event(request_id, model, "refused", code, 0.0, None, None, False)

    # --- dispatch and answers --------------------------------------------------------

    def _dispatch(self, flight: Flight, replica: ReplicaLoad) -> None:
        link = self.links.get(replica.replica_id)
        if link is None or link.closed:
            link = self._connect(replica)
        flight.replica_id = replica.replica_id
        self.router.on_dispatch(replica.replica_id, flight.need_tokens)
        self.counts["dispatched"] += 1
        flight.replica_rid = link.dispatch(flight, flight.req.replica_message())

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
        if flight.ttft_s is None:
            flight.ttft_s = now
        if kind == "tokens":
            flight.sink.tokens(message)
            return
        del link.in_flight[flight.replica_rid]
        flight.over = True
        self.router.on_complete(link.replica_id, flight.need_tokens)
        self._settle_path(flight)
        ttft_ms = (flight.ttft_s - flight.arrival_s) * 1000.0
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
        self.telemetry.event(flight.req.request_id, flight.model, flight.path, code,
                             flight.queue_wait_ms, flight.restore_ms,
                             ttft_ms if code == 200 else None, now > flight.deadline_s)
        if self.queues.get(flight.model):
            self._drain(flight.model)

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
              retry_after_ms: int | None = None) -> None:
        """Answer ``flight`` with an error (its final answer) and record it."""
        if flight.over:
            return
        flight.over = True
        flight.pending = None
        self.counts["errors"] += 1
        flight.sink.error(code, reason, retry_after_ms)
        self.telemetry.event(flight.req.request_id, flight.model, path, code, 0.0, None, None,
                             code == 504)

    # --- queues and restores ---------------------------------------------------------

    def _drain(self, model: str) -> None:
        """Dispatch queued requests earliest deadline first while a replica fits."""
        queue = self.queues[model]
        now = self.clock.now()
        restored = self.last_restore.get(model)
        while queue:
            head = queue.peek()
            flight: Flight = head.payload
            replica = self.router.choose(model, head.need_tokens)
            if replica is None:
                break
            queue.pop_earliest()
            flight.pending = None
            flight.queue_wait_ms = (now - flight.arrival_s) * 1000.0
            if restored is not None and restored[0] >= flight.arrival_s:
                flight.path, flight.restore_ms = restored[1], restored[2]
            self._dispatch(flight, replica)
        self.telemetry.queue_depth(model, len(queue))

    def _maybe_restore(self, model: str) -> None:
        if self.capacity is None or self.clock.now() < self._capped_until.get(model, 0.0):
            return
        for _ in range(self.gate.wanted(model, len(self.queues[model]))):
            self.gate.started(model)
            asyncio.get_running_loop().create_task(self._restore(model))
        self.telemetry.restores_in_flight(self.gate.total)

    async def _restore(self, model: str) -> None:
        ok = False
        started = self.clock.now()
        try:
            result = await self.capacity.request_restore(model)
            ok = True
            now = self.clock.now()
            self.last_restore[model] = (now, result.path, result.restore_ms)
            self._restore_measured(model, result.restore_ms or (now - started) * 1000.0)
            if result.replica is not None:
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
        finally:
            self.gate.finished(model)
            self.telemetry.restores_in_flight(self.gate.total)
        queue = self.queues.get(model)
        if not queue:
            return
        self._drain(model)
        if ok:
            if queue and result.path == "warm_hit":
                # The node is at its replica cap and answered with a replica it already had:
                # asking again at once would spin; queued requests go as it frees slots.
                backoff_s = self.config.at_capacity_backoff_s
                self._capped_until[model] = self.clock.now() + backoff_s
                asyncio.get_running_loop().call_later(backoff_s, self._maybe_restore, model)
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

    def _restore_measured(self, model: str, restore_ms: float) -> None:
        self.restore_times.record(model, restore_ms)
        if model not in self.config.models:
            self._deadline_ms[model] = max(
                self.config.default_deadline_ms,
                self.config.deadline_per_restore_p99 * self.restore_times.p99_ms(model))

    def expire_queued(self) -> None:
        """Answer queued requests past their deadline (504) or wait bound (429)."""
        now = self.clock.now()
        for model in list(self.queued_models):
            queue = self.queues[model]
            for p in queue.expire():
                if p.deadline_s <= now:
                    self._fail(p.payload, 504, f"deadline passed after "
                               f"{(now - p.arrival_s) * 1000:.0f} ms queued for model {model!r}")
                else:
                    self._fail(p.payload, 429, f"waited max_wait_s({queue.max_wait_s}) for "
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
        if link is not None:
            ours = link.in_flight.values()
            load.active_seqs = max(load.active_seqs, len(link.in_flight))
            load.kv_used_tokens = max(load.kv_used_tokens, sum(f.need_tokens for f in ours))
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
