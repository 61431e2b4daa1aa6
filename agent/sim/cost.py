"""Capacity and cost arithmetic, and the numbers a run reports.

Formulas and worked figures are those of docs/architecture.md ("Sizing", "Cost model"):

- "Scaling and Performance": KV bytes per token ``2 * layers * kv_heads * head_dim *
  dtype_bytes`` (2 * 40 * 8 * 128 * 2 = 163,840 B = 160 KB); KV headroom ``gpu - weights -
  overhead`` (40 - 26 - 3 = 11 GB, written there as 11,534,336 KB, i.e. binary units); token
  capacity 11,534,336 KB / 160 KB = 72,089; sequences per replica 72,089 / 900 = ~80.
- "Cost and Token Economics": GPU-hours per day, cost per day at $2.80 per GPU-hour, cost per
  1,000 requests.  The document divides each day's cost by the baseline volume only,
  20 req/s * 86,400 s = 1,728,000 requests ($1,613 / 1,728 = $0.93); :data:`DOC_REQUESTS_PER_DAY`.
"""

from __future__ import annotations

import math

import numpy as np

from agent.errors import ConfigError

PRICE_PER_GPU_HOUR = 2.80
DOC_REQUESTS_PER_DAY = 20 * 86_400
# The reference table of the cost model (docs/architecture.md, "Cost model": GPU-hours per day
# of a 13B fleet at 20 req/s with 200 req/s bursts), for printing beside ours.
DOC_COST_TABLE = {
    "always_on": {"gpu_hours_per_day": 576, "cost_per_day": 1613, "cost_per_1000_requests": 0.93,
                  "sla_compliance": 1.0},
    "scale_to_zero": {"gpu_hours_per_day": 480, "cost_per_day": 1344,
                      "cost_per_1000_requests": 0.78, "sla_compliance": 1.0},
    "snapshot_reactive": {"gpu_hours_per_day": 114, "cost_per_day": 319,
                          "cost_per_1000_requests": 0.18, "sla_compliance": 0.97},
    "snapshot_predictive": {"gpu_hours_per_day": 126, "cost_per_day": 353,
                            "cost_per_1000_requests": 0.20, "sla_compliance": 0.995},
}


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V for one token across all layers: ``2 * layers * kv_heads * head_dim * dtype_bytes``."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_capacity_tokens(gpu_gib: float, weights_gib: float, overhead_gib: float,
                       bytes_per_token: int) -> int:
    """Tokens of KV cache that fit beside the weights: ``floor(headroom / bytes_per_token)``.

    Raises :class:`ConfigError` when the weights and overhead do not fit in the GPU.
    """
    headroom = (gpu_gib - weights_gib - overhead_gib) * (1 << 30)
    if headroom <= 0:
        raise ConfigError(f"gpu_gib={gpu_gib} leaves no KV headroom after weights "
                          f"{weights_gib} GiB + overhead {overhead_gib} GiB",
                          name="gpu_gib", value=gpu_gib, limit=weights_gib + overhead_gib)
    return int(headroom // bytes_per_token)


def gpu_hours_per_day(gpu_s: float, sim_s: float) -> float:
    """Scale GPU-seconds billed over ``sim_s`` simulated seconds to GPU-hours per 24 h."""
    if sim_s <= 0:
        raise ConfigError(f"sim_s={sim_s} must be > 0", name="sim_s", value=sim_s, limit="> 0")
    return gpu_s / 3600.0 * 86_400.0 / sim_s


def cost_per_1000(gpu_hours: float, requests: float,
                  price_per_gpu_hour: float = PRICE_PER_GPU_HOUR) -> float:
    """Dollars per 1,000 requests: ``gpu_hours * price / requests * 1000`` (inf for 0 requests)."""
    if requests <= 0:
        return math.inf
    return gpu_hours * price_per_gpu_hour / requests * 1000.0


def percentile_ms(values_s: np.ndarray, q: float) -> float | None:
    """The ``q``-th percentile of seconds ``values_s`` in milliseconds (None when empty)."""
    v = values_s[~np.isnan(values_s)]
    return None if v.size == 0 else float(np.percentile(v, q) * 1000.0)


def summarise(rec, workload, *, sla_s: float, seqs_per_replica: int,
              price_per_gpu_hour: float = PRICE_PER_GPU_HOUR) -> dict:
    """Every number one run reports (a JSON-ready dict).

    ``sla_compliance``: share of all requests whose TTFT is within their SLO (``rec.slo_s``
    per request when the run had one, agent/slo.py; else ``sla_s``); shed, expired and
    never-served requests count as misses, and ``late`` counts those served after it.  ``idle_gpu_hours``: billed GPU-hours minus
    the slot-hours requests used (``busy_slot_s / seqs_per_replica``).  ``peak_shortfall``:
    the worst instant (sampled each tick) of offered concurrency (requests that would be in
    flight had none waited) minus warm slots, and ``shortage_minutes`` the time it was > 0.
    """
    from agent.sim.events import EXPIRED, PATH_QUEUED, PATH_WARM, SERVED, SHED

    n = len(workload)
    status, ttft = rec.status, rec.ttft_s
    served = int(np.count_nonzero(status == SERVED))
    gpu_h = rec.gpu_s / 3600.0
    busy_h = rec.busy_slot_s / seqs_per_replica / 3600.0
    slo = rec.slo_s if getattr(rec, "slo_s", None) is not None else np.full(n, sla_s)
    within = int(np.count_nonzero(ttft <= slo))
    cold = rec.cold if getattr(rec, "cold", None) is not None else np.zeros(n, dtype=bool)
    demand = workload.offered_concurrency(rec.tick_t_s + 0.0) if len(rec.tick_t_s) else np.zeros(0)
    short = np.maximum(0, demand - rec.warm_replicas.astype(np.int64) * seqs_per_replica)
    tick_s = float(rec.tick_t_s[1] - rec.tick_t_s[0]) if len(rec.tick_t_s) > 1 else 1.0
    out = {
        "requests": n,
        "served": served,
        "queued": int(rec.queued),
        "shed": int(np.count_nonzero(status == SHED)),
        "shed_too_large": int(getattr(rec, "too_large", 0)),
        "expired": int(np.count_nonzero(status == EXPIRED)),
        "unfinished": int(np.count_nonzero(status == 0)),
        "ttft_ms": {
            name: {"p50": percentile_ms(ttft[rec.path == code], 50),
                   "p99": percentile_ms(ttft[rec.path == code], 99),
                   "count": int(np.count_nonzero((rec.path == code) & (status == SERVED)))}
            for name, code in (("warm", PATH_WARM), ("queued", PATH_QUEUED))
        },
        "sla_s": sla_s if getattr(rec, "slo_s", None) is None else "per request",
        "sla_compliance": within / n if n else 1.0,
        # served, but after the SLO: counted as misses above, never hidden
        "late": int(np.count_nonzero((status == SERVED) & ~(ttft <= slo))),
        "cold_arrivals": int(np.count_nonzero(cold)),
        "cold_within_slo": int(np.count_nonzero(cold & (ttft <= slo))),
        "sim_hours": rec.sim_s / 3600.0,
        "gpu_hours": gpu_h,
        "idle_gpu_hours": max(0.0, gpu_h - busy_h),
        "suspended_replica_hours": rec.suspended_s / 3600.0,
        "gpu_hours_per_day": gpu_hours_per_day(rec.gpu_s, rec.sim_s) if rec.sim_s > 0 else 0.0,
        "price_per_gpu_hour": price_per_gpu_hour,
        "cost_per_1000_requests": cost_per_1000(gpu_h, n, price_per_gpu_hour),
        "peak_shortfall": int(short.max()) if short.size else 0,
        "shortage_minutes": float(np.count_nonzero(short) * tick_s / 60.0),
        "starts_by_tier": rec.starts_by_tier,
        "wall_s": rec.wall_s,
        "sim_wall_s_per_sim_hour": rec.wall_s / (rec.sim_s / 3600.0) if rec.sim_s > 0 else None,
    }
    return out
