"""A virtual-time harness for the request path: replicas that answer at their speed on a
:class:`~agent.clock.ManualClock`, restores that take a known time, and sinks that record
when each answer came.  Nothing sleeps; the event loop only runs the path's restore tasks.

:class:`SimReplica` stands in for a :class:`~agent.frontdoor.links.ReplicaLink`: at dispatch
it computes its TTFT from its own queue with the same :class:`~agent.speed.SpeedProfile`
(the "predictions are right" case), refuses with 429 a request whose ``deadline_ms`` it
predicts it cannot meet (docs/architecture.md, "The replica's refusal"), and schedules the first token and the ``done``
(after ``max_tokens`` decode steps at its batch).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

from agent.clock import ManualClock
from agent.frontdoor.capacity import RestoreResult
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.request_path import GenerateRequest, RequestPath
from agent.frontdoor.router import ReplicaLoad
from agent.speed import SpeedProfile
from agent.telemetry import Telemetry

FAST = SpeedProfile(prefill_tokens_per_s=4000.0, prefill_overhead_s=0.005,
                    decode_base_s=0.02, decode_per_seq_s=0.002, decode_per_ctx_token_s=1e-6)
SLOW = SpeedProfile(prefill_tokens_per_s=400.0, prefill_overhead_s=0.02,
                    decode_base_s=0.08, decode_per_seq_s=0.01, decode_per_ctx_token_s=1e-5)


def capacity_rps(speed: SpeedProfile, prompt: tuple[int, int], gen: tuple[int, int],
                 seqs: int, slo_s: float = 2.0) -> float:
    """One replica's request rate at ``speed``, at its sustainable concurrency within the
    warm SLO, for prompts and outputs drawn uniformly from ``prompt`` and ``gen`` (tokens)."""
    p, g = sum(prompt) / 2.0, sum(gen) / 2.0
    return speed.service_rps(p, g, speed.sustainable_concurrency(slo_s, p, g, seqs))


class Sink:
    """Records a request's answers and the clock time of its final one."""

    def __init__(self, clock: ManualClock, arrival_s: float) -> None:
        self.clock, self.arrival_s = clock, arrival_s
        self.first_s: float | None = None
        self.final: dict | None = None
        self.at_s: float | None = None

    def tokens(self, message: dict) -> None:
        if self.first_s is None:
            self.first_s = self.clock.now()

    def done(self, message: dict) -> None:
        if self.first_s is None:
            self.first_s = self.clock.now()
        self.final, self.at_s = {"type": "done", **message}, self.clock.now()

    def error(self, code: int, reason: str, retry_after_ms: int | None = None,
              refusal: str | None = None) -> None:
        self.final = {"type": "error", "code": code, "reason": reason,
                      "retry_after_ms": retry_after_ms, "refusal": refusal}
        self.at_s = self.clock.now()

    @property
    def code(self) -> int | None:
        return None if self.final is None else (200 if self.final["type"] == "done"
                                                else self.final["code"])


class Timeline:
    """Events on the manual clock; :meth:`run_until` moves time and runs them in order,
    with the path's ticker every ``tick_s`` and the loop's restore tasks in between."""

    def __init__(self, clock: ManualClock, path: RequestPath, tick_s: float = 0.005) -> None:
        self.clock, self.path, self.tick_s = clock, path, tick_s
        self._heap: list = []
        self._seq = itertools.count()
        self._next_tick = clock.now()

    def at(self, t_s: float, fn) -> None:
        heapq.heappush(self._heap, (t_s, next(self._seq), fn))

    async def run_until(self, end_s: float) -> None:
        while True:
            t_event = self._heap[0][0] if self._heap else float("inf")
            t = min(t_event, self._next_tick)
            if t > end_s:
                break
            self.clock.set(max(t, self.clock.now()))
            if t == self._next_tick:
                self._next_tick += self.tick_s
                self.path.expire_queued()
            else:
                heapq.heappop(self._heap)[2]()
            for _ in range(4):             # let restore tasks see resolved futures
                await asyncio.sleep(0)
        self.clock.set(max(end_s, self.clock.now()))


class SimReplica:
    """A replica link in virtual time (module docstring)."""

    def __init__(self, path: RequestPath, timeline: Timeline, replica_id: str, model: str,
                 speed: SpeedProfile | None, max_seqs: int = 8, kv_tokens: int = 1 << 16,
                 report_speed: bool = True, actual: SpeedProfile | None = None,
                 self_aware: bool = True) -> None:
        # ``speed``: what it reports; ``actual``: how fast it really is (default: the same);
        # ``self_aware``: whether its own 429 check knows ``actual`` (else it predicts with
        # ``speed`` too, as a replica whose meter has not caught up)
        self.path, self.timeline = path, timeline
        self.speed = actual or speed or SLOW
        self.believed = self.speed if self_aware else (speed or SLOW)
        self.replica_id, self.closed, self.ready, self.transport = replica_id, False, True, None
        self.in_flight: dict[int, object] = {}
        self._ids = itertools.count(1)
        self.active = 0
        self.waiting = 0
        self.waiting_tokens = 0
        self.ctx_tokens = 0
        self.received: list[dict] = []
        self.refused = 0
        self.load = ReplicaLoad(replica_id, model, f"sim://{replica_id}", max_seqs, 0,
                                kv_tokens, 0, speed=speed if report_speed else None)
        path.links[replica_id] = self  # type: ignore[assignment]

    def dispatch(self, flight, message: dict) -> int:
        rid = next(self._ids)
        message["id"] = rid
        self.received.append(message)
        self.in_flight[rid] = flight
        now = self.timeline.clock.now()
        prompt = len(message["tokens"])
        queue = dict(active_seqs=self.active, active_ctx_tokens=self.ctx_tokens,
                     waiting_seqs=self.waiting, queued_prefill_tokens=self.waiting_tokens)
        ttft_s = self.speed.predict_ttft_s(prompt, **queue)
        if self.believed.predict_ttft_s(prompt, **queue) * 1000.0 > message.get(
                "deadline_ms", float("inf")):
            self.refused += 1
            self.timeline.at(now, lambda: self._answer(rid, {
                "type": "error", "code": 429, "reason": "predicted TTFT exceeds deadline_ms",
                "predicted_ttft_ms": ttft_s * 1000.0, "deadline_ms": message["deadline_ms"],
                "retry_after_ms": 100}))
            return rid
        step_s = self.speed.decode_step_s(self.active + 1, self.ctx_tokens + prompt)
        self.active += 1
        self.waiting += 1
        self.waiting_tokens += prompt

        def first() -> None:
            self.waiting -= 1
            self.waiting_tokens -= prompt
            self.ctx_tokens += prompt
            self._answer(rid, {"type": "tokens", "tokens": [1]})

        def done() -> None:
            self.active -= 1
            self.ctx_tokens -= prompt
            self._answer(rid, {"type": "done", "n_tokens": message["max_tokens"]})
        self.timeline.at(now + ttft_s, first)
        self.timeline.at(now + ttft_s + message["max_tokens"] * step_s, done)
        return rid

    def _answer(self, rid: int, message: dict) -> None:
        flight = self.in_flight.get(rid)
        if flight is not None:
            self.path.on_answer(self, flight, {"id": rid, **message})  # type: ignore[arg-type]

    def cancel(self, rid: int) -> None:
        self.in_flight.pop(rid, None)


