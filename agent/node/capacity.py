"""How many replicas this node can run at speed, and the capacity answer that says so.

Replicas on one node share its cores (CPU) or its devices (GPU).  A replica beyond what they
serve adds no capacity: on a two-core machine a third single-threaded replica only takes
time slices from the other two, and every replica's time to first token grows (four
replicas on two cores served 0 of 8 concurrent requests within their deadline).  So:

- on CPU, ``cores // threads`` replicas, where ``cores`` is the CPUs this process may run on
  (``os.sched_getaffinity``, which a cgroup or ``taskset`` narrows; ``os.cpu_count`` where
  that is missing) and ``threads`` each replica's torch threads; a replica started without
  ``--threads`` uses torch's default of one intra-op thread per core (PyTorch, "CPU threading
  and TorchScript inference": ``torch.get_num_threads`` defaults to the physical cores), so
  it has the node to itself: limit 1;
- on GPU, one replica per device (a replica's KV cache takes the memory its weights leave).

The limit counts every replica on the node coming up, warm, or draining with requests still
in flight (it runs until they finish), whatever its model
(:class:`NodeCapacity`, which the restore ladder asks before it starts one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from agent.errors import ConfigError, NoCapacity
from agent.node.lifecycle import ReplicaState as S
from agent.node.state import NodeState


def usable_cores() -> int:
    """CPUs this process may run on (affinity mask; ``os.cpu_count()`` without one; >= 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class ReplicaLimit:
    """Replicas the node runs at speed (``limit``) and the arithmetic behind it (``basis``,
    shown in capacity answers and refusals)."""

    limit: int
    basis: str

    @classmethod
    def for_cpu(cls, cores: int, threads: int | None) -> ReplicaLimit:
        """``cores // threads`` (at least 1); ``threads`` None is torch's default: all cores.
        ConfigError for cores or threads < 1."""
        if cores < 1:
            raise ConfigError(f"cores={cores}; limit is >= 1", name="cores", value=cores, limit=1)
        if threads is None:
            return cls(1, f"{cores} cores; replicas without --threads use them all")
        if threads < 1:
            raise ConfigError(f"threads={threads}; limit is >= 1", name="threads", value=threads,
                              limit=1)
        return cls(max(1, cores // threads), f"{cores} cores // {threads} threads per replica")

    @classmethod
    def for_devices(cls, devices: int) -> ReplicaLimit:
        """One replica per GPU; ConfigError for no device."""
        if devices < 1:
            raise ConfigError(f"devices={devices}; limit is >= 1", name="devices", value=devices,
                              limit=1)
        return cls(devices, f"{devices} GPU device(s), one replica each")

    def answer(self, running: int) -> dict[str, object]:
        """The capacity answer: the limit, its basis, the replicas up or coming, the room."""
        return {"replica_limit": self.limit, "basis": self.basis, "replicas": running,
                "free": max(0, self.limit - running)}


class NodeCapacity:
    """The node's limit over its named state (agent/node/state.py): what is up, whether the
    node is full, the capacity answer.  ``backend`` gives each replica's torch threads
    (``threads``; absent: in-process replicas on torch's default)."""

    def __init__(self, state: NodeState, backend: object) -> None:
        self.state, self.backend = state, backend

    def limit(self) -> ReplicaLimit | None:
        """What this node runs at speed; None without ``limit_to_node``."""
        if not self.state.config.limit_to_node:
            return None
        inventory = self.state.inventory
        if inventory.cpu_only:
            return ReplicaLimit.for_cpu(usable_cores(), getattr(self.backend, "threads", None))
        return ReplicaLimit.for_devices(len(inventory.devices))

    def up(self, model: str | None = None) -> int:
        """Replicas (of ``model``, when given) coming up, warm, or draining with requests
        still in flight (they run until those finish; call with the lock held)."""
        states = (S.COLD, S.RESTORING, S.WARM)
        return sum(1 for r in self.state.replicas.values()
                   if (r.lifecycle.state in states
                       or (r.lifecycle.state is S.DRAINING and r.draining_in_flight > 0))
                   and (model is None or r.spec.name == model))

    def full(self, model: str) -> NoCapacity | None:
        """The refusal for ``model`` when every replica the node serves at speed is taken
        (call with the lock held); None while there is room or without a limit."""
        limit = self.limit()
        if limit is None:
            return None
        running = self.up()
        if running < limit.limit:
            return None
        return NoCapacity(f"model {model!r}: node {self.state.config.node_id} runs "
                          f"{limit.limit} replica(s) at speed ({limit.basis}) and has them all; "
                          f"another would only slow them", model=model,
                          capacity=limit.answer(running))

    def answer(self) -> dict[str, object] | None:
        """The capacity answer (:meth:`ReplicaLimit.answer`); None without a limit."""
        limit = self.limit()
        if limit is None:
            return None
        with self.state.lock:
            return limit.answer(self.up())
