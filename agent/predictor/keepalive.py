"""Keep-alive per model: how long an idle replica stays warm, then suspended, then stops.

Each tier down is a breakeven decision, recomputed every tick.  Once the model has idle gaps
on record (:class:`IdleGaps`) the breakeven is read from their distribution
(:func:`gap_breakeven_s`: the keep-alive that minimises the expected idle cost plus cold-start
penalty over the observed gaps); before any, from the observed arrival rate under a Poisson
assumption (``sizing.breakeven_keepalive_s``: docs/architecture.md, "Sizing", breakeven
keep-alive):

- warm -> suspended: staying warm costs ``gpu_cost_per_s - suspended_cost_per_s`` more per
  second and avoids a resume (``resume_s``);
- suspended -> stopped: staying suspended costs ``suspended_cost_per_s`` and avoids the
  difference between a snapshot restore (``restore_s``) and a resume;
- without the suspended tier (no CUDA checkpoint driver), warm -> stopped directly:
  ``gpu_cost_per_s`` against a restore.

The penalty of a cold start lasting ``d`` seconds is what it costs: the GPU time the
restore burns plus the waiting it inflicts, ``d * (gpu_cost_per_s + wait_cost_per_s *
max(1, lambda * d))`` (at least one request waits the whole ``d``; at rate lambda about
``lambda * d`` do). ``wait_cost_per_s`` is the configured price of one request waiting one
second (an SLA figure), ``gpu_cost_per_s`` the GPU price ($2.80/GPU-hour in the cost model,
docs/architecture.md = 2.80 / 3600 per second).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from agent.errors import ConfigError
from agent.predictor.sizing import breakeven_keepalive_s

GPU_COST_PER_S_DEFAULT = 2.80 / 3600.0   # $2.80/GPU-hour (docs/architecture.md, "Cost model")


@dataclass(frozen=True)
class KeepAliveCosts:
    """Prices (money per second) and measured delays (seconds) for the keep-alive.

    ``resume_s`` is None where the suspended tier does not exist (CPU nodes, old drivers).
    """

    gpu_cost_per_s: float = GPU_COST_PER_S_DEFAULT
    suspended_cost_per_s: float = GPU_COST_PER_S_DEFAULT / 20.0   # host RAM only
    wait_cost_per_s: float = 0.01
    restore_s: float = 3.6      # a 13B snapshot restore (docs/architecture.md, "Cost model")
    resume_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("gpu_cost_per_s", "suspended_cost_per_s", "wait_cost_per_s", "restore_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"KeepAliveCosts: {name}={value} is out of range; limit is >= 0",
                                  name=name, value=value, limit=">= 0")
        if self.resume_s is not None and not (0 <= self.resume_s <= self.restore_s):
            raise ConfigError(
                f"KeepAliveCosts: resume_s={self.resume_s} is out of range; limit is "
                f"0 <= resume_s <= restore_s ({self.restore_s})",
                name="resume_s", value=self.resume_s, limit=self.restore_s)
        if self.suspended_cost_per_s > self.gpu_cost_per_s:
            raise ConfigError(
                f"KeepAliveCosts: suspended_cost_per_s={self.suspended_cost_per_s} exceeds "
                f"gpu_cost_per_s={self.gpu_cost_per_s}",
                name="suspended_cost_per_s", value=self.suspended_cost_per_s,
                limit=self.gpu_cost_per_s)


def penalty_cost(delay_s: float, rate_rps: float, costs: KeepAliveCosts) -> float:
    """Money lost to one cold start of ``delay_s``: ``d * (gpu + wait * max(1, lambda * d))``."""
    rate = rate_rps if math.isfinite(rate_rps) and rate_rps > 0 else 0.0
    waiting = max(1.0, rate * delay_s)
    return delay_s * (costs.gpu_cost_per_s + costs.wait_cost_per_s * waiting)


@dataclass(frozen=True)
class KeepAlivePlan:
    """Idle seconds (since the last request) at which a replica drops a tier.

    ``warm_s``: stop being warm after this much idle time. ``stop_s``: stop entirely (>=
    ``warm_s``); the replica is suspended in between when ``stop_s > warm_s``.
    """

    warm_s: float
    stop_s: float

    def tier(self, idle_s: float) -> str:
        """``"warm"``, ``"suspended"`` or ``"stopped"`` for a replica idle ``idle_s`` seconds."""
        if idle_s < self.warm_s:
            return "warm"
        if idle_s < self.stop_s:
            return "suspended"
        return "stopped"

    @property
    def release_tier(self) -> str:
        """Where a replica goes when it stops being warm: ``"suspend"`` or ``"stop"``."""
        return "suspend" if self.stop_s > self.warm_s else "stop"


def gap_breakeven_s(gaps_s: Sequence[float], idle_cost_per_s: float,
                    penalty: float) -> float:
    """The keep-alive ``T`` (s) that minimises the expected cost of one idle gap over the
    observed gaps ``gaps_s`` (seconds, any order, at least one):

        C(T) = idle_cost_per_s * mean(min(g, T)) + penalty * share(g > T)

    A gap no longer than ``T`` is bridged warm (its idle seconds are paid); a longer one pays
    ``T`` idle seconds and then the cold-start ``penalty`` (money).  This is the ski-rental
    (rent-or-buy) threshold chosen against the input distribution rather than the worst case:
    A. R. Karlin, K. Li, M. S. Manasse, S. Owicki, "Empirical Studies of Competitive Spinning
    for a Shared-Memory Multiprocessor" (SOSP 1991), which sets a spin-then-block threshold
    from the observed distribution of waiting times in the same way (spinning = staying warm,
    blocking = releasing and paying the restore).  ``C`` is linear and increasing between
    consecutive gap lengths and drops at each, so its minimum lies at 0 or at one of the gaps;
    ties go to the longer keep-alive (fewer cold starts at the same cost).  With every gap
    longer than ``penalty / idle_cost_per_s`` (the deterministic breakeven) the answer is 0;
    with every gap shorter, the longest gap: a steady stream keeps its replica.

    Raises :class:`ConfigError` for no gaps, a negative or non-finite gap, cost or penalty.
    """
    for name, value in (("idle_cost_per_s", idle_cost_per_s), ("penalty", penalty)):
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"gap_breakeven_s: {name}={value}; limit is >= 0 and finite",
                              name=name, value=value, limit=">= 0")
    ordered = sorted(float(g) for g in gaps_s)
    if not ordered:
        raise ConfigError("gap_breakeven_s: no idle gaps; limit is at least one",
                          name="gaps_s", value=0, limit=1)
    if not (ordered[0] >= 0 and math.isfinite(ordered[-1])):
        bad = ordered[0] if ordered[0] < 0 else ordered[-1]
        raise ConfigError(f"gap_breakeven_s: gap {bad}; limit is >= 0 and finite",
                          name="gaps_s", value=bad, limit=">= 0")
    n = len(ordered)
    best_t, best_cost = 0.0, penalty * sum(1 for g in ordered if g > 0)
    bridged = 0.0      # idle seconds of the gaps no longer than the candidate
    for k, t in enumerate(ordered):
        bridged += t
        if k + 1 < n and ordered[k + 1] == t:
            continue   # the candidate is the last of equal gaps
        longer = n - k - 1
        cost = idle_cost_per_s * (bridged + longer * t) + penalty * longer
        if cost <= best_cost:
            best_t, best_cost = t, cost
    return best_t


def plan_keepalive(rate_rps: float, costs: KeepAliveCosts,
                   gaps_s: Sequence[float] = ()) -> KeepAlivePlan:
    """The keep-alive ladder for an arrival rate ``rate_rps`` (req/s) under ``costs``.

    With observed idle gaps ``gaps_s`` (seconds) each tier's breakeven is read from them
    (:func:`gap_breakeven_s`); without, from the Poisson breakeven at ``rate_rps``.  The
    cold-start penalties are priced at ``rate_rps`` either way (:func:`penalty_cost`)."""
    restore_pen = penalty_cost(costs.restore_s, rate_rps, costs)

    def breakeven(idle_cost: float, pen: float) -> float:
        if gaps_s:
            return gap_breakeven_s(gaps_s, idle_cost, pen)
        return breakeven_keepalive_s(idle_cost, pen, rate_rps)

    if costs.resume_s is None:
        warm = breakeven(costs.gpu_cost_per_s, restore_pen)
        return KeepAlivePlan(warm_s=warm, stop_s=warm)
    resume_pen = penalty_cost(costs.resume_s, rate_rps, costs)
    warm = breakeven(costs.gpu_cost_per_s - costs.suspended_cost_per_s, resume_pen)
    suspended = breakeven(costs.suspended_cost_per_s, max(0.0, restore_pen - resume_pen))
    return KeepAlivePlan(warm_s=warm, stop_s=max(warm, suspended))


class IdleGaps:
    """Recent idle gaps of one model (seconds between a request and the next, where at least
    one step in between saw none) and their quantiles: the observed idle-time distribution
    that an SLO-aware keep-alive is read from, rather than a Poisson assumption.

    Shahrad et al., "Serverless in the Wild" (USENIX ATC 2020, the hybrid histogram policy):
    keep an instance alive for the 99th percentile of the application's idle times, so that
    about 1 % of idle periods end in a cold start, whatever the arrival process.  Gaps older
    than ``window_s`` or beyond the last ``max_gaps`` are forgotten (the distribution follows
    the traffic); a gap longer than ``window_s`` is kept as ``window_s`` (the histogram's
    range: no keep-alive is ever longer).  Raises :class:`ConfigError` for a window that is
    not > 0 or ``max_gaps`` < 1.
    """

    def __init__(self, window_s: float, max_gaps: int = 512) -> None:
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ConfigError(f"IdleGaps: window_s={window_s}; limit is > 0", name="window_s",
                              value=window_s, limit="> 0")
        if max_gaps < 1:
            raise ConfigError(f"IdleGaps: max_gaps={max_gaps}; limit is >= 1",
                              name="max_gaps", value=max_gaps, limit=1)
        self.window_s = float(window_s)
        self._gaps: deque[tuple[float, float]] = deque(maxlen=max_gaps)  # (ended at, gap)

    def __len__(self) -> int:
        return len(self._gaps)

    def record(self, gap_s: float, now_s: float) -> None:
        """One idle gap of ``gap_s`` seconds that ended at ``now_s`` (clock seconds); a gap or
        an end time that is not a finite number (NaN, a bool) is no reading and is dropped."""
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in (gap_s, now_s)) and gap_s > 0:
            self._gaps.append((float(now_s), min(float(gap_s), self.window_s)))

    def values(self, now_s: float) -> list[float]:
        """The gaps (seconds, in the order they ended) that ended within ``window_s`` of
        ``now_s``.  Gaps are forgotten by when they ended, not by arrival order, so a clock
        that jumped forward and back keeps none past the window; one that ended after
        ``now_s`` is kept but not yet counted."""
        old = [i for i, (end, _) in enumerate(self._gaps) if now_s - end > self.window_s]
        for i in reversed(old):
            del self._gaps[i]
        return [g for end, g in self._gaps if end <= now_s]

    def quantile(self, q: float, now_s: float) -> float | None:
        """The ``q`` quantile (nearest rank, 0 < q <= 1) of :meth:`values`; None when there
        are none."""
        ordered = sorted(self.values(now_s))
        if not ordered:
            return None
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
