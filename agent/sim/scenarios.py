"""The scenarios ``rewarm simulate`` runs: spike (AOT document) and cost (snapshot document).

``spike`` follows the AOT design document (../shared/seeds/000_f945d6c794d3cae0.txt, "A toy
simulation: replaying a real traffic spike"): one tenant's steady traffic jumps tenfold
within ten minutes and stays up for most of an hour, on a shared platform beside other
tenants' steady traffic; an autoscaler keeps a spare-capacity buffer and its new replicas
serve only after their cold start.  We sweep cold-start time against buffer size.

``cost`` follows the snapshot design document (../shared/seeds/002_b8b5536ec4319928.txt,
"Scaling and Performance" and "Cost and Token Economics"): 13B-class replicas on 40 GB GPUs,
80 sequences per replica at 0.75 utilisation, 20 req/s baseline with bursts to 200 req/s,
7.0 s occupancy, $2.80 per GPU-hour, TTFT SLA 4 s; five policies.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from agent.clock import ManualClock
from agent.frontdoor.admission import AdmissionQueue
from agent.frontdoor.router import Router
from agent.sim.cost import summarise
from agent.sim.events import RunRecord, Simulation
from agent.sim.fleet import Fleet, FleetConfig, StartupTimes
from agent.sim.trace import Workload, mix, synthetic

MODEL = "m"


def run_workload(workload: Workload, cfg: FleetConfig, make_controller, *, max_wait_s: float,
                 sla_s: float, initial_replicas: int = 0, max_depth: int = 1_000_000,
                 seed: int = 0, end_s: float | None = None, progress: bool = False,
                 clock: ManualClock | None = None) -> tuple[dict, RunRecord, Simulation]:
    """One run on fresh production objects: a ManualClock, an ``AdmissionQueue``, a
    ``Router``, a :class:`Fleet` and the controller ``make_controller(cfg)`` builds
    (it receives the fleet config and may hold the fleet through ``sim.fleet``)."""
    clock = clock or ManualClock()
    router = Router()
    queue = AdmissionQueue(cfg.model, clock=clock, max_depth=max_depth, max_wait_s=max_wait_s)
    fleet = Fleet(cfg, router=router, clock=clock, schedule=None,
                  rng=np.random.default_rng(seed + 1))
    sim = Simulation(workload, clock=clock, queue=queue, router=router, fleet=fleet,
                     controller=make_controller(cfg, clock, fleet), model=cfg.model,
                     max_wait_s=max_wait_s, end_s=end_s)
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
    common = dict(step_s=1.0, occupancy_s=shape.call_s, prefill_s=0.0, need_tokens=1, rng=rng,
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
                          hi: float = 0.6, tol: float = 0.005) -> float | None:
    """Smallest buffer (fraction) with zero dropped calls, by bisection to ``tol``.

    None when even ``hi`` drops calls.  Assumes drops fall as the buffer grows (checked at
    both ends)."""
    if run_spike_once(workload, shape, cold_start_s, hi)[0]["dropped"]:
        return None
    lo_b = 0.0
    if not run_spike_once(workload, shape, cold_start_s, lo_b)[0]["dropped"]:
        return 0.0
    while hi - lo_b > tol:
        mid = (lo_b + hi) / 2
        if run_spike_once(workload, shape, cold_start_s, mid)[0]["dropped"]:
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
    sweep, series = [], []
    items = cold_starts_s
    if progress:
        from tqdm import tqdm
        items = tqdm(cold_starts_s, desc="spike sweep", unit="cold-start")
    for cs in items:
        at10, rec = run_spike_once(w, shape, cs, 0.10)
        sweep.append({"cold_start_s": cs,
                      "min_buffer_pct_zero_drops": _pct(min_buffer_zero_drops(w, shape, cs)),
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
            "wall_s": wall, "sim_wall_s_per_sim_hour": None}


def _pct(x: float | None) -> float | None:
    return None if x is None else round(100.0 * x, 2)
