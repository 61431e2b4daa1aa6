"""Per-model figures the request path derives and caches: time budgets and replica size.

- :meth:`Budgets.slos_s`: a request's (warm, restore) TTFT SLOs, base + its own prefill;
- :meth:`Budgets.budgets_s`: its (warm, restore) deadlines: those SLOs by default;
- :meth:`Budgets.deadline_names`: where each of those deadlines came from (for refusals);
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

    def prefill_s(self, model: str, prompt_tokens: int) -> float:
        """Seconds to prefill ``prompt_tokens`` at the speed ``model``'s replicas measured
        (the slowest that reported, :meth:`Router.prior
        <agent.frontdoor.router.Router.prior>`); 0 for no prompt."""
        if prompt_tokens <= 0:
            return 0.0
        speed = self.router.prior(model)
        return speed.prefill_overhead_s + prompt_tokens / speed.prefill_tokens_per_s

    def slos_s(self, model: str, prompt_tokens: int = 0) -> tuple[float, float]:
        """(warm, restore) TTFT SLOs (s from arrival) of a request of ``prompt_tokens``: each
        path's base SLO plus, with ``slo_counts_prefill``, the request's own prefill
        (agent/slo.py): what attainment counts, never what refuses it."""
        warm_s, restore_s = self.config.slo_s(model)
        if not self.config.slo_counts_prefill:
            return warm_s, restore_s
        prefill = self.prefill_s(model, prompt_tokens)
        return warm_s + prefill, restore_s + prefill

    def budgets_s(self, model: str, deadline_ms: float | None,
                  prompt_tokens: int = 0) -> tuple[float, float]:
        """(warm, restore) deadlines (s from arrival) of a request of ``model`` with
        ``prompt_tokens``: its own ``deadline_ms`` for both, else ``deadline_factor`` times
        each path's SLO (:meth:`slos_s`: base + prefill), capped by the model's default
        deadline (:class:`FrontDoorConfig`).  Before any restore of the model is measured,
        the restore path gets the model's default deadline (the first may be a cold boot,
        which no restore-path SLO covers)."""
        if deadline_ms:
            return deadline_ms / 1000.0, deadline_ms / 1000.0
        state = self.models.of(model)
        default_s = state.deadline_ms / 1000.0
        factor = self.config.deadline_factor
        warm_slo_s, restore_slo_s = self.slos_s(model, prompt_tokens)
        restore_s = factor * restore_slo_s
        if self.restore_times.p99_ms(model) is None:
            restore_s = default_s
        return min(default_s, factor * warm_slo_s), min(default_s, restore_s)

    def deadline_names(self, model: str, deadline_ms: float | None,
                       prompt_tokens: int = 0) -> tuple[str, str]:
        """What set each of :meth:`budgets_s`'s (warm, restore) deadlines, in words, for a
        refusal to name the budget that applied: the request's own ``deadline_ms``, a
        path's SLO times ``deadline_factor``, or the model's default deadline (the cap, and
        the restore path's before any restore of the model is measured)."""
        if deadline_ms:
            return "the request's deadline_ms", "the request's deadline_ms"
        default_s = self.models.of(model).deadline_ms / 1000.0
        factor = self.config.deadline_factor
        warm_slo_s, restore_slo_s = self.slos_s(model, prompt_tokens)
        default = "the model's default deadline"

        def named(path: str, slo_s: float) -> str:
            return default if factor * slo_s >= default_s else \
                f"the {path} SLO x deadline_factor {factor:g}"
        restore = named("restore-path", restore_slo_s)
        if self.restore_times.p99_ms(model) is None:
            restore = f"{default}: no restore of it measured yet"
        return named("warm-hit", warm_slo_s), restore

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
