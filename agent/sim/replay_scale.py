"""Scaling a trace window to one machine: one time compression and one token scale.

A trace from a production fleet (the Azure code trace: ~2,000-token prompts at ~2.5 req/s)
offers far more work than one small replica on a development machine serves, so a replay
changes two things and nothing else (bench/trace_replay.py, ``rewarm up --demo``):

- **time compression** ``speedup`` (trace seconds per wall second): every arrival time is
  divided by it, so the window's burst shape (which seconds are busy, which idle, by how
  much) is kept exactly, only faster;
- **token scale** ``token_scale`` (replay tokens per trace token): every prompt and output
  length is multiplied by it and rounded, at least 1 token each, and the pair is trimmed to
  the replica's ``max_tokens_per_request`` (its KV slot) by shortening the prompt.

Both come from the replica's measured :class:`~agent.speed.SpeedProfile` and the window's
own statistics, never from constants chosen for a file.  Define the offered load of a
replay as

    load(k, c) = arrival rate (wall) / capacity(k)
               = (N * c / window_s) * mean_i service_s(P_i(k), G_i(k), B(k))

where ``service_s`` is one request's seconds of the replica: ``1 / rps`` of what the replica
was measured to sustain while backlogged (agent/throughput.py, converted to the request's
lengths by the speed profile) where that was measured, else its engine seconds at the
replica's sustainable concurrency ``B(k)`` for the TTFT SLO
(``SpeedProfile.sustainable_concurrency`` at the scaled mean lengths; ``1 / service_s`` is
``SpeedProfile.service_rps``).  Then:

1. the compression that fits the window into the wall-time budget, ``c0 = window_s /
   wall_s``;
2. the token scale ``k`` with ``load(k, c0) = target`` (bisection on ``log k``; ``load`` is
   non-decreasing in ``k``), within ``[k_min, 1]`` (``k_min`` makes every length 1 token;
   1 is the trace's own lengths);
3. the compression corrected so the load is exactly the target at that ``k``:
   ``c = c0 * target / load(k, c0)`` (equal to ``c0`` unless the rounding of lengths or a
   bound of ``k`` moved it; at a bound the wall time is longer or shorter than asked, and
   :class:`ReplayScale` says so).

A sparse window (a trickle whose typical gap between requests is long enough for the stack
to scale to zero) loses what it tests when compressed into the budget: fifteen-minute gaps
become one minute, and the replay reports a saving real time would not show, or none.  With
``max_speedup`` (:func:`gap_keeping_speedup`: the largest compression that keeps the
window's median gap at least ``gap_floor_s`` wall seconds) the compression never exceeds it;
the replay then takes longer than the budget, offers less load than asked where the trace's
own lengths cannot make it up, and ``bound`` is ``"idle_gaps"``.
"""

from __future__ import annotations

import heapq
import math
import numbers
from dataclasses import asdict, dataclass

import numpy as np

from agent.errors import ConfigError
from agent.speed import SpeedProfile
from agent.throughput import BacklogCapacity


@dataclass(frozen=True)
class ReplayRequest:
    """One request to send ``at_s`` wall seconds after the replay starts.  Raises
    :class:`ConfigError` (the field, the value, the limit) for an ``at_s`` that is not a finite
    number >= 0 or token counts that are not integers >= 0 (a plan read from a file)."""

    at_s: float
    prompt_tokens: int
    output_tokens: int

    def __post_init__(self) -> None:
        at = self.at_s
        if isinstance(at, bool) or not isinstance(at, numbers.Real) or not (
                math.isfinite(at) and at >= 0):
            raise ConfigError(f"ReplayRequest.at_s={at!r}; limit is a finite number >= 0",
                              name="at_s", value=at, limit=0)
        for name in ("prompt_tokens", "output_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ConfigError(f"ReplayRequest.{name}={v!r}; limit is an integer >= 0",
                                  name=name, value=v, limit=0)


