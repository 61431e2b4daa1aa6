"""A scaled replay through the event simulator (agent/sim/events.py): the same scaled requests,
the same speed profile, the same predictor policy, on a virtual clock.

A test helper: bench/trace_replay.py's ``sim`` column comes from :mod:`agent.sim.pathsim` (the
whole production request path); this one drives only the front door's router and admission
queue (no early 429, no replica-side refusal), the cross-check that the two simulators agree
where both model the same thing (tests/sim/test_pathsim.py, tests/sim/test_replay_sim.py).

The simulated replicas are :class:`~agent.sim.replica.SimReplica` engines at the measured
:class:`~agent.speed.SpeedProfile` (prefill the admitted prompts, then one decode step over the
batch, step after step, with the live replica's ``max_seqs`` slots of ``max_seq_len`` tokens;
agent/sim/profile.py), started in the measured restore time.  The production admission queue,
router and predictor (with :meth:`~agent.predictor.loop.Predictor.update_speed`) decide,
as in :func:`agent.sim.scenarios.run_workload`.

Paths: a request dispatched on arrival is a warm hit (SLO ``warm_slo_s``); one that waited
in the admission queue is counted on the restore path (SLO ``restore_slo_s``), the live
front door's ``snapshot_restore`` when it waited for a replica to come up.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np

from agent.sim.replay_scale import ReplayRequest
from agent.speed import SpeedProfile


def plan_workload(plan: Sequence[ReplayRequest], profile: SpeedProfile, batch: int):
    """The plan as a :class:`~agent.sim.trace.Workload` with its tokens (the profiled replicas
    run those) and, for the queue's bookkeeping, times from ``profile`` at ``batch``."""
    from agent.sim.trace import Workload

    prompt = np.array([r.prompt_tokens for r in plan], dtype=np.int64)
    output = np.array([r.output_tokens for r in plan], dtype=np.int64)
    prefill = np.array([profile.prefill_s(int(p)) for p in prompt], dtype=np.float64)
    ctx = batch * float((prompt + output / 2.0).mean()) if len(plan) else 0.0
    step = profile.decode_step_s(batch, int(ctx))
    occupancy = prefill + np.maximum(0, output - 1) * step
    return Workload(np.array([r.at_s for r in plan], dtype=np.float64), occupancy, prefill,
                    prompt + output, np.zeros(len(plan), dtype=np.int16), prompt, output)


def simulate_plan(plan: Sequence[ReplayRequest], profile: SpeedProfile, *, batch: int,
                  kv_capacity_tokens: int, restore_s: float, policy: dict[str, Any],
                  max_replicas: int, initial_replicas: int, warm_slo_s: float,
                  restore_slo_s: float, max_seqs: int, mean_prompt_tokens: float,
                  mean_gen_tokens: float, seed: int = 0,
                  span_s: float = 0.0, always_on_replicas: int = 1) -> dict[str, Any]:
    """Run ``plan`` through the simulator; the same keys as :func:`agent.sim.replay.summarise`
    (``ttft_ms`` per path ``warm_hit`` / ``snapshot_restore``), over at least ``span_s``
    simulated seconds (the live replay's window); always-on is ``always_on_replicas`` over
    the span (``one_replica_gpu_seconds`` one replica)."""
    from agent.clock import ManualClock
    from agent.predictor.keepalive import KeepAliveCosts  # noqa: F401 (policy may carry one)
    from agent.predictor.loop import ModelPolicy, Predictor
    from agent.sim.events import EXPIRED, PATH_QUEUED, PATH_WARM, SERVED, SHED
    from agent.sim.fleet import FleetConfig, StartupTimes
    from agent.sim.policies import PredictorPolicy
    from agent.sim.scenarios import run_workload

    from agent.sim.profile import ReplicaProfile

    w = plan_workload(plan, profile, batch)
    max_seq_len = max(1, kv_capacity_tokens // max(1, max_seqs))
    replica = ReplicaProfile(profile, max_seqs=max_seqs, max_seq_len=max_seq_len,
                             kv_capacity_tokens=max_seqs * max_seq_len,
                             startup=StartupTimes(restore_s=(restore_s, restore_s)),
                             source="the live replay's calibration")
    cfg = FleetConfig(model="m", seqs_per_replica=max_seqs,
                      kv_capacity_tokens=max_seqs * max_seq_len,
                      startup=StartupTimes(restore_s=(restore_s, restore_s)),
                      max_replicas=max_replicas, replica=replica)

    def make(cfg, clock, fleet):
        pred = Predictor([ModelPolicy("m", **policy)], clock=clock, scaler=fleet,
                         snapshot_durable=lambda m: True)
        pred.update_speed("m", profile, max_seqs, mean_prompt_tokens=mean_prompt_tokens,
                          mean_gen_tokens=mean_gen_tokens)
        return PredictorPolicy(pred, "m")

    # the window's wall span (its quiet tail included), or until the last request could end
    end_s = max(span_s, (max(r.at_s for r in plan) if plan else 0.0) + restore_slo_s + 1.0)
    summary, rec, _ = run_workload(w, cfg, make, max_wait_s=restore_slo_s, sla_s=restore_slo_s,
                                   initial_replicas=initial_replicas, end_s=end_s, seed=seed,
                                   clock=ManualClock())
    status, ttft, path = rec.status, rec.ttft_s, rec.path
    served = status == SERVED
    warm = served & (path == PATH_WARM)
    queued = served & (path == PATH_QUEUED)
    within = int(np.count_nonzero(warm & (ttft <= warm_slo_s))
                 + np.count_nonzero(queued & (ttft <= restore_slo_s)))
    n = len(w)

    def pct(mask, q):   # a request still in its first step at the end has no TTFT yet
        v = ttft[mask]
        v = v[np.isfinite(v)]
        return None if v.size == 0 else float(np.percentile(v, q) * 1000.0)

    span = rec.sim_s
    return {
        "requests": n, "served": int(served.sum()),
        "shed_429": int(np.count_nonzero(status == SHED)),
        "shed_429_within_50ms": int(np.count_nonzero(status == SHED)),
        "expired_504": int(np.count_nonzero(status == EXPIRED)),
        "lost": int(np.count_nonzero(status == 0)),
        "sla_attainment": within / n if n else 1.0,
        "ttft_ms": {"warm_hit": {"p50": pct(warm, 50), "p99": pct(warm, 99),
                                 "count": int(warm.sum()), "slo_ms": warm_slo_s * 1000.0},
                    "snapshot_restore": {"p50": pct(queued, 50), "p99": pct(queued, 99),
                                         "count": int(queued.sum()),
                                         "slo_ms": restore_slo_s * 1000.0}},
        "gpu_seconds": round(rec.gpu_s, 2),
        "always_on_gpu_seconds": round(always_on_replicas * span, 2),
        "always_on_replicas": always_on_replicas,
        "one_replica_gpu_seconds": round(span, 2),
        "gpu_ratio": rec.gpu_s / (always_on_replicas * span) if span > 0 else None,
        "restores": int(summary["starts_by_tier"].get("restore", 0)),
        "peak_replicas": int(rec.billed_replicas.max()) if rec.billed_replicas.size else 0,
    }
