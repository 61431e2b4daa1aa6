"""Per-model figures the request path derives and caches: time budgets and replica size.

- :meth:`Budgets.budgets_s`: a request's (warm, restore) time budgets from arrival;
- :meth:`Budgets.per_replica`: requests one new replica serves within the warm SLO (its
  sustainable concurrency, agent/speed.py), which sizes the restores asked for;
- :meth:`Budgets.restore_measured`: a measured restore, which moves both.

Each figure is cached in the model's :class:`~agent.frontdoor.model_state.ModelState`.
"""

from __future__ import annotations

from agent.clock import Clock
from agent.frontdoor.capacity import RestoreTimes
from agent.frontdoor.config import FrontDoorConfig
from agent.frontdoor.model_state import ModelStates
from agent.frontdoor.router import Router

PER_REPLICA_TTL_S = 1.0
"""Sustainable concurrency is recomputed at most this often (its cost is O(max_seqs))."""


class Budgets:
    """Time budgets and one replica's size, per model (module docstring)."""

    def __init__(self, config: FrontDoorConfig, clock: Clock, router: Router,
                 restore_times: RestoreTimes, models: ModelStates) -> None:
        self.config = config
        self.clock = clock
        self.router = router
        self.restore_times = restore_times
        self.models = models

    def budgets_s(self, model: str, deadline_ms: float | None) -> tuple[float, float]:
        """(warm, restore) time budgets (s from arrival) for a request of ``model``: its own
        ``deadline_ms`` for both, else each path's SLO capped by the model's default
        deadline (:class:`FrontDoorConfig`)."""
        if deadline_ms:
            return deadline_ms / 1000.0, deadline_ms / 1000.0
        state = self.models.of(model)
        budgets = state.budgets_s
        if budgets is None:  # cached; dropped when a restore of the model is measured
            default_s = state.deadline_ms / 1000.0
            warm_s, restore_s = self.config.slo_s(model)
            if self.restore_times.p99_ms(model) is None:
                # Nothing restored yet: the first restore may be a cold boot (minutes, no
                # snapshot yet), which no restore-path SLO covers; the default deadline does.
                restore_s = default_s
            budgets = state.budgets_s = (min(default_s, warm_s), min(default_s, restore_s))
        return budgets

    def per_replica(self, model: str) -> int:
        """Requests one new replica of ``model`` serves within the warm SLO (cached for
        ``PER_REPLICA_TTL_S``): its sustainable concurrency (agent/speed.py) at the model's
        mean prompt and max_tokens, with the model's prior speed, within the largest
        replica's slots seen."""
        state = self.models.of(model)
        cached = state.per_replica
        now = self.clock.now()
        if cached is not None and now - cached[0] < PER_REPLICA_TTL_S:
            return cached[1]
        prompt, gen = state.mean_shape()
        max_seqs = state.max_seqs or max(
            (r.max_seqs for r in self.router.warm(model)), default=self.config.default_max_seqs)
        n = self.router.prior(model).sustainable_concurrency(
            self.config.slo_s(model)[0], prompt, gen, max_seqs)
        state.per_replica = (now, n)
        return n

    def restore_measured(self, model: str, restore_ms: float,
                         path: str = "snapshot_restore") -> None:
        """Record a restore of ``model`` that took ``restore_ms`` by ``path``: its budgets are
        recomputed, and a model with no configured deadline gets
        ``deadline_per_restore_p99`` x the restore p99 (at least the default deadline)."""
        self.restore_times.record(model, restore_ms, path)
        state = self.models.of(model)
        state.budgets_s = None
        if model not in self.config.models:
            state.deadline_ms = max(
                self.config.default_deadline_ms,
                self.config.deadline_per_restore_p99 * (self.restore_times.p99_ms(model) or 0.0))
