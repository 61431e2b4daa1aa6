"""What the request path keeps per model, in one record: :class:`ModelState`.

Every per-model fact the front door's collaborators share (the admission queue, the request
shape, the time budgets, the caches of derived figures, the node's replica cap) is a field
here, so that a collaborator names what it reads instead of reaching into another's
attributes.  :class:`ModelStates` is the one dict of them, keyed by model name.

A state is made on first use for a model the front door knows (configured, seen in the
registry, or restored); requests for unknown models are refused before any state is made,
so a client's model names never grow this dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from agent.frontdoor.admission import AdmissionQueue


Slot = tuple[float, float, float, str]
"""One place a queued request could start (agent/frontdoor/planner.py), a plain tuple (the
planner makes thousands per tick and keeps them in a heap): ``(time_s`` the slot is free,
``seen_s`` when its replica entered the view (inf: a replica not up yet), ``step_s`` its
replica's decode step at a full batch, ``replica_id`` ("" for a replica being, or that
could be, restored)``)``."""


class SlotPlan(NamedTuple):
    """The planner's cached view of a model's slots, valid for ``tick_s`` after ``at_s``."""

    at_s: float                  # clock time it was computed
    slots: list[Slot]            # soonest first (a sorted list: a valid heap)
    first_s: float               # the earliest slot's time (inf: none)
    busy_s: dict[str, float]     # replica id -> when the prefills queued there are done


class RestoreRecord(NamedTuple):
    """A restore that ended with a replica: when, by which path, how long it took."""

    at_s: float                  # clock time the answer came
    path: str                    # "snapshot_restore", "cold_boot", "warm_hit", ...
    restore_ms: float | None     # as the node measured it (None: not reported)


@dataclass(slots=True, eq=False)
class ModelState:
    """The request path's state for one model.

    ``deadline_ms``: the default TTFT deadline of a request that names none (the configured
    one, else raised from the measured restore p99: agent/frontdoor/budgets.py).
    ``queue``: the admission queue, made when the first request is held.  ``shape``: EWMA of
    [prompt tokens, max_tokens] of its requests.  ``max_seqs`` / ``max_kv_tokens``: the
    largest replica's batch slots and KV cache (tokens) seen.  ``replica_cap``: the
    replicas of it in view when a node last answered a restore at its replica cap, kept while
    replicas come and go (None: no cap seen, or one a later restore went past);
    ``capped_until_s``: clock time before which no restore is asked (the cap's backoff, or
    the backoff after failed restores); ``restore_failures``: restores failed in a row.
    ``arrivals``, ``cold_arrivals``, ``cold_misses``: generate requests, those that found
    no warm replica, and those of them not served within their SLO (predictor inputs).
    """

    model: str
    deadline_ms: float
    queue: AdmissionQueue | None = None
    shape: list[float] | None = None
    max_seqs: int = 0
    max_kv_tokens: int = 0
    budgets_s: tuple[float, float] | None = None      # (warm, restore) s from arrival
    per_replica: tuple[float, int] | None = None      # (computed at, requests per replica)
    slot_plan: SlotPlan | None = None
    rechecked_s: float = float("-inf")                # when the queue was last re-checked
    capped_until_s: float = 0.0
    restore_failures: int = 0
    replica_cap: int | None = None
    last_restore: RestoreRecord | None = None
    arrivals: int = 0
    cold_arrivals: int = 0
    cold_misses: int = 0

    def mean_shape(self) -> tuple[float, float]:
        """(mean prompt tokens, mean max_tokens); (1, 1) before the first request."""
        shape = self.shape
        return (shape[0], shape[1]) if shape is not None else (1.0, 1.0)


@dataclass(slots=True, eq=False)
class ModelStates:
    """The one dict of :class:`ModelState`, keyed by model; :meth:`of` makes one on first use
    with the model's configured default deadline (``deadlines_ms``), else ``default_ms``."""

    deadlines_ms: dict[str, float]
    default_ms: float
    by_model: dict[str, ModelState] = field(default_factory=dict)

    def of(self, model: str) -> ModelState:
        state = self.by_model.get(model)
        if state is None:
            state = self.by_model[model] = ModelState(
                model, self.deadlines_ms.get(model, self.default_ms))
        return state

    def get(self, model: str) -> ModelState | None:
        return self.by_model.get(model)

    def queue(self, model: str) -> AdmissionQueue | None:
        """``model``'s admission queue, None before its first held request."""
        state = self.by_model.get(model)
        return None if state is None else state.queue

    def queues(self) -> dict[str, AdmissionQueue]:
        """Every admission queue made so far, by model."""
        return {m: s.queue for m, s in self.by_model.items() if s.queue is not None}

    def forget_slots(self, model: str | None = None) -> None:
        """Drop the planner's cached slots of ``model`` (every model's when None): what
        they were computed from has changed."""
        if model is not None:
            state = self.by_model.get(model)
            if state is not None:
                state.slot_plan = None
            return
        for state in self.by_model.values():
            state.slot_plan = None
