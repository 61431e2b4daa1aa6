"""The predictor: per model, forecast demand, size the warm pool, and tell the scaler.

Pure and clock-injected: the production loop and the simulator drive the same object.
Call :meth:`Predictor.observe` with each window's arrivals (zeros included; a step with no
call counts as a missing sample), then :meth:`Predictor.tick` once per step.

Per model, every tick::

    arrivals/window ──► forecaster (forecast.py) ──► forecast(lead_time_s)
                                                  │  (default: upper quantile of the last
                                                  │   minute, backstopped by a fast average)
                                                  ▼
      Little's law at the measured speed (sizing.py) ──► desired replicas
                                                  │
        desired > target ──► scale_up now
        desired < target ──► low for the cooldown? ──no──► hold ("cooldown")
                                   │ yes
                             idle past the keep-alive? ──no──► hold ("keep-alive")
                                   │ yes   (to zero: idle since the last request, for
                                   │        the breakeven keep-alive over the model's
                                   │        observed idle gaps, and the 0.99
                                   │        quantile of observed idle gaps once cold
                                   │        arrivals miss the SLO, IdleGaps;
                                   │        otherwise: low for the breakeven time)
                             snapshot durable? ──no──► hold ("snapshot not durable")
                                   │ yes
                             scale_down (release tier: suspend | stop, keepalive.py)

The keep-alive is computed from the model's long-run arrival rate (an average over
``rate_window_s``), not from the forecast: after traffic stops the forecast falls to zero at
once, but the chance that the next request comes soon is set by the rate the model has had.
The last replica's ladder is read from the model's observed idle gaps once it has any
(:func:`~agent.predictor.keepalive.gap_breakeven_s`): a trickle whose gaps run to minutes is
released soon after its requests, a stream whose gaps are all short keeps its replica.

The last replica's keep-alive is SLO-aware: a release is only as cheap as its breakeven
says while the requests that then find no warm replica are served within their SLO (the
front door counts them, :meth:`Predictor.observe_cold`).  Once more than ``1 -
slo_attainment`` of them miss it, the replica is kept for the ``keepalive_gap_quantile``
(0.99) quantile of the model's observed idle gaps (:class:`~agent.predictor.keepalive.IdleGaps`;
the hybrid policy of Shahrad et al., "Serverless in the Wild", USENIX ATC 2020): releases
then happen only in the longest gaps, whatever the arrival process.

Scale-up acts at once.  The forecaster is chosen by ``ModelPolicy.forecaster`` among the
candidates bench/forecast_eval.py judges at the lead time (restore p99 + decision latency):
on the shipped Azure code trace Holt (damped or not) loses to persistence on both MAE and
the 0.9-quantile pinball loss, and the upper quantile of the last minute with the reactive
backstop (the larger of it and a fast moving average of the rate, ``react_alpha``) wins the
pinball loss, so that is the default; a burst from zero is covered within a step or two by
the backstop.

Replicas per demand come from the replica's measured speed when the model has one
(:meth:`Predictor.update_speed`: :func:`~agent.predictor.sizing.replicas_for_rate`, Little's
law at the sustainable concurrency for the TTFT SLO), else from the policy's occupancy and
sequences per replica (docs/architecture.md, "Sizing", its worked example). Scale-down
never happens unless ``snapshot_durable(model)`` says the model's snapshot is ready and
durable (catalog + Consul KV): a replica removed without one would come back by a full
cold boot.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from collections.abc import Callable, Iterable

from agent.clock import Clock
from agent.cluster.base import Scaler
from agent.errors import ClusterError, ConfigError, ModelNotFound
from agent.predictor.forecast import Forecaster, Holt
from agent.predictor.keepalive import IdleGaps, KeepAlivePlan, plan_keepalive
from agent.predictor.policy import ModelPolicy, check_lead_time, release_after_s
from agent.predictor.sizing import replicas_for_rate, seqs_per_replica, target_replicas
from agent.speed import SpeedProfile
from agent.throughput import MAX_MEAN_TOKENS, BacklogCapacity

log = logging.getLogger(__name__)

MAX_STEPS_PER_TICK = 3600   # a longer gap restarts the forecast instead of replaying it
COLD_SAMPLES = 64           # cold-arrival readings kept (observe_cold) per model


class ForecastSink(Protocol):
    """Where forecast rows go (the node's SQLite catalog, ``agent/snapshot/catalog.py``)."""

    def record_forecast(self, model: str, window_start_s: float, forecast_rps: float,
                        actual_rps: float | None, target: int) -> None: ...


@dataclass(frozen=True)
class Decision:
    """What one tick decided for one model, with the inputs it decided on.

    ``action``: ``scale_up``, ``scale_down``, ``hold``, ``standby`` (not the leader) or
    ``error`` (the scaler refused; retried next tick). ``actual_rps`` is None for a missing
    sample. ``release_tier`` says where released replicas go (``suspend`` or ``stop``).
    ``keepalive_s``: the idle time after which the last replica was to be released this tick
    (:func:`release_after_s`), and ``cold_miss``: the cold-miss fraction it was chosen by
    (:meth:`Predictor.cold_miss_fraction`; None before any cold arrival).
    """

    model: str
    at_s: float
    actual_rps: float | None
    forecast_rps: float
    level_rps: float
    desired: int
    previous: int
    target: int
    action: str
    reason: str
    keepalive: KeepAlivePlan
    idle_s: float
    keepalive_s: float | None = None
    cold_miss: float | None = None

    @property
    def release_tier(self) -> str:
        return self.keepalive.release_tier


@dataclass
class _State:
    policy: ModelPolicy
    forecaster: Forecaster
    longrun: Holt
    seqs: int
    gaps: IdleGaps
    speed: SpeedProfile | None = None
    sustained: BacklogCapacity | None = None   # what a replica sustained while backlogged
    max_seqs: int = 0
    arrivals: int = 0
    window_s: float = 0.0
    fed_until_s: float | None = None
    last_arrival_s: float | None = None
    last_busy_s: float | None = None    # last tick a front door had its requests queued or running
    target: int | None = None
    acting: bool = False
    acting_since_s: float | None = None
    low_since_s: float | None = None
    cold: deque = field(default_factory=lambda: deque(maxlen=COLD_SAMPLES))


class Predictor:
    """Forecasts demand per model and keeps each model's warm-pool target.

    ``policies``: one :class:`ModelPolicy` per model. ``scaler``: an
    :class:`agent.cluster.base.Scaler`. ``snapshot_durable(model)``: True only when the
    model's snapshot is ready and durable. ``catalog``: optional :class:`ForecastSink`.
    """

    def __init__(self, policies: Iterable[ModelPolicy], *, clock: Clock, scaler: Scaler,
                 snapshot_durable: Callable[[str], bool],
                 catalog: ForecastSink | None = None) -> None:
        self._clock = clock
        self._scaler = scaler
        self._durable = snapshot_durable
        self._catalog = catalog
        self._models: dict[str, _State] = {}
        for p in policies:
            self._models[p.model] = _State(policy=p, forecaster=p.make_forecaster(),
                                           longrun=Holt(min(1.0, p.step_s / p.rate_window_s),
                                                        0.0),
                                           seqs=p.seqs_per_replica,
                                           gaps=IdleGaps(p.gap_window_s))

    @property
    def models(self) -> list[str]:
        return list(self._models)

    def _state(self, model: str) -> _State:
        try:
            return self._models[model]
        except KeyError:
            raise ModelNotFound(f"predictor: model {model!r} has no policy", model=model) from None

    def observe(self, model: str, arrivals: int, window_s: float = 1.0) -> None:
        """Record ``arrivals`` requests seen over ``window_s`` seconds (summed until the tick).

        Raises ModelNotFound for an unknown model and ConfigError for negative arrivals or a
        window that is not > 0.  Arrivals or a window that are NaN or infinite are a missing
        reading (a broken stats answer), recorded as nothing.
        """
        st = self._state(model)
        try:
            if not (math.isfinite(arrivals) and math.isfinite(window_s)):
                log.debug("observe %s: arrivals=%r over window_s=%r is no reading; ignored",
                          model, arrivals, window_s)
                return
        except TypeError:
            pass  # not a number: the checks below name it
        if arrivals < 0:
            raise ConfigError(f"observe {model}: arrivals={arrivals}; limit is >= 0",
                              name="arrivals", value=arrivals, limit=0)
        if not (window_s > 0 and math.isfinite(window_s)):
            raise ConfigError(f"observe {model}: window_s={window_s}; limit is > 0",
                              name="window_s", value=window_s, limit="> 0")
        st.arrivals += int(arrivals)
        st.window_s += float(window_s)
        if arrivals > 0:
            now = self._clock.now()
            # an idle gap: at least one whole step without a request in between
            if st.last_arrival_s is not None and now - st.last_arrival_s > 1.5 * st.policy.step_s:
                st.gaps.record(now - st.last_arrival_s, now)
            st.last_arrival_s = now

    def observe_cold(self, model: str, arrivals: int, misses: int) -> None:
        """Record, since the last reading, ``arrivals`` requests that found no warm replica
        of ``model`` and ``misses`` such requests answered outside their SLO (the front
        door's ``cold`` counters; a miss may be counted a reading after its arrival, so one
        reading may hold more misses than arrivals).  Raises ModelNotFound for an unknown
        model and ConfigError unless both are integers >= 0."""
        st = self._state(model)
        if not (type(arrivals) is int and type(misses) is int and arrivals >= 0
                and misses >= 0):
            raise ConfigError(f"observe_cold {model}: arrivals={arrivals!r} misses={misses!r}; "
                              "limit is >= 0 each", name="misses", value=misses, limit=0)
        if arrivals or misses:
            st.cold.append((arrivals, misses))

    def observe_busy(self, model: str) -> None:
        """Record that ``model`` has requests queued at a front door or running at a replica
        now: it is not idle (its keep-alive counts from the last such tick).  Raises
        ModelNotFound for an unknown model."""
        self._state(model).last_busy_s = self._clock.now()

    def cold_miss_fraction(self, model: str) -> float | None:
        """The fraction of recent cold arrivals (:meth:`observe_cold`, the last
        ``COLD_SAMPLES`` readings) that missed their SLO; None before any."""
        cold = self._state(model).cold
        total = sum(a for a, _ in cold)
        return min(1.0, sum(m for _, m in cold) / total) if total else None

    def update_capacity(self, model: str, kv_capacity_tokens: int,
                        mean_context_tokens: float | None = None) -> int:
        """Re-derive sequences per replica from a replica's reported KV capacity (tokens)
        and the mean context length (default: the policy's ``mean_context_tokens``; design
        document: 72,089 / 900 = 80); returns it (at least 1)."""
        st = self._state(model)
        ctx = st.policy.mean_context_tokens if mean_context_tokens is None else mean_context_tokens
        st.seqs = max(1, seqs_per_replica(kv_capacity_tokens, ctx))
        return st.seqs

    def update_speed(self, model: str, profile: SpeedProfile, max_seqs: int, *,
                     mean_prompt_tokens: float | None = None,
                     mean_gen_tokens: float | None = None,
                     sustained: BacklogCapacity | None = None) -> int:
        """Size ``model`` from a replica's measured speed from now on (docs/architecture.md,
        "Capacity from measured rates"):
        ``profile`` (the slowest replica's, agent/speed.py), its ``max_seqs`` KV slots,
        when given the observed mean prompt and output lengths (tokens; one that is not a
        number in [0, agent/throughput.py's ``MAX_MEAN_TOKENS``] is ignored), and ``sustained``,
        the capacity a replica sustained while backlogged (agent/throughput.py; kept until
        a newer one comes: a replica that has not been saturated since still has it), which
        then sizes the pool instead of the profile's estimate.  Returns the sustainable
        concurrency per replica at the policy's TTFT SLO."""
        st = self._state(model)
        if max_seqs < 1:
            raise ConfigError(f"update_speed {model}: max_seqs={max_seqs}; limit is >= 1",
                              name="max_seqs", value=max_seqs, limit=1)
        changes: dict[str, Any] = {k: float(v) for k, v in (("mean_prompt_tokens", mean_prompt_tokens),
                                            ("mean_gen_tokens", mean_gen_tokens))
                   if v is not None and 0 <= v <= MAX_MEAN_TOKENS}
        if changes:
            st.policy = replace(st.policy, **changes)
        st.speed, st.max_seqs = profile, int(max_seqs)
        if sustained is not None:
            st.sustained = sustained
        p = st.policy
        return profile.sustainable_concurrency(p.ttft_slo_s, p.mean_prompt_tokens,
                                               p.mean_gen_tokens, st.max_seqs)

    def update_restore_p99(self, model: str, restore_p99_s: float) -> None:
        """A new measured restore p99; ConfigError (policy unchanged) if the lead time is short."""
        st = self._state(model)
        p = st.policy
        check_lead_time(model, p.lead_time_s, restore_p99_s, p.decision_latency_s)
        # the measured restore is also the cold-start cost the keep-alive weighs
        st.policy = replace(p, restore_p99_s=restore_p99_s,
                            costs=replace(p.costs, restore_s=restore_p99_s,
                                          resume_s=None if p.costs.resume_s is None
                                          else min(p.costs.resume_s, restore_p99_s)))

    def tick(self, act: bool = True) -> list[Decision]:
        """One step for every model; with ``act=False`` (standby) forecast but do not scale."""
        now = self._clock.now()
        return [self._tick_model(st, now, act) for st in self._models.values()]

    # -- one model ------------------------------------------------------------------------
    def _feed(self, st: _State, now: float) -> tuple[float | None, float | None]:
        """Advance the smoothers by the whole steps elapsed; returns (rate, window start).

        Steps are counted on the clock (``fed_until_s``), not per call, so ticks that come
        late or early neither stretch nor compress the forecast's time scale. A tick inside
        the current step feeds nothing and keeps the arrivals for the next (window start
        None). The arrivals observed since the last step are spread evenly over the steps.
        """
        p = st.policy
        if st.fed_until_s is None:
            st.fed_until_s = now - p.step_s
        steps = int((now - st.fed_until_s) / p.step_s + 1e-9)
        if steps <= 0:
            return None, None
        start = st.fed_until_s
        st.fed_until_s += steps * p.step_s
        actual = None
        if st.window_s > 0:
            actual = st.arrivals / st.window_s
        st.arrivals, st.window_s = 0, 0.0
        if steps > MAX_STEPS_PER_TICK:
            st.forecaster = p.make_forecaster()   # a gap too long to bridge: start over
            st.forecaster.update(actual)
            st.longrun.update(actual)
            return actual, start
        for _ in range(steps):
            st.forecaster.update(actual)
            st.longrun.update(actual)
        return actual, start

    def _tick_model(self, st: _State, now: float, act: bool) -> Decision:
        p = st.policy
        actual, window_start_s = self._feed(st, now)
        forecast = st.forecaster.forecast(p.lead_time_s / p.step_s)
        level = st.forecaster.forecast(0)
        demand = forecast
        if st.speed is not None:
            desired = replicas_for_rate(demand, st.speed, ttft_slo_s=p.ttft_slo_s,
                                        mean_prompt_tokens=p.mean_prompt_tokens,
                                        mean_gen_tokens=p.mean_gen_tokens,
                                        max_seqs=st.max_seqs,
                                        utilisation=p.speed_utilisation,
                                        min_replicas=p.min_replicas,
                                        max_replicas=p.max_replicas,
                                        sustained=st.sustained)
        else:
            desired = target_replicas(demand, p.occupancy_s, st.seqs, p.utilisation,
                                      p.min_replicas, p.max_replicas)
        rate = st.longrun.forecast(0)
        # the last replica's ladder comes from the model's own idle gaps once it has any;
        # excess replicas (demand fell, traffic goes on) from the Poisson breakeven
        gaps = st.gaps.values(now)
        plan = plan_keepalive(rate, p.costs, gaps if len(gaps) >= p.keepalive_min_gaps else ())
        excess_plan = plan_keepalive(rate, p.costs)
        if act and not st.acting:   # first tick as the actor: learn what is running
            st.target = self._scaler.target(p.model)
            st.low_since_s = None
            st.acting_since_s = now
        elif act:
            # Others scale too (a front door scaling a model up from zero through Nomad):
            # act on what the scaler holds now, not on what this predictor last set.
            held = self._scaler.target(p.model)
            if held != st.target:
                st.target = held
        st.acting = act
        # idle since the last request or the last tick that saw one queued or running (a
        # release then would strand requests held for a restore: the live replay refused 12
        # held for the replica it was restoring), or since this predictor began acting
        seen = [t for t in (st.last_arrival_s, st.last_busy_s, st.acting_since_s)
                if t is not None]
        idle_s = now - max(seen) if seen else math.inf
        keepalive_s = release_after_s(plan, p, self._gap_keepalive_s(p.model, now))
        if idle_s >= keepalive_s:
            desired = p.min_replicas   # an idle model is released whatever the forecast recalls
        previous = st.target if st.target is not None else 0
        action, reason = self._decide(st, now, desired, plan, idle_s, act, keepalive_s,
                                      excess_plan)
        decision = Decision(p.model, now, actual, forecast, level, desired, previous,
                            st.target if st.target is not None else 0, action, reason,
                            plan, idle_s, keepalive_s, self.cold_miss_fraction(p.model))
        # A tick that changes nothing is DEBUG: an idle fleet would log every second otherwise.
        log.log(logging.INFO if decision.target != previous else logging.DEBUG,
                "predictor %s: %s %d->%d (%s) actual=%s forecast=%.3f level=%.3f desired=%d "
                "keepalive warm=%.1fs stop=%.1fs idle=%.1fs", p.model, action, previous,
                decision.target, reason, actual, forecast, level, desired, plan.warm_s,
                plan.stop_s, idle_s)
        if act and self._catalog is not None and window_start_s is not None:
            self._catalog.record_forecast(p.model, window_start_s, forecast, actual,
                                          decision.target)
        return decision

    def _gap_keepalive_s(self, model: str, now: float) -> float | None:
        """The SLO-aware keep-alive (s) of ``model``: the policy's quantile of its observed
        idle gaps, once requests that found no warm replica are measured to miss their SLO
        more often than ``1 - slo_attainment`` allows; None otherwise (a release is then
        SLO-safe and only its cost counts: the breakeven keep-alive alone)."""
        st = self._models[model]
        p = st.policy
        missed = self.cold_miss_fraction(model)
        if p.keepalive_gap_quantile <= 0 or missed is None or missed <= 1.0 - p.slo_attainment:
            return None
        return st.gaps.quantile(p.keepalive_gap_quantile, now)

    def _decide(self, st: _State, now: float, desired: int, plan: KeepAlivePlan,
                idle_s: float, act: bool, keepalive_s: float,
                excess_plan: KeepAlivePlan) -> tuple[str, str]:
        p = st.policy
        if not act:
            return "standby", "not the leader"
        current = st.target
        assert current is not None, "an acting predictor read its target on its first tick"
        if desired >= current:
            st.low_since_s = None
            if desired == current:
                return "hold", "at target"
            return self._apply(st, desired, "scale_up", f"forecast needs {desired}")
        if st.low_since_s is None:
            st.low_since_s = now
        low_for = now - st.low_since_s
        if desired == p.min_replicas and idle_s >= keepalive_s:
            # idle: no request for the keep-alive time, which is itself the hold (no cooldown)
            if not self._durable(p.model):
                return "hold", "snapshot not durable"
            action = self._apply(st, desired, "scale_down",
                                 f"idle for {idle_s:.1f}s >= keep-alive {keepalive_s:.1f}s; "
                                 f"release={plan.release_tier}")
            st.low_since_s = None
            return action
        if low_for < p.cooldown_s:
            return "hold", f"cooldown: low for {low_for:.1f}s of {p.cooldown_s:.1f}s"
        # keep-alive: the last replica waits for idle time since the last request (the gap
        # quantile included); excess replicas wait for the breakeven time of low demand.
        waited = idle_s if desired == 0 else low_for
        if desired > 0:
            keepalive_s = release_after_s(excess_plan, p)
        if waited < keepalive_s:
            return "hold", f"keep-alive: {waited:.1f}s of {keepalive_s:.1f}s"
        if not self._durable(p.model):
            return "hold", "snapshot not durable"
        action = self._apply(st, desired, "scale_down",
                             f"low for {low_for:.1f}s; release={plan.release_tier}")
        st.low_since_s = None
        return action

    def _apply(self, st: _State, count: int, action: str, reason: str) -> tuple[str, str]:
        try:
            self._scaler.set_target(st.policy.model, count, reason=reason)
        except ClusterError as exc:
            log.warning("predictor %s: scaler refused %d: %s", st.policy.model, count, exc)
            return "error", str(exc)
        st.target = count
        return action, reason
