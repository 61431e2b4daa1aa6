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
:class:`~agent.frontdoor.admission.AdmissionQueue`.  :class:`RequestPath` keeps the way in
(:meth:`RequestPath.submit`), the answers (:meth:`RequestPath.on_answer`) and the wiring of
its collaborators, each over the per-model :class:`~agent.frontdoor.model_state.ModelState`
and a small Protocol for what it calls back:

| collaborator | module | job |
|---|---|---|
| :class:`~agent.frontdoor.budgets.Budgets` | budgets.py | time budgets, one replica's size |
| :class:`~agent.frontdoor.replica_view.ReplicaView` | replica_view.py | the router's loads, replicas' arrival |
| :class:`~agent.frontdoor.restores.Restores` | restores.py | restores asked for and their end |
| :class:`~agent.frontdoor.planner.QueuePlanner` | planner.py | slots and each request's place |
| :class:`~agent.frontdoor.queues.Queues` | queues.py | hold, drain, re-check, expire |
| :class:`~agent.frontdoor.dispatch.Dispatcher` | dispatch.py | links, sending, first tokens |
| :class:`~agent.frontdoor.reroute.Reroute` | reroute.py | a request a replica did not start |
| :class:`~agent.frontdoor.first_token.FirstTokenWatch` | first_token.py | a replica silent after a dispatch |
| :class:`~agent.frontdoor.answers.Answers` | answers.py | final answers and their records |

