"""The discrete-event loop: requests through the production admission queue and router.

One virtual clock (:class:`agent.clock.ManualClock`) is shared by the simulation, the
production :class:`~agent.frontdoor.admission.AdmissionQueue`, the production
:class:`~agent.frontdoor.router.Router` and whatever controller sizes the fleet (the production
:class:`~agent.predictor.loop.Predictor` for rewarm's policy).  Nothing sleeps; the loop sets
the clock to the next event and hands control to the same methods production calls.

Events, in time order (ties: completions and READYs, then the tick, then arrivals):

- arrival ``i`` (read from the workload's arrays, never a heap entry): a request whose KV
  need exceeds one replica's capacity is shed at once (429: no replica can ever hold it);
  if nothing waits and ``Router.choose`` finds a replica with room, dispatch; else
  ``AdmissionQueue.offer`` (``Overloaded`` = shed, 429).
- completion (heap): ``Router.on_complete``, then drain the queue earliest deadline first.
  With replicas at a measured speed (``Fleet.engines``, agent/sim/replica.py) a dispatch
  queues the request at its replica and the replica's steps are heap events instead: the
  first token is timed by the step that prefills it, completions come at step ends.
- READY (heap): a replica finished starting (:meth:`Fleet.on_ready`), then drain.
- tick every ``tick_s``: ``AdmissionQueue.expire`` (504), the controller's ``tick`` (the
  predictor observes the second's arrivals and calls ``Fleet.set_target``), a sample of the
  time series.

Per request the loop does O(log n) heap work and keeps results in preallocated numpy arrays;
the only per-request objects are the ``Pending`` records the admission queue itself needs.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from agent.clock import ManualClock
from agent.errors import ConfigError, Overloaded
from agent.frontdoor.admission import AdmissionQueue, Pending
from agent.frontdoor.router import Router
from agent.sim.fleet import BOOTING, READY, Fleet, WARM
from agent.sim.trace import Workload

COMPLETE = 0
STEP = 2    # a SimReplica's step ended (after fleet.READY = 1)
# request status codes in RunRecord.status
WAITING, SERVED, SHED, EXPIRED = 0, 1, 2, 3
PATH_WARM, PATH_QUEUED = 0, 1


class Controller(Protocol):
    """Sizes the fleet once per tick (a baseline policy or the production predictor)."""

    def tick(self, now_s: float, arrivals: int, sim: Simulation) -> None:
        ...


@dataclass
class RunRecord:
    """What one run produced.  Arrays are per request ``[N]`` or per tick ``[T]``."""

    status: np.ndarray            # int8 [N]: SERVED, SHED, EXPIRED (WAITING if still queued)
    ttft_s: np.ndarray            # float64 [N]: NaN unless served
    path: np.ndarray              # int8 [N]: PATH_WARM (dispatched on arrival) or PATH_QUEUED
    queued: int                   # requests that entered the admission queue
    tick_t_s: np.ndarray          # float64 [T]
    warm_replicas: np.ndarray     # int32 [T]
    billed_replicas: np.ndarray   # int32 [T]
    queue_depth: np.ndarray       # int32 [T]
    gpu_s: float
    suspended_s: float
    busy_slot_s: float            # sum of occupancy of served requests
    sim_s: float                  # simulated seconds (start to end of the run)
    wall_s: float = 0.0
    starts_by_tier: dict = field(default_factory=dict)
    too_large: int = 0                # of SHED: KV need beyond one replica's capacity
    slo_s: np.ndarray | None = None   # float64 [N]: each request's TTFT SLO (with ``slo``)
    cold: np.ndarray | None = None    # bool [N]: no warm replica could take it on arrival


class Simulation:
    """Replays ``workload`` through ``queue`` and ``router`` onto ``fleet`` under ``controller``.

    ``max_wait_s`` sets each request's deadline (arrival + max_wait_s): the admission queue
    answers 504 past it.  With ``slo`` (an :class:`agent.slo.TtftSlo`) each request instead
    gets its own SLO (``base + prefill``, the restore base when no warm replica could take
    it on arrival) and a deadline from it; it must start by ``deadline - prefill``.  ``end_s``
    defaults to the last arrival plus the longest occupancy.  ``restore_on_cold``: a request
    that finds no replica warm or starting asks the fleet for one at once, as the front door
    asks its scaler for capacity (agent/frontdoor/restores.py), instead of waiting for the
    controller's next tick.
    """

    def __init__(self, workload: Workload, *, clock: ManualClock, queue: AdmissionQueue,
                 router: Router, fleet: Fleet, controller: Controller, model: str,
                 max_wait_s: float, tick_s: float = 1.0, end_s: float | None = None,
                 slo=None, restore_on_cold: bool = False) -> None:
        self.w = workload
        self.clock = clock
        self.queue = queue
        self.router = router
        self.fleet = fleet
        self.controller = controller
        self.model = model
        self.max_wait_s = max_wait_s
        self.tick_s = tick_s
        n = len(workload)
        last = float(workload.arrival_s[-1] + workload.occupancy_s.max()) if n else 0.0
        self.end_s = last if end_s is None else end_s
        self.heap: list = []
        self._seq = 0
        self.in_flight = 0
        self._head: Pending | None = None  # popped earliest-deadline request awaiting a slot
        self.status = np.zeros(n, dtype=np.int8)
        self.ttft_s = np.full(n, np.nan)
        self.path = np.zeros(n, dtype=np.int8)
        self.queued = 0
        self.busy_slot_s = 0.0
        self.slo = slo
        self.too_large = 0   # refused on arrival: KV need beyond one replica's capacity
        self.restore_on_cold = restore_on_cold
        self.slo_s = np.full(n, np.nan) if slo is not None else None
        self.cold = np.zeros(n, dtype=bool) if slo is not None else None
        self.engines = fleet.engines if fleet.cfg.replica is not None else None
        if self.engines is not None and (workload.prompt_tokens is None
                                         or workload.output_tokens is None):
            raise ConfigError("replicas at a measured speed need the workload's prompt and "
                              "output tokens (a trace's); this workload has none",
                              name="workload", value="no tokens", limit="prompt_tokens")
        self._dispatched_s = np.zeros(n) if self.engines is not None else None
        # prompt tokens per request for the router's prefill-queue accounting (profile mode)
        self._prompt: list[int] | None = None
        if self.engines is not None and workload.prompt_tokens is not None:
            self._prompt = workload.prompt_tokens.tolist()

    def schedule(self, t_s: float, kind: int, a: int, b: int) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t_s, self._seq, kind, a, b))

    @property
    def waiting(self) -> int:
        return len(self.queue) + (self._head is not None)

    # --- dispatch ------------------------------------------------------------------------
    def _choose(self, i: int, need_tokens: int):
        if self._prompt is None:
            return self.router.choose(self.model, need_tokens)
        return self.router.choose(self.model, need_tokens, self._prompt[i])

    def _dispatch(self, load, i: int, now: float) -> None:
        need = int(self.w.need_tokens[i])
        if self._prompt is None:
            self.router.on_dispatch(load.replica_id, need)
        else:
            self.router.on_dispatch(load.replica_id, need, self._prompt[i])
        r = self.fleet.index[load.replica_id]
        self.fleet.busy[r] += 1
        self.in_flight += 1
        self.status[i] = SERVED
        if self.engines is not None:
            eng = self.engines[r]
            prompt, output, dispatched = self._profiled()
            eng.submit(i, prompt[i], int(output[i]))
            dispatched[i] = now
            if not eng.stepping:
                self._start_step(r, now)
            return
        occ = float(self.w.occupancy_s[i])
        self.busy_slot_s += occ
        self.ttft_s[i] = now - float(self.w.arrival_s[i]) + float(self.w.prefill_s[i])
        self._seq += 1
        heapq.heappush(self.heap, (now + occ, self._seq, COMPLETE, r, i))

    def _profiled(self) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Prompt and output tokens and dispatch times per request (profile mode only)."""
        prompt, output, dispatched = self._prompt, self.w.output_tokens, self._dispatched_s
        assert prompt is not None and output is not None and dispatched is not None, \
            "replicas at a measured speed (checked in __init__)"
        return prompt, output, dispatched

    def _start_step(self, r: int, now: float) -> None:
        assert self.engines is not None, "profile mode only"
        eng = self.engines[r]
        prompt = self._profiled()[0]
        firsts, end_s = eng.start_step(now)
        arrival = self.w.arrival_s
        warm = self.fleet.state[r] == WARM
        for req, t in firsts:
            self.ttft_s[req] = t - float(arrival[req])
            if warm:   # the front door sees the first token (at its time; accounting only)
                self.router.on_first_token(self.fleet.ids[r], prompt[req])
        self.schedule(end_s, STEP, r, eng.generation)

    def _step_end(self, r: int, generation: int, t: float) -> None:
        assert self.engines is not None, "profile mode only"
        eng = self.engines[r]
        prompt, _, dispatched = self._profiled()
        if generation != eng.generation or not eng.stepping:
            return
        fleet, need = self.fleet, self.w.need_tokens
        for req in eng.end_step():
            self.in_flight -= 1
            self.busy_slot_s += t - float(dispatched[req])
            if fleet.state[r] == WARM:
                self.router.on_complete(fleet.ids[r], int(need[req]), prompt[req])
            fleet.on_complete(r)
        if eng.busy:
            self._start_step(r, t)
        self._drain(t)

    def _expire(self) -> None:
        for p in self.queue.expire():
            self.status[p.request_id] = EXPIRED
        h = self._head
        if h is not None and h.give_up_s <= self.clock.now():
            self.status[h.request_id] = EXPIRED
            self._head = None

    def _drain(self, now: float) -> None:
        """Dispatch waiting requests, earliest deadline first, while replicas have room."""
        if self._head is None and not len(self.queue):
            return
        self._expire()
        while True:
            p = self._head if self._head is not None else self.queue.pop_earliest()
            if p is None:
                return
            load = self._choose(p.request_id, p.need_tokens)
            if load is None:
                self._head = p
                return
            self._head = None
            self.path[p.request_id] = PATH_QUEUED
            self._dispatch(load, p.request_id, now)

    def _judge(self, i: int, t_arr: float, cold: bool) -> float:
        """Request ``i``'s SLO and deadline (``self.slo``); returns the latest start time.
        ``cold``: no warm replica could take it on arrival, so it is served by a replica
        that starts (a restore) or frees up, within the restore budget."""
        assert self.slo is not None and self.cold is not None and self.slo_s is not None
        prefill = float(self.w.prefill_s[i])
        self.cold[i] = cold
        self.slo_s[i] = self.slo.slo_s(prefill, cold)
        return t_arr + self.slo.deadline_s(prefill, cold) - prefill

    def _ask_on_cold(self) -> None:
        fleet = self.fleet
        if fleet.count[WARM] == 0 and fleet.count[BOOTING] == 0 and fleet.pending_starts == 0:
            fleet.set_target(self.model, max(1, fleet.target(self.model)),
                             reason="front door: request with no replica warm or starting")

    # --- the loop ------------------------------------------------------------------------
    def run(self, progress: bool = False) -> RunRecord:
        import time

        wall0 = time.perf_counter()
        w, clock, heap = self.w, self.clock, self.heap
        arrival = w.arrival_s.tolist()
        need = w.need_tokens.tolist()
        n = len(arrival)
        t0 = clock.now()
        self.fleet._schedule = self.schedule
        choose, queue, model, router = self.router.choose, self.queue, self.model, self.router
        fleet = self.fleet
        prompt = self._prompt
        kv_limit = fleet.cfg.kv_capacity_tokens
        ticks_t, warm_s, billed_s, depth_s = [], [], [], []
        next_tick = t0
        arrivals_in_tick = 0
        i = 0
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=int(math.ceil(self.end_s - t0)), unit="sim-s", leave=False,
                       mininterval=2.0)
        inf = math.inf
        while True:
            t_arr = arrival[i] + t0 if i < n else inf
            t_ev = heap[0][0] if heap else inf
            if t_ev <= next_tick and t_ev <= t_arr:
                if t_ev > self.end_s:
                    break
                t, _, kind, a, b = heapq.heappop(heap)
                clock.set(t)
                if kind == COMPLETE:
                    self.in_flight -= 1
                    if fleet.state[a] == WARM:
                        router.on_complete(fleet.ids[a], need[b])
                    fleet.on_complete(a)
                    self._drain(t)
                elif kind == READY:
                    if fleet.on_ready(a, b):
                        self._drain(t)
                elif kind == STEP:
                    self._step_end(a, b, t)
            elif next_tick <= t_arr:
                if next_tick > self.end_s:
                    break
                clock.set(next_tick)
                self._expire()
                self.controller.tick(next_tick, arrivals_in_tick, self)
                if self.engines is not None:
                    fleet.report_loads()     # the replicas' load reports, once a tick
                self._drain(next_tick)
                arrivals_in_tick = 0
                ticks_t.append(next_tick - t0)
                warm_s.append(fleet.count[WARM])
                billed_s.append(fleet.billed)
                depth_s.append(self.waiting)
                next_tick += self.tick_s
                if bar is not None:
                    bar.update(int(self.tick_s))
            else:
                clock.set(t_arr)
                arrivals_in_tick += 1
                load = None
                if self._head is None and not len(queue):
                    load = choose(model, need[i]) if prompt is None \
                        else choose(model, need[i], prompt[i])
                give_up = t_arr + self.max_wait_s
                if self.slo is not None:
                    give_up = self._judge(i, t_arr, load is None)
                if need[i] > kv_limit:
                    # no replica of this model can ever hold it: refused at once (429 with
                    # its reason), never left to block the queue's head until it expires
                    self.status[i] = SHED
                    self.too_large += 1
                elif load is not None:
                    self._dispatch(load, i, t_arr)
                else:
                    self.queued += 1
                    self.path[i] = PATH_QUEUED
                    if self.restore_on_cold:
                        self._ask_on_cold()
                    try:
                        queue.offer(Pending(i, model, t_arr, give_up, need[i]))
                    except Overloaded:
                        self.status[i] = SHED
                i += 1
        if bar is not None:
            bar.close()
        if clock.now() < self.end_s:
            clock.set(self.end_s)
        fleet.finish()
        return RunRecord(self.status, self.ttft_s, self.path, self.queued,
                         np.asarray(ticks_t), np.asarray(warm_s, dtype=np.int32),
                         np.asarray(billed_s, dtype=np.int32), np.asarray(depth_s, dtype=np.int32),
                         fleet.gpu_s, fleet.suspended_s, self.busy_slot_s,
                         clock.now() - t0, time.perf_counter() - wall0, dict(fleet.starts_by_tier),
                         self.too_large, self.slo_s, self.cold)
