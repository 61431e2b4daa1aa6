"""Warm-pool sizing: Little's law for replicas, and the breakeven keep-alive.

The formulas (docs/architecture.md, "Sizing"):

- "Scaling and Performance": sequences in flight = rate x occupancy (Little's law);
  replicas = ceil(in flight / (concurrent sequences per replica x target utilisation)).
  Worked example: 20 req/s x 7.0 s = 140 in flight, ceil(140 / (80 x 0.75)) = 3;
  200 req/s -> 1,400 in flight -> 24. Concurrent sequences per replica come from the
  replica's KV capacity: 72,089 tokens / 900 tokens per sequence = ~80.
- Capacity from measured rates (docs/architecture.md): with a replica's measured speed (agent/speed.py) the sequences
  per replica are its sustainable concurrency at the TTFT SLO, not its KV slots, and the
  rate one replica serves is ``SpeedProfile.service_rps`` at that concurrency; replicas =
  ``ceil(rate / (service_rps * utilisation))`` (:func:`replicas_for_rate`), which is
  Little's law with occupancy = one request's engine time at that batch.
- "Optimal Keep-Alive Window": arrivals are Poisson with rate lambda; keeping a replica
  warm t more seconds costs ``gpu_cost_per_s * t`` and saves ``penalty * P(arrival <= t)``;
  the breakeven sets the marginal cost equal to the marginal saving,
  ``gpu_cost_per_s = penalty * lambda * exp(-lambda * t)``, so
  ``t* = -ln(gpu_cost_per_s / (penalty * lambda)) / lambda``, and 0 when that ratio >= 1.
"""

from __future__ import annotations

import math

from agent.errors import ConfigError
from agent.speed import SpeedProfile
from agent.throughput import BacklogCapacity

# Floating-point slack for the ceiling: 140 / 60 must not become 2.3333334 -> fine, but
# 120 / 60 computed as 2.0000000000000004 must stay 2.
_CEIL_SLACK = 1e-9


def _require(name: str, value: float, ok: bool, limit: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value} is out of range; limit is {limit}",
                          name=name, value=value, limit=limit)


def seqs_per_replica(kv_capacity_tokens: int, mean_context_tokens: float) -> int:
    """Concurrent sequences one replica holds: ``floor(kv_capacity_tokens / mean_context_tokens)``.

    Design document: 72,089 tokens / 900 tokens = 80. Raises ConfigError for a context <= 0
    or a negative capacity.
    """
    _require("kv_capacity_tokens", kv_capacity_tokens, kv_capacity_tokens >= 0, ">= 0")
    _require("mean_context_tokens", mean_context_tokens, mean_context_tokens > 0, "> 0")
    return int(kv_capacity_tokens // mean_context_tokens)


def target_replicas(rate_rps: float, occupancy_s: float, seqs_per_replica: int,
                    utilisation: float, min_replicas: int, max_replicas: int) -> int:
    """Replicas needed for ``rate_rps`` by Little's law, clamped to [min_replicas, max_replicas].

    ``ceil(rate_rps * occupancy_s / (seqs_per_replica * utilisation))``. A NaN, infinite or
    negative rate counts as 0 (the clamp still applies). Raises ConfigError for
    occupancy_s <= 0, seqs_per_replica < 1, utilisation outside (0, 1], min < 0 or max < min.
    """
    _require("occupancy_s", occupancy_s, occupancy_s > 0 and math.isfinite(occupancy_s), "> 0")
    _require("seqs_per_replica", seqs_per_replica, seqs_per_replica >= 1, ">= 1")
    _require("utilisation", utilisation, 0.0 < utilisation <= 1.0, "0 < u <= 1")
    _require("min_replicas", min_replicas, min_replicas >= 0, ">= 0")
    _require("max_replicas", max_replicas, max_replicas >= min_replicas,
             f">= min_replicas ({min_replicas})")
    rate = float(rate_rps)
    if not math.isfinite(rate) or rate < 0.0:
        rate = 0.0
    in_flight = rate * occupancy_s
    raw = in_flight / (seqs_per_replica * utilisation)
    need = math.ceil(raw - _CEIL_SLACK) if raw > _CEIL_SLACK else 0
    return max(min_replicas, min(max_replicas, need))


def replicas_for_rate(rate_rps: float, profile: SpeedProfile, *, ttft_slo_s: float,
                      mean_prompt_tokens: float, mean_gen_tokens: float, max_seqs: int,
                      utilisation: float, min_replicas: int, max_replicas: int,
                      sustained: BacklogCapacity | None = None) -> int:
    """Replicas for ``rate_rps`` from a measured :class:`~agent.speed.SpeedProfile`.

    Per replica, the rate one replica serves: what a replica sustained while backlogged
    when that was measured (``sustained``, agent/throughput.py, converted to the mean
    lengths by the profile), else B = ``profile.sustainable_concurrency(ttft_slo_s,
    mean_prompt_tokens, mean_gen_tokens, max_seqs)`` and the rate at that batch,
    ``profile.service_rps(mean_prompt_tokens, mean_gen_tokens, B)``; then
    :func:`target_replicas` with occupancy ``1 / rate`` and one "sequence" per replica
    (a replica is a server of that rate).  Same clamps and errors as
    :func:`target_replicas`; ConfigError for ``max_seqs`` < 1.
    """
    _require("max_seqs", max_seqs, max_seqs >= 1, ">= 1")
    if sustained is not None:
        per_replica_rps = sustained.rps_at(profile, mean_prompt_tokens, mean_gen_tokens)
        return target_replicas(rate_rps, 1.0 / per_replica_rps, 1, utilisation, min_replicas,
                               max_replicas)
    batch = profile.sustainable_concurrency(ttft_slo_s, mean_prompt_tokens, mean_gen_tokens,
                                            max_seqs)
    per_replica_rps = profile.service_rps(mean_prompt_tokens, mean_gen_tokens, batch)
    return target_replicas(rate_rps, 1.0 / per_replica_rps, 1, utilisation, min_replicas,
                           max_replicas)


def breakeven_keepalive_s(idle_cost_per_s: float, cold_start_penalty_cost: float,
                          arrival_rate_rps: float) -> float:
    """Idle time after the last request beyond which keeping a replica is no longer worth it.

    ``t* = -ln(c / (P * lambda)) / lambda`` with c = ``idle_cost_per_s`` (money per second
    idle), P = ``cold_start_penalty_cost`` (money per cold start avoided), lambda =
    ``arrival_rate_rps``; 0 when ``c >= P * lambda`` or when lambda is 0 (nothing to wait
    for). Raises ConfigError for a negative cost or penalty.
    """
    _require("idle_cost_per_s", idle_cost_per_s, idle_cost_per_s >= 0, ">= 0")
    _require("cold_start_penalty_cost", cold_start_penalty_cost, cold_start_penalty_cost >= 0,
             ">= 0")
    lam = float(arrival_rate_rps)
    if not math.isfinite(lam) or lam <= 0.0 or cold_start_penalty_cost == 0.0:
        return 0.0
    if idle_cost_per_s == 0.0:
        return math.inf
    ratio = idle_cost_per_s / (cold_start_penalty_cost * lam)
    if ratio >= 1.0:
        return 0.0
    return -math.log(ratio) / lam
