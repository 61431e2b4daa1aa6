"""The scenarios ``rewarm simulate`` runs: spike (AOT document) and cost (snapshot document).

``spike`` replays a traffic spike (agent/sim/README.md, "Spike"): one tenant's steady traffic jumps tenfold
within ten minutes and stays up for most of an hour, on a shared platform beside other
tenants' steady traffic; an autoscaler keeps a spare-capacity buffer and its new replicas
serve only after their cold start.  We sweep cold-start time against buffer size.

``cost`` follows docs/architecture.md ("Sizing", "Cost model"): 13B-class replicas on 40 GB GPUs,
80 sequences per replica at 0.75 utilisation, 20 req/s baseline with bursts to 200 req/s,
7.0 s occupancy, $2.80 per GPU-hour, TTFT SLA 4 s; five policies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from typing import Any

import numpy as np

from agent.clock import ManualClock
from agent.errors import ConfigError
from agent.frontdoor.admission import AdmissionQueue
from agent.frontdoor.router import Router
from agent.sim.cost import DOC_REQUESTS_PER_DAY, summarise
from agent.sim.events import RunRecord, Simulation
from agent.sim.fleet import Fleet, FleetConfig, StartupTimes
from agent.sim.trace import Workload, mix, synthetic

MODEL = "m"


def run_workload(workload: Workload, cfg: FleetConfig, make_controller, *, max_wait_s: float,
                 sla_s: float, initial_replicas: int = 0, max_depth: int = 1_000_000,
                 seed: int = 0, end_s: float | None = None, progress: bool = False,
                 clock: ManualClock | None = None, slo=None) -> tuple[dict, RunRecord, Simulation]:
    """One run on fresh production objects: a ManualClock, an ``AdmissionQueue``, a
    ``Router``, a :class:`Fleet` and the controller ``make_controller(cfg)`` builds
    (it receives the fleet config and may hold the fleet through ``sim.fleet``).  With
    ``slo`` (:class:`agent.slo.TtftSlo`) each request has its own SLO and deadline and
    ``max_wait_s`` only bounds the queue's hold (it should be the longest deadline)."""
    clock = clock or ManualClock()
    router = Router()
    queue = AdmissionQueue(cfg.model, clock=clock, max_depth=max_depth, max_wait_s=max_wait_s)
    fleet = Fleet(cfg, router=router, clock=clock, schedule=None,
                  rng=np.random.default_rng(seed + 1))
    sim = Simulation(workload, clock=clock, queue=queue, router=router, fleet=fleet,
                     controller=make_controller(cfg, clock, fleet), model=cfg.model,
                     max_wait_s=max_wait_s, end_s=end_s, slo=slo,
                     restore_on_cold=cfg.restore_on_cold)
    fleet._schedule = sim.schedule
    fleet.start_warm(initial_replicas)
    rec = sim.run(progress=progress)
    return summarise(rec, workload, sla_s=sla_s, seqs_per_replica=cfg.seqs_per_replica), rec, sim


# --- spike --------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpikeShape:
    """The AOT document's spike, our numbers.

    A platform of ``platform_calls`` concurrent calls in steady state, of which the spiking
    tenant holds ``tenant_share``; calls last ``call_s`` on average (gamma, CV 0.5).  The
    tenant's rate rises ``factor``-fold along a logistic curve whose 10-90 % rise takes
    ``ramp_s`` (ten minutes, "within ten minutes"), holds for ``hold_s`` (most of an hour),
    then falls back over ``ramp_s``.  ``seqs_per_replica`` calls fit one container.
    """

    platform_calls: int = 2000
    tenant_share: float = 0.03
    factor: float = 10.0
    call_s: float = 120.0
    steady_s: float = 900.0
    ramp_s: float = 600.0
    hold_s: float = 2700.0
    tail_s: float = 900.0
    seqs_per_replica: int = 32
    caller_patience_s: float = 5.0

    @property
    def duration_s(self) -> float:
        return self.steady_s + 2 * self.ramp_s + self.hold_s + self.tail_s


