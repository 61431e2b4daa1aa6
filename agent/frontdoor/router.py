"""Replica choice: among warm replicas of a model, the one with the most KV headroom that fits.

Pure, no I/O: the server feeds it from its cached registry view (replica heartbeats carry
their load in the service meta) and updates it on every dispatch and completion, so the
request path never asks the registry.  The simulator drives the same class.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.cluster.base import LOAD_META_KEYS as META_KEYS  # the registry meta schema
from agent.cluster.base import ServiceInstance


@dataclass
class ReplicaLoad:
    """One warm replica's load: sequences and KV-cache tokens (capacity and in use)."""

    replica_id: str
    model: str
    address: str  # "host:port" or a Unix socket path
    max_seqs: int
    active_seqs: int
    kv_capacity_tokens: int
    kv_used_tokens: int

    @property
    def headroom_tokens(self) -> int:
        return self.kv_capacity_tokens - self.kv_used_tokens

    def fits(self, need_tokens: int) -> bool:
        return self.active_seqs < self.max_seqs and self.headroom_tokens >= need_tokens

    @classmethod
    def from_instance(cls, inst: ServiceInstance) -> "ReplicaLoad":
        """Build from a ``rewarm-replica`` registry entry (tag ``model=<name>``, meta
        :data:`META_KEYS`, optional meta ``address``: ``host:port`` or a socket path).  Raises ValueError when the tag or a meta value is missing or
        not an integer."""
        model = inst.tag("model")
        if not model:
            raise ValueError(f"replica {inst.id!r} has no model=<name> tag")
        values = {}
        for key in META_KEYS:
            try:
                values[key] = int(inst.meta[key])
            except (KeyError, ValueError):
                raise ValueError(f"replica {inst.id!r}: meta {key!r}="
                                 f"{inst.meta.get(key)!r} is not an integer") from None
        # A replica on a Unix socket has port 0 and its path in meta "address".
        address = inst.meta.get("address") or f"{inst.address}:{inst.port}"
        if address.startswith("unix:"):  # the node agent's and worker's spelling of a socket
            address = address[len("unix:"):]
        return cls(inst.id, model, address, **values)


class Router:
    """The local view of warm replicas, by model."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaLoad] = {}
        self._by_model: dict[str, dict[str, ReplicaLoad]] = {}

    def upsert(self, load: ReplicaLoad) -> None:
        """Add a replica or replace its reported load."""
        old = self._replicas.get(load.replica_id)
        if old is not None and old.model != load.model:
            self.remove(load.replica_id)
        self._replicas[load.replica_id] = load
        self._by_model.setdefault(load.model, {})[load.replica_id] = load

    def remove(self, replica_id: str) -> None:
        load = self._replicas.pop(replica_id, None)
        if load is not None:
            self._by_model.get(load.model, {}).pop(replica_id, None)

    def get(self, replica_id: str) -> ReplicaLoad | None:
        return self._replicas.get(replica_id)

    def choose(self, model: str, need_tokens: int) -> ReplicaLoad | None:
        """The warm replica of ``model`` with the most KV headroom that has a free sequence
        slot and at least ``need_tokens`` of headroom; ties go to fewer active sequences,
        then to the smaller id (deterministic).  None when no replica fits."""
        best = None
        for load in self._by_model.get(model, {}).values():
            if not load.fits(need_tokens):
                continue
            if best is None or (load.headroom_tokens, -load.active_seqs, best.replica_id) > (
                    best.headroom_tokens, -best.active_seqs, load.replica_id):
                best = load
        return best

    def on_dispatch(self, replica_id: str, need_tokens: int) -> None:
        load = self._replicas.get(replica_id)
        if load is not None:
            load.active_seqs += 1
            load.kv_used_tokens += need_tokens

    def on_complete(self, replica_id: str, need_tokens: int) -> None:
        load = self._replicas.get(replica_id)
        if load is not None:
            load.active_seqs = max(0, load.active_seqs - 1)
            load.kv_used_tokens = max(0, load.kv_used_tokens - need_tokens)

    def warm(self, model: str) -> list[ReplicaLoad]:
        return list(self._by_model.get(model, {}).values())

    def models(self) -> list[str]:
        return sorted(m for m, reps in self._by_model.items() if reps)