@dataclass(frozen=True)
class ReplayScale:
    """How a window was scaled (all derived; see the module docstring).

    ``speedup`` trace s per wall s; ``token_scale`` replay tokens per trace token; ``load``
    the offered load achieved (fraction of one replica); ``capacity_rps`` one replica's
    service rate at ``batch`` (its sustainable concurrency) for these lengths;
    ``offered_rps`` the wall arrival rate; ``mean_prompt_tokens``/``mean_output_tokens`` the
    scaled means; ``window_s`` trace seconds replayed, ``wall_s`` their wall duration;
    ``bound`` is ``""``, ``"min_tokens"`` (even 1-token requests overload at the asked wall
    time, so the replay is slower) or ``"trace_tokens"`` (the trace's own lengths underload
    it, so the replay is faster) or ``"idle_gaps"`` (the compression was held at
    ``max_speedup`` to keep a sparse window's gaps, so the replay is slower)."""

    speedup: float
    token_scale: float
    load: float
    capacity_rps: float
    offered_rps: float
    batch: int
    mean_prompt_tokens: float
    mean_output_tokens: float
    requests: int
    window_s: float
    wall_s: float
    bound: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def scale_lengths(context_tokens: np.ndarray, generated_tokens: np.ndarray, token_scale: float,
                  max_tokens_per_request: int) -> tuple[np.ndarray, np.ndarray]:
    """Trace lengths [N] -> replay (prompt, output) int64 [N]: ``max(1, round(k * n))`` each,
    the output at most ``max_tokens_per_request - 1`` and the prompt trimmed so that
    ``prompt + output <= max_tokens_per_request``."""
    if max_tokens_per_request < 2:
        raise ConfigError(f"max_tokens_per_request={max_tokens_per_request}; limit is >= 2",
                          name="max_tokens_per_request", value=max_tokens_per_request, limit=2)
    out = np.clip(np.rint(np.asarray(generated_tokens) * token_scale), 1,
                  max_tokens_per_request - 1).astype(np.int64)
    prompt = np.clip(np.rint(np.asarray(context_tokens) * token_scale), 1, None).astype(np.int64)
    return np.minimum(prompt, max_tokens_per_request - out), out


def gap_keeping_speedup(arrival_s: np.ndarray, gap_floor_s: float) -> float | None:
    """The largest compression (trace s per wall s) that keeps the median gap between
    consecutive arrivals of ``arrival_s`` [N] (trace seconds, sorted) at least
    ``gap_floor_s`` wall seconds, when the window is sparse: its own median gap is at least
    ``gap_floor_s``.  None for a dense window (its typical gap is no idle time worth keeping:
    the budget's compression applies) or fewer than two arrivals.  ConfigError for a floor
    that is not a finite number > 0."""
    if not (gap_floor_s > 0 and math.isfinite(gap_floor_s)):
        raise ConfigError(f"gap_keeping_speedup: gap_floor_s={gap_floor_s}; limit is a finite "
                          "number > 0", name="gap_floor_s", value=gap_floor_s, limit="> 0")
    a = np.asarray(arrival_s, dtype=np.float64)
    if a.size < 2:
        return None
    median = float(np.median(np.diff(a)))
    return median / gap_floor_s if median >= gap_floor_s else None


def _capacity(profile: SpeedProfile, prompt: np.ndarray, output: np.ndarray, *,
              ttft_slo_s: float, max_seqs: int,
              sustained: BacklogCapacity | None = None) -> tuple[float, int]:
    """(requests/s one replica serves, the batch it serves them at): what it sustained while
    backlogged (``sustained``, agent/throughput.py, each request's share converted to its
    lengths by the profile) when measured, else the profile's rate at its sustainable batch."""
    if sustained is not None:
        batch = max(1, round(sustained.batch))
        seconds = lambda p, o: 1.0 / sustained.rps_at(profile, p, o)  # noqa: E731
    else:
        batch = profile.sustainable_concurrency(ttft_slo_s, float(prompt.mean()),
                                                float(output.mean()), max_seqs)
        seconds = lambda p, o: profile.service_s(p, o, batch)  # noqa: E731
    # mean seconds per request, each at its own lengths; distinct (prompt, output) pairs are
    # few after scaling, so each is computed once
    pairs, counts = np.unique(np.stack([prompt, output]), axis=1, return_counts=True)
    total = sum(c * seconds(float(p), float(o))
                for (p, o), c in zip(pairs.T.tolist(), counts.tolist(), strict=True))
    service = total / int(prompt.shape[0])
    return 1.0 / service, batch


