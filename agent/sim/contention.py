"""How fast replicas serve when the stack's own process shares the node's cores with them.

On a CPU node the replicas are not alone: the front door, the node agent and the predictor
(and, in a replay, the load generator) run in a process of their own that spends CPU on
every request it handles.  While the replicas have work queued they are compute-bound, so
that CPU comes out of theirs.  With ``C`` usable cores, ``N`` replicas of ``t`` torch threads
that each serve ``mu`` requests/s on cores of their own (``t / mu`` core-seconds a request),
and ``c`` core-seconds of the stack's CPU per request, the node's throughput ``X`` is bound by
its cores, ``X * (t / mu + c) <= C``, and by the replicas, ``X <= N * mu``, so (the
utilisation law, ``U = X * D`` for each resource of service demand ``D``; Lazowska et al.,
*Quantitative System Performance*, ch. 3) each replica serves at

    s = X / (N * mu) = min(1, C / (N * t + N * mu * c))

of its speed alone.  On two cores with two one-thread replicas at 25 requests/s and 5 ms of
the stack's CPU a request, ``s = 1 / (1 + 25 * 0.005) = 0.89``: the node sustains 11 % less
than its replicas' own speed meters say.  The simulator serves at ``s`` times the measured
speed (:func:`slowed`) while the node is saturated; below saturation the slowdown is smaller
than this bound (the cores are not all busy), which makes a simulated lone request's TTFT a
few percent pessimistic.
"""

from __future__ import annotations

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
                      cpu_s_per_request: float) -> float:
    """``s`` of the module docstring: the fraction of its own speed each of ``replicas``
    replicas (``threads`` torch threads each, ``service_rps`` requests/s alone) serves at on
    ``cores`` cores when the stack's process spends ``cpu_s_per_request`` core-seconds on
    every request; in (0, 1].  ConfigError for counts < 1 or rates that are not finite and
    > 0 (``cpu_s_per_request`` >= 0)."""
    for name, v in (("cores", cores), ("replicas", replicas), ("threads", threads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name}={v!r}; limit is an integer >= 1", name=name, value=v,
                              limit=1)
    mu = _check("service_rps", service_rps, 0.0, strict=True)
    c = _check("cpu_s_per_request", cpu_s_per_request, 0.0, strict=False)
    return min(1.0, cores / (replicas * threads + replicas * mu * c))


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
