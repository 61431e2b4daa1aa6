"""The predictor as a service: sample the front doors' counters, elect a leader, tick.

One step per second (``tick_s``)::

    front doors' stats ──► CounterRate per (front door, model) ──► Predictor.observe
    LeaderLock.tick() (or always leader when embedded) ──► Predictor.tick(act=leader)

A front door's ``stats`` answer carries ``arrivals: {model: cumulative count}``,
``cold: {model: {arrivals, misses}}`` (requests that found no warm replica, and those of them
not served within their SLO: fed to ``Predictor.observe_cold``, which makes the keep-alive
SLO-aware) and ``replicas: {id: {model, kv_capacity_tokens, ...}}``; the smallest KV capacity seen per
model re-sizes its sequences per replica (``Predictor.update_capacity`` with the policy's
``mean_context_tokens``). When the replicas' entries carry their measured speed (``SPEED_META_KEYS`` of agent/speed.py,
with ``max_seqs``), the slowest replica's profile sizes the model from then on
(``Predictor.update_speed``: Little's law at the sustainable concurrency; docs/architecture.md,
"Capacity from measured rates"), and the front door's ``mean_prompt_tokens``/``mean_gen_tokens`` per model, when it
reports them, set the lengths it is sized for.  Counters that go down (a restarted front door) and gaps are handled by
:class:`~agent.predictor.forecast.CounterRate`; a front door that stops answering simply
contributes no sample (a missing sample, not a zero).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol, TypeGuard
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Gauge

from agent.clock import Clock
from agent.errors import ConfigError
from agent.predictor.forecast import CounterRate
from agent.predictor.loop import Decision, Predictor

log = logging.getLogger(__name__)

StatsFetch = Callable[[], Mapping[str, Mapping[str, Any]]]
"""() -> {front door id: {"arrivals": {model: cumulative requests},
"kv_capacity_tokens": {model: tokens}}} (what :func:`frontdoor_stats` returns per door)."""


class Leader(Protocol):
    def tick(self) -> bool: ...


class PredictorService:
    """Drives one :class:`Predictor` from front-door counters, gated by a leader lock.

    Metrics (prometheus-client, on ``registry``): ``rewarm_predictor_forecast_requests_per_second{model}``,
    ``rewarm_predictor_actual_requests_per_second{model}`` (per second: Prometheus's base unit), ``rewarm_predictor_target_replicas{model}``,
    ``rewarm_predictor_keepalive_seconds{model,tier}``, ``rewarm_predictor_leader``.
    After each acting tick a scaler with ``expire_parked(model, park_s)`` is told how long
    suspended replicas may stay parked (keep-alive ``stop_s - warm_s``).
    """

    def __init__(self, predictor: Predictor, *, clock: Clock, fetch: StatsFetch,
                 leader: Leader | None = None, scaler: object | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.predictor = predictor
        self._clock = clock
        self._fetch = fetch
        self._leader = leader
        self._scaler = scaler
        self._rates: dict[tuple[str, str], CounterRate] = {}
        self._cold: dict[tuple[str, str], tuple[int, int]] = {}  # last cumulative reading
        self._fetch_failing_since: float | None = None   # clock time stats first failed
        self._fetch_warned_s = float("-inf")
        self.is_leader = False
        self.registry = registry or CollectorRegistry()
        g = lambda name, doc, labels=("model",): Gauge(name, doc, labels, registry=self.registry)  # noqa: E731
        self._forecast = g("rewarm_predictor_forecast_requests_per_second",
                           "Forecast request rate at lead time")
        self._actual = g("rewarm_predictor_actual_requests_per_second",
                         "Observed request rate, last window")
        self._target = g("rewarm_predictor_target_replicas", "Warm-pool target")
        self._keepalive = g("rewarm_predictor_keepalive_seconds", "Breakeven keep-alive",
                            ("model", "tier"))
        self._leading = Gauge("rewarm_predictor_leader", "1 while this predictor acts",
                              registry=self.registry)

    def ready(self) -> tuple[bool, str]:
        """Readiness for the status port: not while the front doors' counters cannot be
        fetched (the forecast has no input); a follower that is not leading is ready."""
        since = self._fetch_failing_since
        if since is not None:
            return False, (f"front-door stats unreachable for "
                           f"{self._clock.now() - since:.0f} s")
        return True, "ready" if self.is_leader else "ready (standing by: not the leader)"

    def sample(self) -> dict[str, tuple[int, float]]:
        """Read every front door once; feed ``observe``; returns ``{model: (arrivals, window_s)}``."""
        now = self._clock.now()
        try:
            stats = self._fetch()
        except (OSError, ValueError) as exc:   # network trouble or a malformed answer
            # once when it starts, then once a minute while it lasts (not every tick)
            if self._fetch_failing_since is None or now - self._fetch_warned_s >= 60.0:
                since = self._fetch_failing_since
                log.warning("predictor: front-door stats unavailable%s: %s",
                            "" if since is None else f" for {now - since:.0f} s", exc)
                self._fetch_warned_s = now
            if self._fetch_failing_since is None:
                self._fetch_failing_since = now
            stats = {}
        else:
            if self._fetch_failing_since is not None:
                log.warning("predictor: front-door stats back after %.0f s",
                            now - self._fetch_failing_since)
                self._fetch_failing_since = None
        known = set(self.predictor.models)
        seen: dict[str, tuple[int, float]] = {}
        capacity: dict[str, int] = {}
        for door, door_stats in stats.items():
            for model, tokens in (door_stats.get("kv_capacity_tokens") or {}).items():
                if model in known and tokens > 0:
                    capacity[model] = min(tokens, capacity.get(model, tokens))
            for model, value in (door_stats.get("arrivals") or {}).items():
                if model not in known:
                    continue
                got = self._rates.setdefault((door, model), CounterRate()).sample(value, now)
                if got is None:
                    continue
                arrivals, window_s = seen.get(model, (0, 0.0))
                seen[model] = (arrivals + got[0], max(window_s, got[1]))
        for model, (arrivals, window_s) in seen.items():
            self.predictor.observe(model, arrivals, window_s)
        for model in set().union(*(d.get("busy") or () for d in stats.values())) & known:
            self.predictor.observe_busy(model)
        for door, door_stats in stats.items():
            for model, (cold, missed) in (door_stats.get("cold") or {}).items():
                if model not in known:
                    continue
                before = self._cold.get((door, model))
                self._cold[(door, model)] = (cold, missed)
                if before is None or cold < before[0] or missed < before[1]:
                    continue          # first reading, or the door restarted: a new baseline
                if (cold, missed) != before:
                    try:
                        self.predictor.observe_cold(model, cold - before[0],
                                                    missed - before[1])
                    except ConfigError as exc:   # one bad reading must not stop the ticks
                        log.warning("predictor: cold counters of %s ignored: %s", door, exc)
        for model, tokens in capacity.items():
            self.predictor.update_capacity(model, tokens)
        for model, (profile, max_seqs, lengths) in _speeds(stats, known).items():
            sustained = [d["sustained"][model] for d in stats.values()
                         if model in (d.get("sustained") or {})]
            self.predictor.update_speed(model, profile, max_seqs, **lengths,
                                        sustained=min(sustained, key=lambda c: c.rps_at(
                                            profile, 100, 10), default=None))
        return seen

    def step(self) -> list[Decision]:
        """One tick: sample, renew the lock, decide (acting only as the leader)."""
        self.sample()
        self.is_leader = self._leader.tick() if self._leader is not None else True
        self._leading.set(1 if self.is_leader else 0)
        decisions = self.predictor.tick(act=self.is_leader)
        expire = getattr(self._scaler, "expire_parked", None)
        for d in decisions:
            self._forecast.labels(d.model).set(d.forecast_rps)
            if d.actual_rps is not None:
                self._actual.labels(d.model).set(d.actual_rps)
            self._target.labels(d.model).set(d.target)
            self._keepalive.labels(d.model, "warm").set(d.keepalive.warm_s)
            self._keepalive.labels(d.model, "stop").set(d.keepalive.stop_s)
            if self.is_leader and expire is not None:
                expire(d.model, max(0.0, d.keepalive.stop_s - d.keepalive.warm_s))
        return decisions

    def run(self, stop: threading.Event, tick_s: float = 1.0) -> None:
        """Step every ``tick_s`` seconds until ``stop`` is set (the only real-time wait)."""
        while not stop.is_set():
            started = self._clock.now()
            try:
                self.step()
            except Exception:   # one bad tick must not end the loop; it is logged
                log.exception("predictor: tick failed")
            stop.wait(max(0.0, tick_s - (self._clock.now() - started)))


def frontdoor_stats(address: str, *, timeout_s: float = 2.0,
                    token: str | None = None) -> dict[str, Any]:
    """One front door's counters and replica capacities from its ``stats`` op (msgpack/TCP).

    Returns ``{"arrivals": {model: count}, "kv_capacity_tokens": {model: tokens}}``
    (the smallest capacity among the model's warm replicas; entries that are not
    non-negative integers are dropped). Raises OSError (unreachable, closed early, timeout)
    and ValueError (an error answer or a malformed one; ProtocolError is one). A front door
    without per-model counters gives an empty ``arrivals``.
    """
    from agent.protocol import PROTOCOL_VERSION, request

    message = {"v": PROTOCOL_VERSION, "op": "stats", "id": 1}
    if token:
        message["token"] = token
    answer = request(address, message, timeout_s=timeout_s, service="front door")[-1]
    if answer.get("type") != "result":
        raise ValueError(f"front door {address}: stats refused: "
                         f"{answer.get('code')} {answer.get('reason')}")
    return _parse_stats(address, answer.get("result") or {})


def _speeds(stats: Mapping, known: set[str]) -> dict:
    """``{model: (slowest SpeedProfile, its max_seqs, {mean_prompt_tokens, mean_gen_tokens})}``
    from the doors' ``speed`` entries (see :func:`_parse_stats`); models without one are
    absent.  The slowest profile is the one with the lowest service rate at one sequence."""
    out: dict[str, tuple] = {}
    for door_stats in stats.values():
        lengths_by_model = door_stats.get("lengths") or {}
        for model, (profile, max_seqs) in (door_stats.get("speed") or {}).items():
            if model not in known:
                continue
            old = out.get(model)
            if old is None or profile.service_rps(100, 10, 1) < old[0].service_rps(100, 10, 1):
                out[model] = (profile, max_seqs, dict(lengths_by_model.get(model) or {}))
    return out


def _count(v: object) -> TypeGuard[int]:
    """``v`` is a non-negative int (not a bool)."""
    return type(v) is int and v >= 0


def _parse_stats(address: str, result: dict) -> dict[str, Any]:
    counters = result.get("arrivals") or {}
    replicas = result.get("replicas") or {}
    for name, value in (("arrivals", counters), ("replicas", replicas)):
        if not isinstance(value, dict):
            raise ValueError(f"front door {address}: {name} is {type(value).__name__}, "
                             "not a map")
    from agent.cluster.base import LOAD_META_LIMITS
    from agent.speed import SpeedProfile
    from agent.throughput import MAX_MEAN_TOKENS, BacklogCapacity

    capacity: dict[str, int] = {}
    speed: dict[str, tuple] = {}
    sustained: dict[str, BacklogCapacity] = {}
    for rep in replicas.values():
        if not (isinstance(rep, dict) and isinstance(rep.get("model"), str)):
            continue
        m = rep["model"]
        # within the load report's limits (agent/cluster/base.py): past them, no reading
        tokens = rep.get("kv_capacity_tokens")
        if _count(tokens) and tokens <= LOAD_META_LIMITS["kv_capacity_tokens"]:
            capacity[m] = min(tokens, capacity.get(m, tokens))
        profile = SpeedProfile.from_meta(rep)
        max_seqs = rep.get("max_seqs")
        if profile is not None and _count(max_seqs) \
                and 1 <= max_seqs <= LOAD_META_LIMITS["max_seqs"]:
            old = speed.get(m)
            if old is None or profile.service_rps(100, 10, 1) < old[0].service_rps(100, 10, 1):
                speed[m] = (profile, max_seqs)
        # the replica that sustained the least while backlogged sizes its model
        measured = BacklogCapacity.from_meta(rep)
        if measured is not None and (m not in sustained or measured.rps_at(
                profile, 100, 10) < sustained[m].rps_at(profile, 100, 10)):
            sustained[m] = measured
    lengths: dict[str, dict] = {}
    reported = result.get("lengths")
    for m, value in (reported.items() if isinstance(reported, dict) else ()):
        if isinstance(value, dict):
            keep = {k: float(value[k]) for k in ("mean_prompt_tokens", "mean_gen_tokens")
                    if isinstance(value.get(k), (int, float)) and not isinstance(value[k], bool)
                    and 0 <= value[k] <= MAX_MEAN_TOKENS}
            if keep:
                lengths[str(m)] = keep
    cold: dict[str, tuple[int, int]] = {}
    reported = result.get("cold")
    for m, value in (reported.items() if isinstance(reported, dict) else ()):
        # cold arrivals are some of the model's arrivals, and misses some of the cold ones
        limit = counters.get(m) if _count(counters.get(m)) else None
        if isinstance(value, dict) and _count(value.get("arrivals")) \
                and _count(value.get("misses")) and value["misses"] <= value["arrivals"] \
                and (limit is None or value["arrivals"] <= limit):
            cold[str(m)] = (value["arrivals"], value["misses"])
        else:
            log.warning("predictor: cold counters of %s for %r ignored: %r; limit is integers "
                        "with misses <= arrivals <= the model's arrivals (%s)", address, m,
                        value, limit)
    # busy: requests queued at the front door or sequences running at a replica (a model
    # that is serving or waiting for capacity is not idle, whatever its arrivals say)
    queued = result.get("queued")
    busy: set[str] = set()
    if queued is not None and not isinstance(queued, dict):
        log.warning("predictor: queued counts of %s ignored: %r; limit is a map of model to "
                    "a non-negative integer", address, queued)
    for m, n in (queued.items() if isinstance(queued, dict) else ()):
        if isinstance(m, str) and _count(n):
            if n > 0:
                busy.add(m)
        else:
            log.warning("predictor: queued count of %s for %r ignored: %r; limit is a "
                        "non-negative integer", address, m, n)
    busy |= {rep["model"] for rep in replicas.values() if isinstance(rep, dict)
             and isinstance(rep.get("model"), str) and _count(rep.get("active_seqs"))
             and rep["active_seqs"] > 0}
    return {"arrivals": {str(k): v for k, v in counters.items() if _count(v)},
            "kv_capacity_tokens": capacity, "speed": speed, "lengths": lengths, "cold": cold,
            "busy": busy, "sustained": sustained}