def spike_rates(shape: SpikeShape) -> tuple[np.ndarray, np.ndarray]:
    """Per-second arrival rates ``[T]`` (req/s) of the tenant and of the background."""
    t = np.arange(int(shape.duration_s), dtype=np.float64)
    base_rps = shape.platform_calls / shape.call_s
    tenant0 = base_rps * shape.tenant_share
    k = 4.394 / shape.ramp_s  # logistic: 10 % -> 90 % in ramp_s (2 ln 9 / k)
    up_mid = shape.steady_s + shape.ramp_s / 2
    down_mid = shape.steady_s + 1.5 * shape.ramp_s + shape.hold_s
    rise = 1 / (1 + np.exp(-k * (t - up_mid))) - 1 / (1 + np.exp(-k * (t - down_mid)))
    tenant = tenant0 * (1 + (shape.factor - 1) * rise)
    return tenant, np.full_like(t, base_rps - tenant0)


def spike_workload(shape: SpikeShape, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    tenant, bg = spike_rates(shape)
    common: dict[str, Any] = dict(step_s=1.0, occupancy_s=shape.call_s, prefill_s=0.0, need_tokens=1, rng=rng,
                  occupancy_cv=0.5)
    return mix(synthetic(tenant, tenant=0, **common), synthetic(bg, tenant=1, **common))


def run_spike_once(workload: Workload, shape: SpikeShape, cold_start_s: float, buffer: float,
                   *, keepalive_s: float = 120.0) -> tuple[dict, RunRecord]:
    """One run of the buffer autoscaler (:class:`ConcurrencyBuffer`) at ``buffer`` spare."""
    from agent.sim.policies import ConcurrencyBuffer

    cfg = FleetConfig(model=MODEL, seqs_per_replica=shape.seqs_per_replica,
                      kv_capacity_tokens=shape.seqs_per_replica,
                      startup=StartupTimes(naive_s=(cold_start_s, cold_start_s)),
                      use_snapshot=False)
    initial = int(np.ceil(shape.platform_calls * (1 + buffer) / shape.seqs_per_replica))

    def make(cfg, clock, fleet):
        return ConcurrencyBuffer(MODEL, seqs_per_replica=cfg.seqs_per_replica,
                                 occupancy_s=shape.call_s, buffer=buffer, keepalive_s=keepalive_s,
                                 floor_replicas=initial, floor_until_s=5 * shape.call_s)

    summary, rec, _ = run_workload(workload, cfg, make, max_wait_s=shape.caller_patience_s,
                                   sla_s=shape.caller_patience_s, initial_replicas=initial,
                                   end_s=shape.duration_s)
    summary["dropped"] = summary["shed"] + summary["expired"]
    return summary, rec


def min_buffer_zero_drops(workload: Workload, shape: SpikeShape, cold_start_s: float, *,
                          hi: float = 0.6, tol: float = 0.005,
                          log: list | None = None) -> float | None:
    """Smallest buffer (fraction) with zero dropped calls, by bisection to ``tol``.

    None when even ``hi`` drops calls.  Assumes drops fall as the buffer grows (checked at
    both ends).  Each run's summary is appended to ``log`` when given."""
    def dropped(buffer: float) -> int:
        summary = run_spike_once(workload, shape, cold_start_s, buffer)[0]
        if log is not None:
            log.append(summary)
        return summary["dropped"]

    if dropped(hi):
        return None
    lo_b = 0.0
    if not dropped(lo_b):
        return 0.0
    while hi - lo_b > tol:
        mid = (lo_b + hi) / 2
        if dropped(mid):
            lo_b = mid
        else:
            hi = mid
    return hi


AOT_DOC_SPIKE = {26.0: {"min_buffer_pct": "< 3", "dropped_at_10pct": 0, "shortage_minutes": 0.0},
                 336.0: {"min_buffer_pct": "~18", "shortage_minutes": "> 4",
                         "peak_shortfall": "~800"}}
DEFAULT_COLD_STARTS = (26.0, 60.0, 120.0, 180.0, 260.0, 336.0)


def spike_scenario(shape: SpikeShape = SpikeShape(),
                   cold_starts_s: tuple[float, ...] = DEFAULT_COLD_STARTS, *, seed: int = 0,
                   progress: bool = False) -> dict:
    """The sweep: per cold-start time the smallest zero-drop buffer, and drops, shortage and
    peak shortfall at a 10 % buffer.  Returns the JSON-ready result (``sweep``, ``series``)."""
    import time

    wall0 = time.perf_counter()
    w = spike_workload(shape, seed)
    sweep, series, runs = [], [], []
    items = cold_starts_s
    if progress:
        from tqdm import tqdm
        items = tqdm(cold_starts_s, desc="spike sweep", unit="cold-start")
    for cs in items:
        at10, rec = run_spike_once(w, shape, cs, 0.10)
        runs.append(at10)
        sweep.append({"cold_start_s": cs,
                      "min_buffer_pct_zero_drops": _pct(min_buffer_zero_drops(w, shape, cs,
                                                                              log=runs)),
                      "dropped_at_10pct": at10["dropped"],
                      "shortage_minutes_at_10pct": at10["shortage_minutes"],
                      "peak_shortfall_at_10pct": at10["peak_shortfall"],
                      "gpu_hours_at_10pct": at10["gpu_hours"]})
        series.append({"cold_start_s": cs, "t_s": rec.tick_t_s[::10].tolist(),
                       "capacity": (rec.warm_replicas[::10] * shape.seqs_per_replica).tolist()})
    t = np.arange(0, shape.duration_s, 10.0)
    wall = time.perf_counter() - wall0
    return {"scenario": "spike", "shape": shape.__dict__, "sweep": sweep, "series": series,
            "demand": {"t_s": t.tolist(), "calls": w.offered_concurrency(t).tolist()},
            "doc": {str(k): v for k, v in AOT_DOC_SPIKE.items()}, "requests_per_run": len(w),
            "runs": len(runs), "wall_s": wall, "warmup_s": 5 * shape.call_s,
            "sim_wall_s_per_sim_hour": sum(r["wall_s"] for r in runs)
            / sum(r["sim_hours"] for r in runs)}


def _pct(x: float | None) -> float | None:
    return None if x is None else round(100.0 * x, 2)


# --- cost ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class CostShape:
    """The snapshot document's capacity example ("Scaling and Performance"), our burst plan.

    ``base_rps`` 20 with bursts to ``burst_rps`` 200, each ``burst_s`` long, one per
    ``burst_period_s`` (8 bursts, 2 GPU-heavy hours a day: the document's 114 GPU-hours for
    3 warm replicas imply 42 burst GPU-hours = 2 h x 21 replicas).  Bursts alternate between
    a ``step_ramp_s`` jump (an unforecastable spike) and a ``slow_ramp_s`` linear rise.
    ``occupancy_s`` 7.0, ``prefill_s`` TTFT on a free replica, ``need_tokens`` 900 (average
    context), ``kv_capacity_tokens`` 72,089 -> 80 sequences, SLA ``sla_s`` 4 s.
    """

    hours: float = 24.0
    base_rps: float = 20.0
    burst_rps: float = 200.0
    burst_s: float = 900.0
    burst_period_s: float = 3 * 3600.0
    step_ramp_s: float = 10.0
    slow_ramp_s: float = 120.0
    occupancy_s: float = 7.0
    prefill_s: float = 0.25
    need_tokens: int = 900
    kv_capacity_tokens: int = 72_089
    seqs_per_replica: int = 80
    utilisation: float = 0.75
    sla_s: float = 4.0
    price_per_gpu_hour: float = 2.80


def cost_rates(shape: CostShape) -> np.ndarray:
    """Per-second arrival rate ``[T]`` (req/s): baseline plus the bursts."""
    duration = int(shape.hours * 3600)
    t = np.arange(duration, dtype=np.float64)
    rate = np.full(duration, shape.base_rps)
    period = min(shape.burst_period_s, duration)
    starts = np.arange(period / 2 if duration >= shape.burst_period_s else duration / 3,
                       duration - shape.burst_s / 2, period)
    for k, s in enumerate(starts):
        ramp = shape.step_ramp_s if k % 2 == 0 else shape.slow_ramp_s
        up = np.clip((t - s) / ramp, 0, 1)
        down = np.clip((s + shape.burst_s - t) / ramp, 0, 1)
        rate = np.maximum(rate, shape.base_rps + (shape.burst_rps - shape.base_rps)
                          * np.minimum(up, down))
    return rate


def cost_workload(shape: CostShape, seed: int = 0) -> Workload:
    return synthetic(cost_rates(shape), step_s=1.0, occupancy_s=shape.occupancy_s,
                     prefill_s=shape.prefill_s, need_tokens=shape.need_tokens,
                     rng=np.random.default_rng(seed))


def _predictor(model: str, clock, fleet, **policy_kw):
    from agent.predictor.loop import ModelPolicy, Predictor

    return Predictor([ModelPolicy(model, **policy_kw)], clock=clock, scaler=fleet,
                     snapshot_durable=lambda m: fleet.cfg.use_snapshot)


def cost_policies(shape: CostShape, startup: StartupTimes = StartupTimes(),
                  cap_at_peak: bool = False) -> dict:
    """name -> (FleetConfig, make_controller, initial replicas), the five policies compared.

    Scaling policies may run up to 4x the always-on pool (``peak``); with ``cap_at_peak``
    no more than it: the fleet an operator would provision for the peak is then the most any
    policy may hold, so that scaling is compared with not scaling at the same maximum."""
    from agent.predictor.keepalive import KeepAliveCosts
    from agent.predictor.loop import ModelPolicy
    from agent.sim.policies import FixedPool, PredictorPolicy, Reactive

    s = shape
    peak = int(np.ceil(s.burst_rps * s.occupancy_s / (s.seqs_per_replica * s.utilisation)))
    base = int(np.ceil(s.base_rps * s.occupancy_s / (s.seqs_per_replica * s.utilisation)))
    most = peak if cap_at_peak else 4 * peak
    cfg = FleetConfig(model=MODEL, seqs_per_replica=s.seqs_per_replica,
                      kv_capacity_tokens=s.kv_capacity_tokens, startup=startup,
                      max_replicas=most)
    naive_cfg = replace(cfg, use_snapshot=False)
    rewarm_cfg = replace(cfg, keep_suspended=True, restore_on_cold=True)
    restore_p99 = startup.restore_s[1]
    resume_s = startup.suspended_s[1]
    gpu_per_s = s.price_per_gpu_hour / 3600.0
    common = dict(seqs_per_replica=s.seqs_per_replica, occupancy_s=s.occupancy_s)

    def reactive(min_replicas, window_s, keepalive_s):
        return lambda c, clock, fleet: Reactive(
            MODEL, utilisation=s.utilisation, min_replicas=min_replicas, max_replicas=most,
            window_s=window_s, keepalive_s=keepalive_s, initial_rate_rps=s.base_rps, **common)

    def doc_predictive(c, clock, fleet):
        # the document's Holt (alpha 0.35, beta 0.15, 15 s lead), 3 warm, no suspended tier
        return PredictorPolicy(_predictor(
            MODEL, clock, fleet, utilisation=s.utilisation, min_replicas=base, max_replicas=most,
            alpha=0.35, beta=0.15, phi=1.0, forecaster="holt_backstop", lead_time_s=15.0,
            restore_p99_s=restore_p99,
            costs=KeepAliveCosts(gpu_cost_per_s=gpu_per_s, restore_s=restore_p99), **common), MODEL)

    def rewarm(c, clock, fleet):
        # the production policy (ModelPolicy's defaults, as `rewarm up` and `rewarm
        # predictor` build it: no replica floor), given what a deployment measures: the
        # workload's occupancy and slots, the restore and resume times, the GPU price
        policy = dict(max_replicas=most, restore_p99_s=restore_p99,
                      lead_time_s=max(ModelPolicy.lead_time_s, restore_p99 + 2.0),
                      costs=KeepAliveCosts(gpu_cost_per_s=gpu_per_s,
                                           suspended_cost_per_s=gpu_per_s / 20,
                                           restore_s=restore_p99,
                                           resume_s=min(resume_s, restore_p99)), **common)
        return PredictorPolicy(_predictor(MODEL, clock, fleet, **policy), MODEL)

    return {
        "always_on": (cfg, lambda c, clock, fleet: FixedPool(MODEL, peak), peak),
        # reactive, cold boots, and to zero after a fixed keep-alive (the document's 300 s)
        "scale_to_zero": (naive_cfg, reactive(0, 10.0, 300.0), base),
        "snapshot_reactive": (cfg, reactive(base, 30.0, 60.0), base),
        "snapshot_predictive": (cfg, doc_predictive, base),
        "rewarm": (rewarm_cfg, rewarm, base),
    }


def cost_scenario(shape: CostShape = CostShape(), startup: StartupTimes = StartupTimes(), *,
                  seed: int = 0, progress: bool = False, only: tuple[str, ...] | None = None) -> dict:
    """All five policies on one workload; returns ``{"policies": [...], ...}`` (JSON-ready)."""
    w = cost_workload(shape, seed)
    out, wall, sim_h = [], 0.0, 0.0
    for name, (cfg, make, initial) in cost_policies(shape, startup).items():
        if only and name not in only:
            continue
        summary, rec, _ = run_workload(w, cfg, make, max_wait_s=shape.sla_s - shape.prefill_s,
                                       sla_s=shape.sla_s, initial_replicas=initial,
                                       end_s=shape.hours * 3600.0, seed=seed, progress=progress)
        # suspended replicas hold host RAM, priced like the keep-alive does (GPU price / 20)
        extra = summary["suspended_replica_hours"] * shape.price_per_gpu_hour / 20
        summary["cost_per_1000_requests"] = (summary["gpu_hours"] * shape.price_per_gpu_hour
                                             + extra) / len(w) * 1000.0
        summary["cost_per_day"] = (summary["gpu_hours"] * shape.price_per_gpu_hour + extra) \
            * 24.0 / summary["sim_hours"]
        # the document divides a day's cost by baseline volume only (cost.DOC_REQUESTS_PER_DAY)
        summary["cost_per_1000_requests_doc_basis"] = summary["cost_per_day"] / DOC_REQUESTS_PER_DAY \
            * 1000.0
        summary["name"] = name
        summary["series"] = {"t_s": rec.tick_t_s[::30].tolist(),
                             "billed": rec.billed_replicas[::30].tolist(),
                             "warm": rec.warm_replicas[::30].tolist()}
        out.append(summary)
        wall += rec.wall_s
        sim_h += rec.sim_s / 3600.0
    from agent.sim.cost import DOC_COST_TABLE

    return {"scenario": "cost", "shape": shape.__dict__, "startup": startup.__dict__,
            "requests": len(w), "policies": out, "doc": DOC_COST_TABLE,
            "sim_wall_s_per_sim_hour": wall / sim_h if sim_h else None}


def profiled_workload(workload: Workload, replica, *, sla_s: float,
                      token_scale: float = 1.0) -> tuple[Workload, dict]:
    """``workload`` as replicas of ``replica`` (agent/sim/profile.py) serve it: tokens scaled
    by ``token_scale`` and shrunk to fit a slot (:func:`~agent.sim.replica.fit_tokens`),
    ``prefill_s`` and ``occupancy_s`` from the measured speed at the batch the replica sustains
    within ``sla_s`` (:meth:`SpeedProfile.sustainable_concurrency`: capacity from measured
    rates, not KV slots).  Returns the workload and what was derived (``sustainable_batch``,
    ``requests_shrunk``, ``token_scale``)."""
    from agent.sim.replica import fit_tokens, service_s

    if workload.prompt_tokens is None or workload.output_tokens is None:
        raise ConfigError("a replica profile needs the workload's tokens (a trace's)",
                          name="workload", value="no tokens", limit="prompt_tokens")
    sp = replica.speed
    p, o, shrunk = fit_tokens(workload.prompt_tokens, workload.output_tokens,
                              replica.max_seq_len, token_scale)
    batch = sp.sustainable_concurrency(sla_s, float(p.mean()), float(o.mean()), replica.max_seqs)
    occ = service_s(sp, p.astype(np.float64), o.astype(np.float64), batch)
    w = Workload(workload.arrival_s, occ, sp.prefill_overhead_s + p / sp.prefill_tokens_per_s,
                 p + o, workload.tenant, p, o)
    return w, {"sustainable_batch": batch, "requests_shrunk": shrunk, "token_scale": token_scale,
               "mean_prompt_tokens": float(p.mean()), "mean_output_tokens": float(o.mean())}


def trace_scenario(workload: Workload, startup: StartupTimes = StartupTimes(), *,
                   sla_s: float = 4.0, seqs_per_replica: int = 80,
                   kv_capacity_tokens: int = 72_089, seed: int = 0, progress: bool = False,
                   only: tuple[str, ...] | None = None, replica=None,
                   token_scale: float = 1.0, slo=None) -> dict:
    """Replay a trace through the cost scenario's policies, sized from the trace itself.

    With ``slo`` (:class:`agent.slo.TtftSlo`) every request is held to its own SLO, ``base +
    prefill`` (the restore base when it found no warm replica), and waits until its deadline
    (``slo.deadline_factor`` times that); without, to the fixed ``sla_s`` for both.

    The always-on pool is sized for the trace's busiest 10 s, and no policy runs more
    replicas than it (``cap_at_peak``); occupancy and KV need come
    from its tokens (:class:`~agent.sim.trace.TokenTiming`).  With ``replica`` (a
    :class:`~agent.sim.profile.ReplicaProfile`) the replicas batch and step at its measured
    speed with its slots (:func:`profiled_workload`; policies size by its sustainable batch),
    and the run continues until the last request could have finished (after a restore).
    """
    from agent.predictor.sizing import seqs_per_replica as kv_seqs

    derived: dict[str, Any] = {}
    if replica is not None:
        workload, derived = profiled_workload(workload, replica, sla_s=sla_s,
                                              token_scale=token_scale)
        seqs_per_replica = derived["sustainable_batch"]
        kv_capacity_tokens = replica.kv_capacity_tokens
    duration = max(60.0, workload.duration_s)
    # sequences per replica are bounded by KV capacity at the trace's mean context
    seqs_per_replica = max(1, min(seqs_per_replica,
                                  kv_seqs(kv_capacity_tokens, float(workload.need_tokens.mean()))))
    per_10s = np.bincount((workload.arrival_s // 10).astype(np.int64)) / 10.0
    shape = CostShape(hours=duration / 3600.0, base_rps=len(workload) / duration,
                      burst_rps=float(per_10s.max()), occupancy_s=float(workload.occupancy_s.mean()),
                      prefill_s=float(np.median(workload.prefill_s)),
                      need_tokens=int(workload.need_tokens.mean()),
                      kv_capacity_tokens=kv_capacity_tokens, seqs_per_replica=seqs_per_replica,
                      sla_s=sla_s)
    out, wall, sim_h = [], 0.0, 0.0
    # the run lasts until the last request could have finished, after a cold start at worst
    end_s = duration + float(workload.occupancy_s.max()) + max(startup.restore_s[1],
                                                                startup.suspended_s[1])
    for name, (cfg, make, initial) in cost_policies(shape, startup, cap_at_peak=True).items():
        if only and name not in only:
            continue
        if replica is not None:  # the router's hard limit is the replica's slots
            cfg = replace(cfg, replica=replica, seqs_per_replica=replica.max_seqs,
                          kv_capacity_tokens=replica.kv_capacity_tokens)
        max_wait = sla_s if slo is None else \
            slo.deadline_s(float(workload.prefill_s.max()), True)
        summary, rec, _ = run_workload(workload, cfg, make, max_wait_s=max_wait, sla_s=sla_s,
                                       initial_replicas=initial, end_s=end_s, seed=seed,
                                       progress=progress, slo=slo)
        summary["name"] = name
        summary["series"] = {"t_s": rec.tick_t_s[::10].tolist(),
                             "billed": rec.billed_replicas[::10].tolist(),
                             "warm": rec.warm_replicas[::10].tolist()}
        out.append(summary)
        wall += rec.wall_s
        sim_h += rec.sim_s / 3600.0
    return {"scenario": "trace", "shape": shape.__dict__, "startup": startup.__dict__,
            "slo": None if slo is None else slo.__dict__,
            "requests": len(workload), "policies": out, "doc": {},
            "replica_profile": None if replica is None else {
                "source": replica.source, "speed": replica.speed.to_dict(),
                "max_seqs": replica.max_seqs, "max_seq_len": replica.max_seq_len, **derived},
            "sim_wall_s_per_sim_hour": wall / sim_h if sim_h else None}