def fit_scale(context_tokens: np.ndarray, generated_tokens: np.ndarray, *, window_s: float,
              profile: SpeedProfile, load: float, wall_s: float, ttft_slo_s: float,
              max_seqs: int, max_tokens_per_request: int,
              max_speedup: float | None = None,
              sustained: BacklogCapacity | None = None) -> ReplayScale:
    """The :class:`ReplayScale` that makes a window of ``len(context_tokens)`` requests over
    ``window_s`` trace seconds offer ``load`` of one replica of ``profile`` in about
    ``wall_s`` wall seconds (module docstring), compressed at most ``max_speedup`` when given
    (:func:`gap_keeping_speedup`).  ``sustained``: the capacity the replica was measured to
    sustain while backlogged (agent/throughput.py); the load is then a fraction of that
    instead of the profile's estimate.  Raises ConfigError for an empty window or a
    ``load``/``wall_s``/``window_s``/``max_speedup`` that is not a finite number > 0."""
    if max_speedup is not None and not (max_speedup > 0 and math.isfinite(max_speedup)):
        raise ConfigError(f"fit_scale: max_speedup={max_speedup}; limit is a finite number > 0",
                          name="max_speedup", value=max_speedup, limit="> 0")
    for name, value in (("load", load), ("wall_s", wall_s), ("window_s", window_s),
                        ("ttft_slo_s", ttft_slo_s)):
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"fit_scale: {name}={value}; limit is a finite number > 0",
                              name=name, value=value, limit="> 0")
    ctx = np.asarray(context_tokens, dtype=np.float64)
    gen = np.asarray(generated_tokens, dtype=np.float64)
    n = int(ctx.shape[0])
    if n == 0:
        raise ConfigError("fit_scale: the window holds no request", name="requests", value=0,
                          limit=1)

    def load_at(k: float, c: float) -> tuple[float, float, int]:
        p, o = scale_lengths(ctx, gen, k, max_tokens_per_request)
        cap, batch = _capacity(profile, p, o, ttft_slo_s=ttft_slo_s, max_seqs=max_seqs,
                               sustained=sustained)
        return n * c / window_s / cap, cap, batch

    c0 = window_s / wall_s
    held = False
    if max_speedup is not None and c0 > max_speedup:
        c0, held = max_speedup, True
    k_min = 0.5 / max(1.0, float(max(ctx.max(), gen.max())))   # every length rounds to 1
    k_max = 1.0
    bound = ""
    if load_at(k_min, c0)[0] >= load:
        k, bound = k_min, "min_tokens"
    elif load_at(k_max, c0)[0] <= load:
        k, bound = k_max, "trace_tokens"
    else:
        lo, hi = math.log(k_min), math.log(k_max)
        for _ in range(60):
            mid = (lo + hi) / 2
            if load_at(math.exp(mid), c0)[0] < load:
                lo = mid
            else:
                hi = mid
        k = math.exp(lo)   # the largest scale whose load does not exceed the target
    rho, cap, batch = load_at(k, c0)
    c = c0 * load / rho
    if max_speedup is not None and c > max_speedup:
        c, held = max_speedup, True
    if held:
        bound = "idle_gaps"
    p, o = scale_lengths(ctx, gen, k, max_tokens_per_request)
    return ReplayScale(speedup=c, token_scale=k, load=n * c / window_s / cap, capacity_rps=cap,
                       offered_rps=n * c / window_s, batch=batch,
                       mean_prompt_tokens=float(p.mean()), mean_output_tokens=float(o.mean()),
                       requests=n, window_s=window_s, wall_s=window_s / c, bound=bound)


def fit_within_wall(context_tokens: np.ndarray, generated_tokens: np.ndarray, *,
                    wall_s: float, tolerance: float = 1.25,
                    **fit_kw) -> tuple[ReplayScale, np.ndarray]:
    """:func:`fit_scale`, kept near the ``wall_s`` budget for a window too busy for it: where
    even 1-token requests overload the replica at the budget's compression (``bound``
    ``"min_tokens"``, a replay longer than ``tolerance * wall_s``), the window is thinned to
    an evenly spaced subset of its requests (every m-th in arrival order, so busy seconds
    stay busy and idle ones idle, at a lower rate) as large as the budget allows, and fitted
    again.  Returns the scale and the indices of the requests kept (all of them unless
    thinned; ``scale.requests`` is their count)."""
    ctx = np.asarray(context_tokens)
    gen = np.asarray(generated_tokens)
    kept = np.arange(int(ctx.shape[0]))
    scale = fit_scale(ctx, gen, wall_s=wall_s, **fit_kw)
    for _ in range(8):   # the replay's length is about proportional to the requests kept
        if (scale.bound != "min_tokens" or scale.wall_s <= tolerance * wall_s
                or kept.size <= 1):
            break
        n = max(1, min(kept.size - 1, int(kept.size * wall_s / scale.wall_s)))
        kept = kept[np.round(np.linspace(0, kept.size - 1, n)).astype(np.int64)]
        scale = fit_scale(ctx[kept], gen[kept], wall_s=wall_s, **fit_kw)
    return scale, kept


def replay_requests(arrival_s: np.ndarray, context_tokens: np.ndarray,
                    generated_tokens: np.ndarray, scale: ReplayScale,
                    max_tokens_per_request: int) -> list[ReplayRequest]:
    """The window's requests at wall times ``arrival_s / speedup`` with scaled lengths."""
    p, o = scale_lengths(context_tokens, generated_tokens, scale.token_scale,
                         max_tokens_per_request)
    return [ReplayRequest(float(a) / scale.speedup, int(x), int(y))
            for a, x, y in zip(np.asarray(arrival_s), p, o, strict=True)]