The registry is read off the request path (a watcher thread) into the router's view.
"""

from __future__ import annotations

import logging
from typing import Any

from agent.clock import Clock
from agent.cluster.base import ServiceInstance
from agent.frontdoor.admission import AdmissionQueue
from agent.frontdoor.answers import Answers
from agent.frontdoor.budgets import Budgets
from agent.frontdoor.capacity import CapacityRequester, RestoreGate, RestoreTimes
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.dispatch import Dispatcher
from agent.frontdoor.first_token import FirstTokenWatch
from agent.frontdoor.links import Connector, ReplicaLink, open_socket
from agent.frontdoor.model_state import ModelStates
from agent.frontdoor.path_info import info_answer
from agent.frontdoor.planner import QueuePlanner
from agent.frontdoor.queues import Queues
from agent.frontdoor.replica_view import ReplicaView
from agent.frontdoor.request import SAMPLING_FIELDS, Flight, GenerateRequest, Sink
from agent.frontdoor.reroute import Reroute
from agent.frontdoor.restores import Restores
from agent.frontdoor.router import ReplicaLoad, Router
from agent.telemetry import Telemetry
from agent.wire import refusals

__all__ = ["RequestPath", "GenerateRequest", "Sink", "Flight", "SAMPLING_FIELDS"]

log = logging.getLogger(__name__)

SHAPE_GAIN = 0.05  # EWMA gain of the per-model mean prompt and max_tokens (~20 requests)


class RequestPath:
    """Owns the router, the per-model states, the replica links and the collaborators that
    work on them (module docstring); :meth:`submit` is the one way in."""

    def __init__(self, config: FrontDoorConfig, *, clock: Clock, telemetry: Telemetry,
                 capacity: CapacityRequester | None = None,
                 connector: Connector = open_socket) -> None:
        self.config = config
        self.clock = clock
        self._telemetry = telemetry
        self.router = Router(config.prior_speed)
        self.gate = RestoreGate(per_model=config.restores_per_model,
                                overall=config.restores_overall)
        self.restore_times = RestoreTimes()
        self.models = ModelStates(dict(config.models), config.default_deadline_ms)
        self.links: dict[str, ReplicaLink] = {}
        self.known_models: set[str] = set(config.models)
        self.counts = {"requests": 0, "dispatched": 0, "done": 0, "errors": 0, "cancelled": 0,
                       "shed_429": 0, "expired_504": 0, "late_first_token": 0,
                       "replica_429": 0, "rerouted": 0, "silent_replica": 0,
                       "deadline_after_dispatch": 0}
        self.stopping = False
        self._drain_until_s: float | None = None
        self.budgets = Budgets(config, clock, self.router, self.restore_times, self.models)
        suspects: dict[str, float] = {}   # replicas silent after a dispatch (first_token.py)
        self.replicas = ReplicaView(self.router, clock, self.models, self.links,
                                    self.known_models, config.registry_poll_s, suspects)
        self.restores = Restores(config, clock, telemetry, self.router, self.gate, self.models,
                                 capacity, sizing=self.budgets, replicas=self.replicas,
                                 owner=self)
        self.planner = QueuePlanner(config, clock, self.router, self.links, self.gate,
                                    self.restore_times, self.models, sizing=self.budgets,
                                    arrivals=self.replicas, capacity=self.restores)
        self.restores.needed = self.planner.restores_needed
        self.admission = Queues(config, clock, telemetry, self.router, self.models, self.counts,
                                self.restore_times, self.planner, self.restores, owner=self,
                                budgets=self.budgets, gate=self.gate)
        self.watch = FirstTokenWatch(clock, self.router, self.models, self.links, self.counts,
                                     self.planner, owner=self, suspects=suspects,
                                     probe_every_s=config.registry_poll_s, slo_s=config.slo_s,
                                     back=self.replicas.upsert,
                                     log_interval_s=config.accept_log_interval_s)
        self.dispatcher = Dispatcher(config, clock, self.router, self.links, self.counts,
                                     self.planner, self.replicas, connector, link_owner=self,
                                     watch=self.watch)
        self.answers = Answers(telemetry, self.models, self.counts, self.dispatcher,
                               self.admission, self.router, self.links)
        self.reroute = Reroute(clock, self.router, self.links, self.counts, self.models,
                               self.planner, self.budgets, self.restores, owner=self)

    # --- wiring: what entrances, the server and the collaborators reach -------------------

    @property
    def capacity(self) -> CapacityRequester | None:
        """The capacity requester (None: restores are never asked for)."""
        return self.restores.capacity

    @capacity.setter
    def capacity(self, value: CapacityRequester | None) -> None:
        self.restores.capacity = value

    @property
    def telemetry(self) -> Telemetry:
        return self._telemetry

    @telemetry.setter
    def telemetry(self, value: Telemetry) -> None:
        self._telemetry = self.restores.telemetry = self.admission.telemetry = \
            self.answers.telemetry = value

    @property
    def queues(self) -> dict[str, AdmissionQueue]:
        """Every admission queue made so far, by model (a new dict each call)."""
        return self.models.queues()

    @property
    def queued_models(self) -> set[str]:
        """Models whose queue may hold requests (the ticker's cue to expire them)."""
        return self.admission.queued_models

    def hold(self, flight: Flight, warm_pred_s: float | None) -> None:
        self.admission.hold(flight, warm_pred_s)

    def drain(self, model: str) -> None:
        self.admission.drain(model)

    def recheck(self, model: str) -> None:
        self.admission.recheck(model)

    def refuse_queued(self, model: str, reason: str, refusal: str) -> None:
        self.admission.refuse_queued(model, reason, refusal)

    def expire_queued(self) -> None:
        """Answer queued requests past their deadline or wait bound
        (:meth:`agent.frontdoor.queues.Queues.expire_queued`), and end the waits of
        dispatched ones whose replica gave no first token in time
        (:meth:`agent.frontdoor.first_token.FirstTokenWatch.check`)."""
        self.admission.expire_queued()
        if self.watch.watching:
            self.watch.check(self.clock.now())

    @property
    def watching(self) -> bool:
        """Whether dispatched requests or silent replicas need :meth:`expire_queued` ticks."""
        return self.watch.watching

    def upsert(self, load: ReplicaLoad) -> None:
        """A replica's reported load into the view (:meth:`ReplicaView.upsert`)."""
        self.replicas.upsert(load)

    def apply_replicas(self, instances: list[ServiceInstance]) -> None:
        """The registry's passing replicas become the view (:meth:`ReplicaView.apply`);
        queued requests then go where they now can."""
        self.replicas.apply(instances)
        self.admission.drain_all()

    def dispatch(self, flight: Flight, replica: ReplicaLoad, predicted_s: float,
                 now: float | None = None) -> None:
        """Send ``flight`` to ``replica`` (:meth:`Dispatcher.dispatch`)."""
        self.dispatcher.dispatch(flight, replica, predicted_s, now)

    def replica_failed(self, link: ReplicaLink, reason: str, retry: bool = True,
                       refusal: str = refusals.REPLICA_FAILED) -> None:
        """The link broke (:meth:`agent.frontdoor.reroute.Reroute.replica_failed`)."""
        self.watch.forget(link.replica_id)
        self.reroute.replica_failed(link, reason, retry, refusal)

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
            self.fail(flight, 503, "front door shutting down (draining): not taking new "
                      "requests; another front door takes them",
                      retry_after_ms=max(1, round(max(left_s, 1.0) * 1000)),
                      refusal=refusals.DRAINING)
            return flight
        if model not in self.known_models:  # (not counted by model: names are the client's)
            served = sorted(self.known_models)
            listed = ", ".join(repr(m) for m in served[:8]) + (", ..." if len(served) > 8 else "")
            self.fail(flight, 404, f"unknown model {model!r}; this front door serves "
                      f"{listed or 'no model yet'} (GET /v1/models lists them)",
                      refusal=refusals.UNKNOWN_MODEL)
            return flight
        state = self.models.of(model)
        state.arrivals += 1
        prompt = flight.prompt_tokens = req.prompt_tokens
        need = prompt + req.max_tokens  # KV need
        wire = req.wire
        if wire is not None and wire.get("fit_context") is True:
            # the replica fits max_tokens to what its context leaves after the prompt
            # (agent/replica/worker.py): it needs at most the largest replica's KV, not the
            # context-sized bound plus the prompt (a one-slot replica's context is its KV)
            most = max((r.kv_capacity_tokens for r in self.router.warm(model)), default=0) \
                or state.max_kv_tokens
            if most and need > most:
                need = max(prompt + 1, most)
        flight.need_tokens = need
        shape = state.shape
        if shape is None:
            state.shape = [float(prompt), float(req.max_tokens)]
        else:
            shape[0] += (prompt - shape[0]) * SHAPE_GAIN
            shape[1] += (req.max_tokens - shape[1]) * SHAPE_GAIN
        warm_s, restore_s = self.budgets.budgets_s(model, req.deadline_ms, prompt)
        flight.deadline_s = flight.warm_deadline_s = now + warm_s
        warm_slo_s, restore_slo_s = self.budgets.slos_s(model, prompt)
        flight.slo_s = now + warm_slo_s
        queue = state.queue
        found = None
        if not queue:
            found = self.router.choose_predicted(model, need, prompt)
            # direct only when on time; a late one is the admission queue's to judge
            if found is not None and found[1] <= min(warm_s, warm_slo_s):
                self.dispatcher.dispatch(flight, found[0], found[1], now)
                return flight
        warm = self.router.warm(model)
        # the largest replica now, or the largest seen (none warm: a restore brings up the
        # same replicas, so a request that no replica of the model can hold is 413, not 429)
        largest = max((r.kv_capacity_tokens for r in warm), default=0) or \
            state.max_kv_tokens
        if largest and need > largest:
            self.fail(flight, 413, f"request needs {need} KV tokens; the largest replica of "
                      f"{model!r} holds {largest}", refusal=refusals.TOO_LARGE)
            return flight
        # no wait, no replica can make it: said now, not at the deadline
        prefill_s = self.budgets.prefill_s(model, prompt)
        if prefill_s > max(warm_s, restore_s):
            self.counts["shed_429"] += 1
            self.fail(flight, 429, f"model {model!r}: the prompt's {prompt} tokens alone take "
                      f"{prefill_s * 1000:.0f} ms to prefill at its replicas' measured speed, "
                      f"past the request's deadline of {max(warm_s, restore_s) * 1000:.0f} ms",
                      refusal=refusals.DEADLINE_UNREACHABLE)
            return flight
        if not warm:   # (after the 413: one no replica can hold says nothing of keep-alive)
            flight.cold = True
            state.cold_arrivals += 1
        if self.capacity is None and not warm:
            self.fail(flight, 503, f"model {model!r}: no warm replica and no capacity "
                      f"requester configured", refusal=refusals.NO_CAPACITY)
            return flight
        flight.deadline_s = now + restore_s
        flight.slo_s = now + restore_slo_s
        self.admission.hold(flight, found[1] if found is not None else None)
        return flight

    def cancel(self, flight: Flight) -> None:
        """Forget ``flight``: its client is gone (:meth:`Answers.cancelled
        <agent.frontdoor.answers.Answers.cancelled>`)."""
        self.answers.cancelled(flight)

    def refused(self, request_id: Any, model: str, code: int) -> None:
        """Count a request an entrance refused itself (400, 401) before :meth:`submit`."""
        self.counts["errors"] += 1
        self.telemetry.event(request_id, model, "refused", code, 0.0, None, None, False)

    # --- answers ------------------------------------------------------------------------

    def on_answer(self, link: ReplicaLink, flight: Flight, message: dict) -> None:
        """A message from a replica for ``flight``: tokens to the flight's sink; a 429 or 503
        before any token placed again (reroute.py); else its final answer (answers.py)."""
        kind = message.get("type")
        now = link.heard_s = self.clock.now()   # alive (first_token.py reads it)
        if kind == "tokens":
            if flight.ttft_s is None:
                self.dispatcher.first_token(flight, now)
            else:   # for inter-token latency: (seconds since the last message, tokens in it)
                flight.token_gaps.append((now - flight.last_token_s,
                                          len(message.get("tokens") or ()) or 1))
            flight.last_token_s = now
            flight.sink.tokens(message)
            return
        del link.in_flight[flight.replica_rid]
        had_first = flight.ttft_s is not None
        self.router.on_complete(link.replica_id, flight.need_tokens, flight.prompt_tokens,
                                had_first)
        if kind != "done" and not had_first and message.get("code") in (429, 503):
            if message.get("code") == 429:
                self.reroute.replica_refused(link, flight, message)
            else:
                self.reroute.replica_leaving(link, flight, message)
            return
        if not had_first and kind == "done":
            self.dispatcher.first_token(flight, now)
        self.answers.final(link, flight, message, now)

    def replica_answered(self, link: ReplicaLink, message: dict) -> None:
        """The replica answered a probe: alive (a request kept waiting there waits on to its
        deadline), and a silent one may be back in routing (first_token.py)."""
        link.heard_s = self.clock.now()
        self.watch.answered(link.replica_id, message)

    def fail(self, flight: Flight, code: int, reason: str, path: str = "refused",
             retry_after_ms: int | None = None, predicted_ttft_ms: float | None = None,
             refusal: str | None = None) -> None:
        """Answer ``flight`` with an error (:meth:`agent.frontdoor.answers.Answers.fail`)."""
        self.answers.fail(flight, code, reason, path, retry_after_ms, predicted_ttft_ms, refusal)

    def begin_stop(self, drain_until_s: float | None = None) -> None:
        """Drain: take no new requests (503 with ``retry_after_ms`` until ``drain_until_s``,
        when this front door is gone); answer every queued one 503 (never sent to a replica)."""
        self.stopping = True
        self._drain_until_s = drain_until_s
        for model in self.models.queues():
            self.admission.refuse_queued(model, f"front door shutting down: request for model "
                                                f"{model!r} was queued and never sent to a replica",
                                         refusals.DRAINING)
        self.admission.queued_models.clear()

    def tick_logs(self, final: bool = False) -> None:
        """Summarise rate-limited log lines whose interval is over (all, when ``final``)."""
        self.dispatcher.tick_log(final)
        self.admission.tick_log(final)
        self.watch.tick_log(final)

    def dispatched(self) -> int:
        """Requests at replicas, not yet answered."""
        return self.dispatcher.dispatched()

    def fail_dispatched(self, reason: str) -> None:
        """Answer every request still at a replica 503 with ``reason`` and close the links."""
        for link in list(self.links.values()):
            self.reroute.replica_failed(link, reason.format(replica=link.replica_id), retry=False,
                                        refusal=refusals.DRAINING)

    def info(self, op: str, connections: int = 0) -> dict:
        """The answer to ``health``, ``models`` or ``stats`` (docs/protocol.md;
        :func:`agent.frontdoor.path_info.info_answer`)."""
        return info_answer(op, connections, counts=self.counts, known_models=self.known_models,
                           models=self.models, router=self.router,
                           restores_in_flight=self.gate.total)
