"""Extension points for service discovery and scaling.

Two small protocols; their implementations (local: in-process; consul: py-consul; nomad:
python-nomad) are listed in ``agent.cluster.IMPLEMENTATIONS`` and built by
``agent.cluster.choose``.  Code outside ``agent/cluster`` depends on these and on the
package's functions, not on an implementation's module (agent/cluster/__init__.py says what
else it may import).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

LOAD_META_KEYS = ("max_seqs", "active_seqs", "kv_capacity_tokens", "kv_used_tokens")
"""A replica's load in its registry meta (decimal strings): written by the node agent, read
by the front door's router.  Readers ignore keys they do not know (replicas may add more)."""
LOAD_META_LIMITS = {"max_seqs": 1 << 16, "active_seqs": 1 << 16,
                    "kv_capacity_tokens": 1 << 40, "kv_used_tokens": 1 << 40}
"""The most each :data:`LOAD_META_KEYS` value may be: 65,536 sequence slots (KV-cache rows:
thousands at most on one device) and 2^40 tokens of KV cache (a terabyte at one byte a
token).  A reader refuses an entry past them, as one whose value is not an integer: the
admission planner lists a replica's free slots one by one, and the predictor sizes by them."""


SUSPENDED_META_KEY = "suspended"
"""A node agent's parked replicas in its ``rewarm-agent`` meta: ``model@version:replica``
joined by commas ("" when none): the suspended tier, not routable, resumable on that node."""
RESUME_P99_META_KEY = "resume_p99_s"
"""Beside it: that node's p99 resume time in seconds (a decimal string; "" before any resume
was measured): the ETA of a replica from its suspended tier."""


def parked_replicas(meta: dict[str, str], model: str) -> list[str]:
    """The replica ids of ``model`` parked on the node whose agent meta is ``meta``."""
    out = []
    for item in (meta.get(SUSPENDED_META_KEY) or "").split(","):
        name_version, _, replica = item.rpartition(":")
        if replica and name_version.split("@", 1)[0] == model:
            out.append(replica)
    return out


def resume_eta_s(meta: dict[str, str]) -> float | None:
    """The node's resume p99 (seconds) from its agent meta; None when unknown or malformed."""
    try:
        value = float(meta.get(RESUME_P99_META_KEY) or "nan")
    except ValueError:
        return None
    return value if value == value and value >= 0 else None


@dataclass
class ServiceInstance:
    """One registered service instance.

    ``name`` is the service (``rewarm-agent``, ``rewarm-replica``, ``rewarm-frontdoor``);
    ``id`` is unique per instance; ``address``/``port`` is where it listens; ``tags`` carry
    ``model=<name>`` and ``version=<v>`` for replicas; ``meta`` carries string values
    (KV capacity and use, devices free, cached snapshots).
    """

    name: str
    id: str
    address: str
    port: int
    tags: list[str] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)

    def tag(self, key: str) -> str | None:
        prefix = key + "="
        for tag in self.tags:
            if tag.startswith(prefix):
                return tag[len(prefix):]
        return None


class Registry(Protocol):
    """Where instances announce themselves and where routers find healthy ones."""

    def register(self, instance: ServiceInstance, ttl_s: float) -> None:
        """Add or replace ``instance``; it stays healthy while ``pass_ttl`` is called within ``ttl_s``."""
        ...

    def pass_ttl(self, instance_id: str, meta: dict[str, str] | None = None) -> None:
        """Heartbeat: keep ``instance_id`` passing, optionally updating its load meta."""
        ...

    def deregister(self, instance_id: str) -> None:
        ...

    def healthy(self, name: str, tag: str | None = None) -> list[ServiceInstance]:
        """Instances of ``name`` whose check is passing (optionally with ``tag``)."""
        ...


class Scaler(Protocol):
    """Turns a model's desired warm-pool size into running replicas."""

    def set_target(self, model: str, count: int, *, reason: str) -> None:
        """Ask for ``count`` replicas of ``model``; idempotent; may act asynchronously."""
        ...

    def target(self, model: str) -> int:
        """The last target set (or observed) for ``model``."""
        ...
