"""A model's predictor policy (:class:`ModelPolicy`: forecaster, lead time, keep-alive
costs, sizing inputs, each checked on construction) and the two rules the loop applies
with it: when an idle replica is released (:func:`release_after_s`) and which lead times
are long enough (:func:`check_lead_time`).  The loop that runs them is
agent/predictor/loop.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from agent.errors import ConfigError
from agent.predictor.forecast import Forecaster, Holt, build_forecaster
from agent.predictor.keepalive import KeepAliveCosts, KeepAlivePlan
from agent.predictor.sizing import seqs_per_replica, target_replicas


@dataclass(frozen=True)
class ModelPolicy:
    """One model's sizing and timing configuration.

    Defaults follow docs/architecture.md's worked example ("Sizing": 7.0 s occupancy, 80
    sequences per replica, 0.75 utilisation, 15 s lead time, 3.6 s restore). Raises
    ConfigError when ``lead_time_s <= restore_p99_s + decision_latency_s`` (the forecast
    would be structurally too late), naming both numbers, or when a value is out of range.
    """

    model: str
    occupancy_s: float = 7.0
    seqs_per_replica: int = 80
    utilisation: float = 0.75
    min_replicas: int = 0
    max_replicas: int = 24
    lead_time_s: float = 15.0
    restore_p99_s: float = 3.6
    decision_latency_s: float = 1.0
    alpha: float = 0.1
    beta: float = 0.01
    phi: float = 0.9
    react_alpha: float = 0.5
    forecaster: str = "quantile_backstop"
    quantile: float = 0.9
    quantile_window_s: float = 60.0
    # seconds of arrivals the slow forecaster averages before it forecasts (InFlightRate,
    # forecast.py): Little's law's window, one occupancy; None = occupancy_s
    in_flight_window_s: float | None = None
    ttft_slo_s: float = 2.0
    # Sizing from a measured speed fills a replica to its sustainable concurrency: that batch
    # is already the SLO's limit, and the upper-quantile forecast is the headroom.
    speed_utilisation: float = 1.0
    mean_prompt_tokens: float = 1500.0
    mean_gen_tokens: float = 30.0
    rate_window_s: float = 600.0
    mean_context_tokens: float = 900.0
    step_s: float = 1.0
    # how long demand must stay below the pool before any of it is released (hysteresis
    # against forecast noise); None: one lead time (:attr:`cooldown_s`)
    scale_down_cooldown_s: float | None = None
    # SLO-aware keep-alive: the last replica stays warm for this quantile of the model's
    # observed idle gaps (over gap_window_s), at least the breakeven keep-alive; 0 = the
    # breakeven alone.  0.99: Shahrad et al., "Serverless in the Wild" (ATC 2020).
    keepalive_gap_quantile: float = 0.99
    # how long idle gaps are remembered, and the longest one counted: 4 hours, the range of
    # the idle-time histogram in Shahrad et al. (a trickle's gaps run to many minutes, so a
    # window of a few minutes would never hold enough of them to read a breakeven from)
    gap_window_s: float = 4 * 3600.0
    # idle gaps on record before the last replica's breakeven is read from them rather than
    # from the Poisson formula: the empirical distribution of fewer says little about the next
    keepalive_min_gaps: int = 10
    # the SLO attainment the keep-alive protects: the gap quantile applies once more than
    # 1 - slo_attainment of the requests that found no warm replica missed their SLO
    slo_attainment: float = 0.99
    costs: KeepAliveCosts = field(default_factory=KeepAliveCosts)

    def __post_init__(self) -> None:
        check_lead_time(self.model, self.lead_time_s, self.restore_p99_s, self.decision_latency_s)
        if not self.step_s > 0:
            raise ConfigError(f"ModelPolicy {self.model}: step_s={self.step_s}; limit is > 0",
                              name="step_s", value=self.step_s, limit="> 0")
        if self.scale_down_cooldown_s is not None and self.scale_down_cooldown_s < 0:
            raise ConfigError(
                f"ModelPolicy {self.model}: scale_down_cooldown_s={self.scale_down_cooldown_s}; "
                "limit is >= 0", name="scale_down_cooldown_s",
                value=self.scale_down_cooldown_s, limit=">= 0")
        # Validate the sizing and smoothing parameters once, here, with their own messages.
        target_replicas(0.0, self.occupancy_s, self.seqs_per_replica, self.utilisation,
                        self.min_replicas, self.max_replicas)
        target_replicas(0.0, 1.0, 1, self.speed_utilisation, 0, 1)   # 0 < u <= 1
        Holt(self.alpha, self.beta, self.phi)
        Holt(self.react_alpha, 0.0)
        self.make_forecaster()
        if not (self.in_flight_s > 0 and math.isfinite(self.in_flight_s)):
            raise ConfigError(f"ModelPolicy {self.model}: in_flight_window_s="
                              f"{self.in_flight_window_s}; limit is > 0",
                              name="in_flight_window_s", value=self.in_flight_window_s,
                              limit="> 0")
        if not (self.ttft_slo_s > 0 and math.isfinite(self.ttft_slo_s)):
            raise ConfigError(f"ModelPolicy {self.model}: ttft_slo_s={self.ttft_slo_s}; "
                              "limit is > 0", name="ttft_slo_s", value=self.ttft_slo_s,
                              limit="> 0")
        for name in ("mean_prompt_tokens", "mean_gen_tokens"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"ModelPolicy {self.model}: {name}={value}; limit is >= 0",
                                  name=name, value=value, limit=">= 0")
        seqs_per_replica(0, self.mean_context_tokens)   # > 0, else ConfigError
        if not (type(self.keepalive_min_gaps) is int and self.keepalive_min_gaps >= 1):
            raise ConfigError(f"ModelPolicy {self.model}: keepalive_min_gaps="
                              f"{self.keepalive_min_gaps!r}; limit is an integer >= 1",
                              name="keepalive_min_gaps", value=self.keepalive_min_gaps, limit=1)
        if not 0.0 < self.slo_attainment <= 1.0:
            raise ConfigError(f"ModelPolicy {self.model}: slo_attainment={self.slo_attainment}; "
                              "limit is 0 < a <= 1", name="slo_attainment",
                              value=self.slo_attainment, limit="(0, 1]")
        if not 0.0 <= self.keepalive_gap_quantile <= 1.0:
            raise ConfigError(
                f"ModelPolicy {self.model}: keepalive_gap_quantile="
                f"{self.keepalive_gap_quantile}; limit is 0 <= q <= 1",
                name="keepalive_gap_quantile", value=self.keepalive_gap_quantile, limit="[0, 1]")
        if not (self.gap_window_s >= self.step_s and math.isfinite(self.gap_window_s)):
            raise ConfigError(
                f"ModelPolicy {self.model}: gap_window_s={self.gap_window_s}; limit is "
                f">= step_s ({self.step_s})", name="gap_window_s", value=self.gap_window_s,
                limit=self.step_s)
        if not self.rate_window_s >= self.step_s:
            raise ConfigError(
                f"ModelPolicy {self.model}: rate_window_s={self.rate_window_s}; limit is "
                f">= step_s ({self.step_s})", name="rate_window_s", value=self.rate_window_s,
                limit=self.step_s)

    def make_forecaster(self) -> Forecaster:
        """A fresh forecaster of kind ``forecaster`` (one of
        :data:`agent.predictor.forecast.FORECASTERS`; ConfigError otherwise)."""
        window = max(1, round(self.quantile_window_s / self.step_s))
        return build_forecaster(self.forecaster, alpha=self.alpha, beta=self.beta, phi=self.phi,
                                react_alpha=self.react_alpha, quantile=self.quantile,
                                quantile_window=window,
                                in_flight_window=max(1, round(self.in_flight_s / self.step_s)))

    @property
    def cooldown_s(self) -> float:
        """Seconds demand must stay below the pool before a replica is released: the
        configured ``scale_down_cooldown_s``, else one lead time.  A replica released once
        the forecast at lead time has not needed it for that long is restored in time if
        demand returns (that is what the lead time is for), so holding it longer only pays
        for idle replicas: one a front door asked for to clear a passing queue went on
        costing 30 s of GPU time a burst, well over the burst itself."""
        if self.scale_down_cooldown_s is not None:
            return self.scale_down_cooldown_s
        return self.lead_time_s

    @property
    def in_flight_s(self) -> float:
        """The window (s) the slow forecaster averages arrivals over."""
        return self.occupancy_s if self.in_flight_window_s is None else self.in_flight_window_s


def release_after_s(plan: KeepAlivePlan, policy: ModelPolicy,
                    gap_quantile_s: float | None = None) -> float:
    """Idle seconds after which a replica is released: the breakeven keep-alive
    (keepalive.py), never less than the restore p99 (a replica released for a shorter gap
    costs more GPU time restoring than the gap saves), and never less than the policy's
    quantile of the observed idle gaps (``gap_quantile_s``, :class:`IdleGaps`): a release
    inside a gap that usually ends sooner sends the next burst to a restore, which an
    arrival in the middle of a burst may not survive within its TTFT SLO."""
    return max(plan.warm_s, policy.restore_p99_s, gap_quantile_s or 0.0)


def check_lead_time(model: str, lead_time_s: float, restore_p99_s: float,
                    decision_latency_s: float) -> None:
    """Refuse a lead time that does not exceed restore p99 + decision latency (ConfigError)."""
    need = restore_p99_s + decision_latency_s
    if not lead_time_s > need:
        raise ConfigError(
            f"model {model}: lead_time_s={lead_time_s} must exceed restore p99 "
            f"{restore_p99_s} s + decision latency {decision_latency_s} s = {need} s",
            name="lead_time_s", value=lead_time_s, limit=need,
            restore_p99_s=restore_p99_s, decision_latency_s=decision_latency_s)
