"""The request path's view of the replicas: what the registry and restores report, merged
with what this front door has dispatched and not yet seen answered.

:class:`ReplicaView` keeps the router's loads current (:meth:`ReplicaView.upsert`,
:meth:`ReplicaView.apply`) and remembers, per replica, when it entered the view
(:meth:`ReplicaView.first_seen`: which path's deadline a request has there) and which
restore brought it up (:meth:`ReplicaView.came_up`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agent.clock import Clock
from agent.cluster.base import ServiceInstance
from agent.frontdoor.model_state import ModelStates, RestoreRecord
from agent.frontdoor.router import ReplicaLoad, Router

if TYPE_CHECKING:  # pragma: no cover
    from agent.frontdoor.links import ReplicaLink

log = logging.getLogger("agent.frontdoor.request_path")

FIRST_SEEN_MAX = 4096
"""Replicas whose first-seen time is remembered (oldest first out)."""
CAME_UP_MAX = 1024
"""Replicas whose restore is remembered (oldest first out)."""


class ReplicaView:
    """The router's loads kept current, and what is known of each replica's arrival.

    ``links``: the request path's replica links by replica id (read: what is in flight at
    each; written: an idle link to a replica gone from the registry is hung up);
    ``known_models``: models the front door serves (a model seen in the registry is added);
    ``suspects``: replicas found silent after a dispatch (agent/frontdoor/first_token.py),
    kept out of the view, and their links kept for the probe, until they answer one.
    """

    def __init__(self, router: Router, clock: Clock, models: ModelStates,
                 links: dict[str, ReplicaLink], known_models: set[str],
                 registry_poll_s: float, suspects: dict[str, float] | None = None) -> None:
        self.router = router
        self.clock = clock
        self.models = models
        self.links = links
        self.known_models = known_models
        self.registry_poll_s = registry_poll_s
        self.suspects = suspects if suspects is not None else {}
        self._first_seen: dict[str, float] = {}       # replica id -> when it entered the view
        self._upserted: dict[str, float] = {}         # replica id -> when a restore reported it
        self._came_up: dict[str, RestoreRecord] = {}  # replica id -> the restore that made it

    def first_seen(self, replica_id: str) -> float:
        """Clock time ``replica_id`` entered the view (-inf: before this front door knew)."""
        return self._first_seen.get(replica_id, float("-inf"))

    def came_up(self, replica_id: str) -> RestoreRecord | None:
        """The restore that brought ``replica_id`` up, if this front door asked for it."""
        return self._came_up.get(replica_id)

    def restored(self, model: str, load: ReplicaLoad, record: RestoreRecord) -> None:
        """A restore of ``model`` answered with ``load``'s replica: into the view, and (unless
        the answer was an existing replica, ``warm_hit``) remembered as brought up by
        ``record``."""
        state = self.models.of(model)
        state.max_seqs = max(state.max_seqs, load.max_seqs)
        self.upsert(load)
        if record.path != "warm_hit":
            self._came_up[load.replica_id] = record
            while len(self._came_up) > CAME_UP_MAX:       # oldest first out
                del self._came_up[next(iter(self._came_up))]
        self.known_models.add(model)
        self._upserted[load.replica_id] = self.clock.now()

    def upsert(self, load: ReplicaLoad) -> None:
        """Put a reported load in the router, raised to at least what this front door has
        dispatched to the replica and not yet seen answered (a report may predate them)."""
        link = self.links.get(load.replica_id)
        if link is not None and link.in_flight:
            ours = list(link.in_flight.values())
            waiting = [f for f in ours if f.ttft_s is None]
            load.active_seqs = max(load.active_seqs, len(ours))
            load.kv_used_tokens = max(load.kv_used_tokens, sum(f.need_tokens for f in ours))
            load.waiting_seqs = max(load.waiting_seqs, len(waiting))
            load.queued_prefill_tokens = max(load.queued_prefill_tokens,
                                             sum(f.prompt_tokens for f in waiting))
        state = self.models.of(load.model)
        if load.max_seqs > state.max_seqs:
            state.max_seqs = load.max_seqs
        if load.kv_capacity_tokens > state.max_kv_tokens:
            state.max_kv_tokens = load.kv_capacity_tokens
        state.slot_plan = None
        if self.router.get(load.replica_id) is None:
            self._first_seen[load.replica_id] = self.clock.now()
            while len(self._first_seen) > FIRST_SEEN_MAX:     # oldest first out
                del self._first_seen[next(iter(self._first_seen))]
        self.router.upsert(load)

    def apply(self, instances: list[ServiceInstance]) -> None:
        """Replace the router's view with these passing replicas.  A replica's reported use
        is raised to at least what this front door has dispatched to it; one missing from
        the list leaves the view unless a restore reported it within the last
        3 x ``registry_poll_s`` (it may not be registered yet).  An idle link to a replica
        gone from both is hung up (not a suspect's: it carries the probe)."""
        seen = set()
        suspects = self.suspects
        for inst in instances:
            if suspects and inst.id in suspects:
                continue          # silent: out of the view until it answers a probe
            try:
                load = ReplicaLoad.from_instance(inst)
            except ValueError as exc:
                log.warning("ignoring replica: %s", exc)
                continue
            seen.add(load.replica_id)
            self.known_models.add(load.model)
            self.upsert(load)
        now = self.clock.now()
        grace_s = 3 * self.registry_poll_s
        for model in self.router.models():
            for load in self.router.warm(model):
                if load.replica_id not in seen and now - self._upserted.get(
                        load.replica_id, -grace_s) >= grace_s:
                    self.router.remove(load.replica_id)
                    self._upserted.pop(load.replica_id, None)
        for rid, link in list(self.links.items()):  # gone and idle: hang up
            if rid not in seen and not link.in_flight and self.router.get(rid) is None \
                    and rid not in suspects:
                del self.links[rid]
                link.closed = True
                if link.transport is not None:
                    link.transport.close()
