"""How fast replicas serve when the stack's own process shares the node's cores with them.

On a CPU node the replicas are not alone: the front door, the node agent and the predictor
(and, in a replay, the load generator) run in a process of their own that spends CPU on
every request it handles, and some whatever the traffic (the predictor's ticks, registry
polls, the sampler).  While the replicas have work queued they are compute-bound, so that
CPU comes out of theirs.  With ``C`` usable cores, ``b`` cores the stack spends in the
background, ``N`` replicas of ``t`` torch threads that each serve ``mu`` requests/s on cores
of their own (``t / mu`` core-seconds a request), and ``c`` core-seconds of the stack's CPU
per request, the node's throughput ``X`` is bound by its cores, ``X * (t / mu + c) <= C - b``,
and by the replicas, ``X <= N * mu``, so (the utilisation law, ``U = X * D`` for each
resource of service demand ``D``; Lazowska et al., *Quantitative System Performance*, ch. 3)
each replica serves at

    s = X / (N * mu) = min(1, (C - b) / (N * t + N * mu * c))

of its speed alone.  ``b`` and ``c`` must be told apart: a sparse window (45 requests in
eight minutes) charged its background CPU to each request as ``c`` made every simulated
replica a third slower than the live ones were.  On two cores with two one-thread replicas at 25 requests/s and 5 ms of
the stack's CPU a request, ``s = 1 / (1 + 25 * 0.005) = 0.89``: the node sustains 11 % less
than its replicas' own speed meters say.  The simulator serves at ``s`` times the measured
speed (:func:`slowed`) while the node is saturated; below saturation the slowdown is smaller
than this bound (the cores are not all busy), which makes a simulated lone request's TTFT a
few percent pessimistic.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import replace

from agent.errors import ConfigError
from agent.speed import SpeedProfile


def _check(name: str, value: float, low: float, strict: bool) -> float:
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) \
        or not math.isfinite(value) or (value <= low if strict else value < low)
    if bad:
        limit = f"{'>' if strict else '>='} {low:g} and finite"
        raise ConfigError(f"{name}={value!r}; limit is {limit}", name=name, value=value,
                          limit=limit)
    return float(value)


def shared_core_speed(cores: int, replicas: int, threads: int, service_rps: float,
                      cpu_s_per_request: float, background_cores: float = 0.0) -> float:
    """``s`` of the module docstring: the fraction of its own speed each of ``replicas``
    replicas (``threads`` torch threads each, ``service_rps`` requests/s alone) serves at on
    ``cores`` cores when the stack's process spends ``cpu_s_per_request`` core-seconds on
    every request and ``background_cores`` cores whatever the traffic; in (0, 1].
    ConfigError for counts < 1, rates that are not finite and > 0 (``cpu_s_per_request``
    >= 0), or ``background_cores`` outside [0, cores)."""
    for name, v in (("cores", cores), ("replicas", replicas), ("threads", threads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r}; limit is an integer >= 1", name=name, value=v,
                              limit=1)
    mu = _check("service_rps", service_rps, 0.0, strict=True)
    c = _check("cpu_s_per_request", cpu_s_per_request, 0.0, strict=False)
    b = _check("background_cores", background_cores, 0.0, strict=False)
    if b >= cores:
        raise ConfigError(f"background_cores={background_cores!r}; limit is < cores ({cores})",
                          name="background_cores", value=background_cores, limit=cores)
    return min(1.0, (cores - b) / (replicas * threads + replicas * mu * c))


def background_cores(samples: list[tuple[float, float]],
                     busy: list[tuple[float, float]], *, min_bins: int = 10) -> float:
    """The cores a process spends while no request is in flight: the median CPU rate
    (core-seconds per second) over the intervals between consecutive ``samples`` (``(t_s,
    cpu_s)``, ascending, one clock for both) that overlap none of the ``busy`` spans
    (``(start_s, end_s)``, requests in flight and a margin after); 0.0 when fewer than
    ``min_bins`` such intervals exist (a window without quiet time tells ``b`` from ``c``
    apart no better than charging all to the requests).  The median, not the mean: a scale
    event between requests is not the background."""
    merged: list[list[float]] = []             # the busy spans, disjoint and in order
    for start, end in sorted(busy):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    ends = [end for _start, end in merged]
    rates = []
    for (t0, c0), (t1, c1) in itertools.pairwise(samples):
        if t1 <= t0:
            continue
        i = bisect.bisect_right(ends, t0)   # the first span ending after t0: the only one
        if i < len(merged) and merged[i][0] < t1:   # that can start before t1
            continue
        rates.append(max(0.0, (c1 - c0) / (t1 - t0)))
    if len(rates) < min_bins:
        return 0.0
    rates.sort()
    mid = len(rates) // 2
    return rates[mid] if len(rates) % 2 else (rates[mid - 1] + rates[mid]) / 2.0


def slowed(profile: SpeedProfile, speed: float) -> SpeedProfile:
    """``profile`` served at ``speed`` (0, 1] of itself (:func:`at_speed`).  ConfigError for a
    speed outside (0, 1]."""
    s = _check("speed", speed, 0.0, strict=True)
    if s > 1.0:
        raise ConfigError(f"speed={speed!r}; limit is <= 1", name="speed", value=speed,
                          limit="<= 1")
    return at_speed(profile, s)


def at_speed(profile: SpeedProfile, factor: float) -> SpeedProfile:
    """``profile`` running ``factor`` times as fast (> 0): every duration over it, the
    prefill rate times it.  ConfigError for a factor that is not a finite number > 0."""
    f = _check("factor", factor, 0.0, strict=True)
    return replace(profile, prefill_tokens_per_s=profile.prefill_tokens_per_s * f,
                   prefill_overhead_s=profile.prefill_overhead_s / f,
                   decode_base_s=profile.decode_base_s / f,
                   decode_per_seq_s=profile.decode_per_seq_s / f,
                   decode_per_ctx_token_s=profile.decode_per_ctx_token_s / f)