def always_on_replicas(at_s: np.ndarray, capacity_rps: float, max_replicas: int,
                       bin_s: float = 10.0) -> int:
    """The replicas an always-on pool of this replica needs for the window's busiest
    ``bin_s`` seconds: ``ceil(peak rate / capacity_rps)``, at least 1, at most
    ``max_replicas`` (the simulator's always-on policy is sized the same way,
    agent/sim/scenarios.py ``trace_scenario``).  ``at_s`` [N] wall arrival times."""
    a = np.asarray(at_s, dtype=np.float64)
    if not a.size or not capacity_rps > 0:
        return 1
    peak_rps = float(np.bincount((a // bin_s).astype(np.int64)).max()) / bin_s
    return int(max(1, min(max_replicas, math.ceil(peak_rps / capacity_rps - 1e-9))))


def fluid_attainment(at_s: np.ndarray, service_s: np.ndarray, wait_slo_s: float,
                     servers: int = 1) -> float:
    """The share of requests ``servers`` always-on replicas can start within ``wait_slo_s``
    of arrival, at best: each request, in arrival order, takes the replica that frees first
    and holds it for its ``service_s`` (1 / the rate the replica sustains for its lengths:
    batching is in that rate), and one that would wait longer than ``wait_slo_s`` is refused
    at arrival and costs nothing (what deadline-bounded admission does).  A bound for any
    scheduler with that many replicas: it never idles while work waits, and it wastes no
    work on a late answer.  ``at_s`` [N] sorted arrival times and ``service_s`` [N], seconds;
    ``wait_slo_s`` the SLO beyond a request's own prefill (its warm base).  Raises
    ConfigError for ``servers`` < 1 or arrays of different lengths; 1.0 for no request."""
    a = np.asarray(at_s, dtype=np.float64)
    s = np.asarray(service_s, dtype=np.float64)
    if servers < 1 or a.shape != s.shape:
        raise ConfigError(f"fluid_attainment: servers={servers}, {a.shape[0]} arrivals and "
                          f"{s.shape[0]} service times; limit is >= 1 and equal lengths",
                          name="servers", value=servers, limit=1)
    if not a.size:
        return 1.0
    free = [float(a[0])] * servers      # when each replica is next free (a min-heap)
    met = 0
    for arrival, service in zip(a.tolist(), s.tolist(), strict=True):
        start = max(arrival, free[0])
        if start - arrival > wait_slo_s:
            continue
        met += 1
        heapq.heapreplace(free, start + service)
    return met / int(a.size)


def request_seconds(plan: list[ReplayRequest], profile: SpeedProfile,
                    sustained: BacklogCapacity | None, batch: int) -> np.ndarray:
    """Each planned request's share of one replica's time (s) [N]: ``1 / rps`` of what the
    replica sustained while backlogged, converted to its lengths, else its engine seconds at
    ``batch`` by the profile."""
    if sustained is not None:
        return np.array([1.0 / sustained.rps_at(profile, r.prompt_tokens, r.output_tokens)
                         for r in plan])
    return np.array([profile.service_s(r.prompt_tokens, r.output_tokens, batch) for r in plan])


ALWAYS_ON_TARGET = 0.99
"""The SLA attainment a replay scaled for an always-on replica gives it at best (the SLO is
a p99: :func:`fit_for_always_on`)."""
LOAD_STEP = 0.85   # each try offers this fraction of the one before


def fit_for_always_on(context_tokens: np.ndarray, generated_tokens: np.ndarray,
                      arrival_s: np.ndarray, *, load: float, wait_slo_s: float,
                      target: float = ALWAYS_ON_TARGET, tries: int = 24,
                      **fit_kw) -> tuple[ReplayScale, np.ndarray, float]:
    """:func:`fit_within_wall` at the largest load, ``load`` or less (each try
    :data:`LOAD_STEP` of the one before), at which one always-on replica can meet the SLO:
    :func:`fluid_attainment` with one replica at the capacity ``fit_kw`` gives (its
    ``sustained`` measurement when given) is at least ``target``.  So the window's bursts,
    not only its mean, fit one replica, and a comparison against it is fair.  Returns the
    scale, the kept indices and that attainment (of the last try when none reaches it)."""
    at = np.asarray(arrival_s, dtype=np.float64)
    tried = load
    for _ in range(max(1, tries)):
        scale, kept = fit_within_wall(context_tokens, generated_tokens, load=tried, **fit_kw)
        plan = replay_requests(at[kept], np.asarray(context_tokens)[kept],
                               np.asarray(generated_tokens)[kept], scale,
                               fit_kw["max_tokens_per_request"])
        seconds = request_seconds(plan, fit_kw["profile"], fit_kw.get("sustained"), scale.batch)
        got = fluid_attainment(np.array([r.at_s for r in plan]), seconds, wait_slo_s, 1)
        if got >= target:
            break
        tried *= LOAD_STEP
    return scale, kept, got
