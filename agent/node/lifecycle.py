"""The replica state machine: the one place that says which lifecycle moves are legal.

::

                       restore fails (fail closed)
                 ┌──────────────────────────────┐
                 ▼                              │
    ┌──────┐ restore  ┌───────────┐ golden ok ┌──────┐ suspend ┌───────────┐
    │ cold │────────► │ restoring │─────────► │ warm │───────► │ suspended │
    └──────┘          └───────────┘           └──────┘ ◄─────── └───────────┘
       │ cold boot        │ give up              │      resume       │
       └──────────────────┼──────────► warm      │ drain             │ drain / resume fails
                          ▼                      ▼                   ▼
                        dead ◄────────────── draining ◄──────────────┘
                                   in-flight done or bound passed

* ``cold → restoring``: a zygote takes a snapshot restore (or ``cold → warm`` by cold boot).
* ``restoring → warm``: restored and golden check passed; ``restoring → cold``: the restore
  failed closed (the next attempt is another snapshot, a staged copy or a cold boot).
* ``warm ⇄ suspended``: CUDA checkpoint lock+checkpoint / restore+unlock (GPU nodes only).
* ``warm | suspended → draining → dead``; any state may go to ``dead`` when its process dies.

Replica states and names are the catalog's ``replicas`` states (docs/architecture.md,
"Snapshots"), plus ``suspended`` (docs/architecture.md, "Tiers of warmth").
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field

from agent.clock import Clock, SystemClock
from agent.errors import RewarmError


class ReplicaState(enum.StrEnum):
    COLD = "cold"
    RESTORING = "restoring"
    WARM = "warm"
    SUSPENDED = "suspended"
    DRAINING = "draining"
    DEAD = "dead"


S = ReplicaState
TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    S.COLD: frozenset({S.RESTORING, S.WARM, S.DEAD}),
    S.RESTORING: frozenset({S.WARM, S.COLD, S.DEAD}),
    S.WARM: frozenset({S.SUSPENDED, S.DRAINING, S.DEAD}),
    S.SUSPENDED: frozenset({S.WARM, S.DRAINING, S.DEAD}),
    S.DRAINING: frozenset({S.DEAD}),
    S.DEAD: frozenset(),
}
"""Legal moves; anything else raises :class:`IllegalTransition`."""

SERVING = frozenset({S.WARM})
"""States in which a replica takes new requests."""


class IllegalTransition(RewarmError, RuntimeError):
    """A lifecycle move the diagram does not allow (409: the replica's state refuses it, e.g.
    suspending one that is not warm). Attributes: ``replica``, ``value``, ``limit``."""

    code = 409


@dataclass
class Lifecycle:
    """One replica's state with its history ``[(state, at_s, reason)]``, thread-safe."""

    replica_id: str
    clock: Clock = field(default_factory=SystemClock)
    state: ReplicaState = S.COLD
    history: list[tuple[ReplicaState, float, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.history.append((self.state, self.clock.now(), "created"))

    def move(self, to: ReplicaState, reason: str = "") -> ReplicaState:
        """Move to ``to``; returns the previous state. Raises IllegalTransition."""
        to = ReplicaState(to)
        with self._lock:
            before = self.state
            if to not in TRANSITIONS[before]:
                allowed = sorted(s.value for s in TRANSITIONS[before])
                raise IllegalTransition(
                    f"replica {self.replica_id}: {before.value} -> {to.value} is not allowed; "
                    f"from {before.value} only {allowed}",
                    replica=self.replica_id, value=(before.value, to.value), limit=allowed)
            self.state = to
            self.history.append((to, self.clock.now(), reason))
            return before

    @property
    def serving(self) -> bool:
        return self.state in SERVING

    def seconds_in_state(self) -> float:
        return self.clock.now() - self.history[-1][1]
