"""A replay through the production request path, on virtual time.

:func:`simulate_path` runs a scaled trace window (:class:`~agent.sim.replay_scale.ReplayRequest`
list, wall seconds) the way the live replay (bench/trace_replay.py) runs it on the embedded
stack, with only the replicas, the node agent and the clock simulated::

    client (plan times) ──► RequestPath.submit (production: routing by predicted TTFT,
                              early 429, hold and re-check, capacity requests, 504s)
                                │ ReplicaLink (production) ── SimTransport ──► SimWorker
                                │                        (agent/sim/worker.py: SimReplica
                                │                         at the measured speed, 429 on
                                │                         deadline_ms by the worker's rule)
         RequestPath.apply_replicas ◄── SimNode registry (every registry_poll_s; the agent
                                │        loop copies loads into meta every agent_tick_s)
         capacity: SimNode.request_restore (restore_s, max_replicas per node)
    PredictorService(Predictor, LocalScaler(SimNode.call)) every step_s (production),
         fed the front door's ``stats`` counters as the live predictor is

Everything runs on one :class:`~agent.sim.vloop.VirtualLoop`; every component's clock is a
:class:`~agent.sim.vloop.LoopClock`.  The loops the live processes run around these objects
(the front door's queue ticker and registry watcher, the node agent's tick, the predictor
service's ``run``) are re-created here as tasks with the live periods
(:class:`PathSimConfig`).  Results are :func:`agent.sim.replay.summarise`'s keys, from an
:class:`~agent.sim.replay.Outcome` per request (times from its arrival: there is no network),
GPU-seconds as replica-seconds of every replica not dead over the window's span.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

from agent.sim.replay import Outcome, summarise
from agent.sim.replay_scale import ReplayRequest
from agent.sim.vloop import LoopClock, run_virtual
from agent.slo import DEADLINE_FACTOR
from agent.speed import SpeedProfile
from agent.throughput import BacklogCapacity


@dataclass(frozen=True)
class PathSimConfig:
    """The live embedded stack's settings (agent/up.py ``Stack``; bench/trace_replay.py).

    ``deadline_ms``: the model's default deadline at the front door (a cap);
    ``deadline_factor`` its default deadline over the SLO (agent/slo.py); ``registry_poll_s``
    the front door's registry polling (Stack's front door config); ``agent_tick_s`` the
    node agent loop (Stack: 0.5 s); ``predictor_step_s`` the predictor's tick;
    ``restores_per_model`` the front door's cap on restores in flight; ``max_wait_s`` its
    cap on any wait; ``max_replicas`` the node's replica cap; ``zygote_s`` how long the node
    takes to start a zygote (a restore finding none ready waits that much longer; 0: a
    zygote is always ready)."""

    model: str = "m"
    deadline_ms: float = 4000.0
    deadline_factor: float = DEADLINE_FACTOR
    registry_poll_s: float = 0.2
    agent_tick_s: float = 0.5
    predictor_step_s: float = 1.0
    restores_per_model: int = 2
    max_wait_s: float = 60.0
    max_replicas: int = 2
    zygote_s: float = 0.0
    warm_slo_ms: float = 2000.0
    restore_slo_ms: float = 4000.0


class _Sink:
    """One request's answers as the replay's client records them (an Outcome)."""

    __slots__ = ("out", "sent_s", "loop", "pending")

    def __init__(self, out: Outcome, loop, pending: list[int]) -> None:
        self.out, self.loop, self.pending = out, loop, pending
        self.sent_s = loop.time()

    def tokens(self, message: dict) -> None:
        if self.out.ttft_ms is None:
            self.out.ttft_ms = (self.loop.time() - self.sent_s) * 1000.0

    def done(self, message: dict) -> None:
        if self.out.ttft_ms is None:
            self.out.ttft_ms = (self.loop.time() - self.sent_s) * 1000.0
        self.out.code, self.out.path = 200, message.get("path")
        self._end()

    def error(self, code: int, reason: str, retry_after_ms: int | None = None,
              refusal: str | None = None) -> None:
        self.out.code, self.out.reason = code, reason
        self.out.ttft_ms = None
        self._end()

    def _end(self) -> None:
        self.out.answered_ms = (self.loop.time() - self.sent_s) * 1000.0
        self.pending[0] -= 1


def _frontdoor_stats(path) -> dict[str, dict]:
    """What the live predictor's ``frontdoor_stats`` returns for this front door: its
    ``stats`` answer (``RequestPath.info``) read by the same parser, so every counter the
    live predictor is fed (arrivals, KV capacities, and whatever the front door adds) reaches
    the simulated one too.  (``_parse_stats`` is the predictor service's own reader of that
    answer; a public name for it would be better.)"""
    from agent.predictor.service import _parse_stats

    return _parse_stats("frontdoor", path.info("stats"))


async def _replay(plan: Sequence[ReplayRequest], profile: SpeedProfile, cfg: PathSimConfig, *,
                  max_seqs: int, max_seq_len: int, restore_s: float, policy: dict[str, Any],
                  mean_prompt_tokens: float, mean_gen_tokens: float, initial_replicas: int,
                  until_s: float, always_on_replicas: int, stats: dict,
                  actual: SpeedProfile | None, measured_restore_s: float,
                  sustained: BacklogCapacity | None) -> dict[str, Any]:
    from agent.cluster import ClusterChoice, choose
    from agent.frontdoor.config import FrontDoorConfig
    from agent.frontdoor.request import GenerateRequest
    from agent.frontdoor.request_path import RequestPath
    from agent.predictor.loop import ModelPolicy, Predictor
    from agent.predictor.service import PredictorService
    from agent.sim.node import SimNode
    from agent.telemetry import Telemetry

    loop = asyncio.get_running_loop()
    clock = LoopClock(loop)
    model = cfg.model
    node = SimNode(model, profile, max_seqs=max_seqs, max_seq_len=max_seq_len,
                   restore_s=restore_s, max_replicas=cfg.max_replicas, actual=actual,
                   zygote_s=cfg.zygote_s,
                   # as the node agent's pool_target on a CPU node: one per replica slot
                   zygotes=max(1, cfg.max_replicas))
    config = FrontDoorConfig(models={model: cfg.deadline_ms}, registry_poll_s=cfg.registry_poll_s,
                             restores_per_model=cfg.restores_per_model, max_wait_s=cfg.max_wait_s,
                             warm_slo_ms=cfg.warm_slo_ms, restore_slo_ms=cfg.restore_slo_ms,
                             deadline_factor=cfg.deadline_factor)
    path = RequestPath(config, clock=clock, telemetry=Telemetry(process_metrics=False),
                       capacity=node, connector=node.connect)
    # Before the live window the front door restored a replica (the probe after scale to
    # zero): it has that restore measured, and the replica warm.
    path.restore_times.record(model, measured_restore_s * 1000.0, "snapshot_restore")
    for _ in range(initial_replicas):
        node.start_warm()
    path.apply_replicas(node.instances())

    scaler = choose("scaler", ClusterChoice(), clock=clock, agents={"sim": node.call})
    mpolicy = ModelPolicy(model, step_s=cfg.predictor_step_s, **policy)
    service = PredictorService(Predictor([mpolicy], clock=clock, scaler=scaler,
                                         snapshot_durable=lambda m: True),
                               clock=clock, fetch=lambda: {"fd": _frontdoor_stats(path)},
                               scaler=scaler)
    service.predictor.update_speed(model, profile, max_seqs,
                                   mean_prompt_tokens=mean_prompt_tokens,
                                   mean_gen_tokens=mean_gen_tokens, sustained=sustained)
    if sustained is not None:   # the live front door had it from the calibration's replica
        path.router.remember_capacity(model, sustained)
    decisions: list = []

    async def every(period_s: float, fn) -> None:
        while True:
            await asyncio.sleep(period_s)
            fn()

    async def predictor() -> None:      # PredictorService.run, on the loop
        while True:
            started = loop.time()
            decisions.extend(d for d in service.step() if d.action not in ("hold", "standby"))
            await node.settle()           # the scaler's blocking calls, as long as they take
            await asyncio.sleep(max(0.0, cfg.predictor_step_s - (loop.time() - started)))

    def expire() -> None:   # as the front door's ticker (agent/frontdoor/server.py) runs it
        if path.queued_models or path.watching:
            path.expire_queued()

    tasks = [loop.create_task(every(config.tick_s, expire)),
             loop.create_task(every(cfg.registry_poll_s,
                                    lambda: path.apply_replicas(node.instances()))),
             loop.create_task(every(cfg.agent_tick_s, node.tick)),
             loop.create_task(predictor())]
    t0 = loop.time()
    node.start_billing()
    outcomes = [Outcome(code=0, sent_s=r.at_s) for r in plan]
    pending = [len(plan)]
    for i, r in enumerate(plan):
        delay = t0 + r.at_s - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sink = _Sink(outcomes[i], loop, pending)
        path.submit(GenerateRequest(i, model, [1] * r.prompt_tokens, None, r.output_tokens),
                    sink)
    while pending[0] > 0:
        await asyncio.sleep(0.05)
    rest = t0 + until_s - loop.time()
    if rest > 0:
        await asyncio.sleep(rest)
    span_s = loop.time() - t0
    replica_s = node.replica_seconds()
    for task in tasks:
        task.cancel()
    for o in outcomes:
        if o.code == 0:
            o.code, o.reason = 598, "no answer"
    out = summarise(outcomes, gpu_seconds=replica_s,
                    always_on_gpu_seconds=always_on_replicas * span_s, restores=node.restores)
    out.update(peak_replicas=node.peak, always_on_replicas=always_on_replicas,
               one_replica_gpu_seconds=round(span_s, 2),
               counts={k: v for k, v in path.counts.items() if v},
               replica_429=sum(r.worker.refused for r in node.records.values()))
    stats["decisions"] = decisions
    stats["outcomes"] = outcomes
    return out


def simulate_path(plan: Sequence[ReplayRequest], profile: SpeedProfile, *, max_seqs: int,
                  max_seq_len: int, restore_s: float, policy: dict[str, Any],
                  mean_prompt_tokens: float, mean_gen_tokens: float,
                  config: PathSimConfig | None = None, initial_replicas: int = 1,
                  span_s: float = 0.0, always_on_replicas: int = 1,
                  records: dict | None = None, actual: SpeedProfile | None = None,
                  measured_restore_s: float | None = None,
                  sustained: BacklogCapacity | None = None) -> dict[str, Any]:
    """Replay ``plan`` (wall seconds from the window's start) through the production request
    path and predictor with simulated replicas (module docstring); returns
    :func:`agent.sim.replay.summarise`'s keys plus ``peak_replicas``, ``always_on_replicas``,
    ``one_replica_gpu_seconds``, ``counts`` (the request path's), ``replica_429`` and
    ``sim_wall_s`` (CPU-bound wall seconds the simulation took).  ``profile``: what the
    replicas report and predict with (their speed meter's); ``actual``: how fast they serve
    (default ``profile``); ``max_seqs`` x ``max_seq_len``: their KV slots;
    ``restore_s``: a restore's duration; ``measured_restore_s``: the restore the front door
    measured before the window (default ``restore_s``); ``sustained``: the capacity the
    live replica was measured to sustain backlogged before the window (agent/throughput.py),
    which the live front door and predictor held at its start, so these do too;
    ``policy``: :class:`~agent.predictor.policy.ModelPolicy` fields; the window lasts at
    least ``span_s``; ``records``, when given, receives the predictor's decisions
    (``decisions``) and the outcomes (``outcomes``)."""
    cfg = config or PathSimConfig()
    stats: dict = {} if records is None else records
    wall0 = time.perf_counter()
    out = run_virtual(_replay(plan, profile, cfg, max_seqs=max_seqs, max_seq_len=max_seq_len,
                              restore_s=restore_s, policy=policy,
                              mean_prompt_tokens=mean_prompt_tokens,
                              mean_gen_tokens=mean_gen_tokens,
                              initial_replicas=initial_replicas, until_s=span_s,
                              always_on_replicas=always_on_replicas, stats=stats,
                              actual=actual,
                              measured_restore_s=(restore_s if measured_restore_s is None
                                                  else measured_restore_s),
                              sustained=sustained),
                      start_s=1000.0)
    out["sim_wall_s"] = round(time.perf_counter() - wall0, 3)
    return out