class SimCapacity:
    """Restores that take ``restore_s`` on the timeline and bring up a :class:`SimReplica`
    (``hang``: never finish; ``fail``: raise after ``restore_s``; ``max_replicas``: a node
    at that many replicas answers at once with one it has, ``warm_hit``, as the node agent
    does at its cap)."""

    AT_CAP_ANSWER_S = 0.1

    def __init__(self, fleet: Fleet, restore_s: float, *, hang: bool = False,
                 fail: bool = False, max_replicas: int | None = None) -> None:
        self.fleet, self.restore_s, self.hang, self.fail = fleet, restore_s, hang, fail
        self.max_replicas = max_replicas
        self.calls = 0

    async def request_restore(self, model: str) -> RestoreResult:
        from agent.errors import NoCapacity

        self.calls += 1
        at_cap = self.max_replicas is not None and len(self.fleet.replicas) >= self.max_replicas
        fut = asyncio.get_running_loop().create_future()
        if not self.hang:   # at the cap: the node's answer, a control round trip later
            took_s = self.AT_CAP_ANSWER_S if at_cap else self.restore_s
            self.fleet.timeline.at(self.fleet.clock.now() + took_s,
                                   lambda: fut.done() or fut.set_result(None))
        await fut
        if at_cap:
            return RestoreResult(self.fleet.replicas[0].load, "warm_hit", None)
        if self.fail:
            raise NoCapacity(f"no node for {model}", model=model)
        replica = self.fleet.add(f"restored-{self.calls}")
        return RestoreResult(replica.load, "snapshot_restore", self.restore_s * 1000.0)


class Fleet:
    """A request path, its clock and timeline, and its sim replicas."""

    def __init__(self, *, speed: SpeedProfile = FAST, max_seqs: int = 8, warm: int = 1,
                 restore_s: float | None = None, measured_restores_s: tuple = (),
                 report_speed: bool = True, max_replicas: int | None = None, **cfg) -> None:
        self.clock = ManualClock(1000.0)
        self.speed, self.max_seqs, self.report_speed = speed, max_seqs, report_speed
        # admission's mechanics are tested with the deadline at the SLO and the SLO without
        # the prompt's prefill (times in these tests are worked out that way); the default
        # contract (deadline 3x an SLO that counts the prefill) has its own tests,
        # test_slo_deadline.py
        config = FrontDoorConfig(**{"models": {"m": 60_000.0}, "restores_per_model": 2,
                                    "deadline_factor": 1.0, "slo_counts_prefill": False,
                                    **cfg})
        self.path = RequestPath(config, clock=self.clock, telemetry=Telemetry())
        self.timeline = Timeline(self.clock, self.path, config.tick_s)
        self.replicas: list[SimReplica] = []
        if restore_s is not None:
            self.capacity = SimCapacity(self, restore_s, max_replicas=max_replicas)
            self.path.capacity = self.capacity
        for t in measured_restores_s:
            self.path.restore_times.record("m", t * 1000.0, "snapshot_restore")
        for i in range(warm):
            self.path.upsert(self.add(f"r{i}").load)
        self.sinks: list[Sink] = []

    def add(self, replica_id: str, speed: SpeedProfile | None = None,
            actual: SpeedProfile | None = None, max_seqs: int | None = None,
            self_aware: bool = True) -> SimReplica:
        replica = SimReplica(self.path, self.timeline, replica_id, "m", speed or self.speed,
                             max_seqs or self.max_seqs, report_speed=self.report_speed,
                             actual=actual, self_aware=self_aware)
        self.replicas.append(replica)
        return replica

    def submit(self, prompt_tokens: int = 32, max_tokens: int = 16, **kw) -> Sink:
        sink = Sink(self.clock, self.clock.now())
        self.sinks.append(sink)
        self.path.submit(GenerateRequest(len(self.sinks), "m", [1] * prompt_tokens, None,
                                         max_tokens, **kw), sink)
        return sink

    def arrive(self, t_s: float, prompt_tokens: int = 32, max_tokens: int = 16) -> None:
        self.timeline.at(t_s, lambda: self.submit(prompt_tokens, max_tokens))
