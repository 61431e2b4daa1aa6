"""Asking for capacity: restores triggered by queued requests, capped against thundering herds.

:class:`CapacityRequester` is the extension point the server calls (one method).  Two
implementations: :class:`NodeAgentCapacity` asks node agents' control API (the same msgpack
framing, op ``restore``) trying nodes that cache the model's snapshot first, and
:class:`ScalerCapacity` raises a :class:`~agent.cluster.base.Scaler`'s target (Nomad in a
cluster) and waits for the new replica to turn up warm.  :class:`RestoreGate` is the pure
bookkeeping that caps restores in flight per model and overall; the simulator uses it too.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass
from typing import Protocol
from collections.abc import Callable

from agent.cluster.base import Scaler
from agent.errors import ConfigError, NoCapacity
from agent.frontdoor.router import ReplicaLoad
from agent.protocol import Decoder, pack

PATHS = ("warm_hit", "suspended_resume", "snapshot_restore", "cold_boot")
# The node agent's names for how a replica came up -> the telemetry path.
NODE_PATHS = {"restore": "snapshot_restore", "staged_restore": "snapshot_restore",
              "resume": "suspended_resume", "cold_boot": "cold_boot", "warm": "warm_hit"}
AGENT_SERVICE = "rewarm-agent"


@dataclass
class RestoreResult:
    """A finished restore: the new replica (None when it will appear through the registry),
    the path it took (one of :data:`PATHS`) and how long it took (ms, None if unknown)."""

    replica: ReplicaLoad | None
    path: str = "snapshot_restore"
    restore_ms: float | None = None


class CapacityRequester(Protocol):
    async def request_restore(self, model: str) -> RestoreResult:
        """Make one more warm replica of ``model``.  Raises :class:`NoCapacity` when no node
        can (after trying every candidate)."""
        ...


class RestoreGate:
    """Caps restores in flight: ``per_model`` for each model and ``overall`` in total.

    ``wanted(model, queued, per_replica)`` says how many more to start now: enough new
    replicas for ``queued`` requests at ``per_replica`` each, less those in flight, within
    both caps.  ``per_replica`` is the measured sustainable concurrency of one replica at
    the TTFT SLO (:meth:`agent.speed.SpeedProfile.sustainable_concurrency`;
    docs/architecture.md, "Capacity from measured rates"), not its KV slots; ``requests_per_restore`` is used only when the
    caller has no measurement to give.  ``started_s`` keeps when each in-flight restore
    began (clock seconds), for the admission's ETA.
    """

    def __init__(self, *, per_model: int = 2, overall: int = 8,
                 requests_per_restore: int = 8) -> None:
        for name, value in (("per_model", per_model), ("overall", overall),
                            ("requests_per_restore", requests_per_restore)):
            if value < 1:
                raise ConfigError(f"RestoreGate {name}={value} must be >= 1", name=name,
                                  value=value, limit=1)
        self.per_model, self.overall = per_model, overall
        self.requests_per_restore = requests_per_restore
        self.in_flight: dict[str, int] = {}
        self.started_s: dict[str, list[float]] = {}
        self.total = 0

    def wanted(self, model: str, queued: int, per_replica: int | None = None) -> int:
        if queued <= 0:
            return 0
        need = math.ceil(queued / max(1, per_replica or self.requests_per_restore))
        have = self.in_flight.get(model, 0)
        return max(0, min(need - have, self.per_model - have, self.overall - self.total))

    def room(self, model: str) -> int:
        """Restores that could still start now for ``model`` within both caps."""
        have = self.in_flight.get(model, 0)
        return max(0, min(self.per_model - have, self.overall - self.total))

    def started(self, model: str, now_s: float = 0.0) -> None:
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        self.started_s.setdefault(model, []).append(now_s)
        self.total += 1

    def finished(self, model: str) -> None:
        left = self.in_flight.get(model, 0) - 1
        starts = self.started_s.get(model)
        if starts:
            starts.pop(0)  # restores of one model are alike: the oldest counts as done
        if left > 0:
            self.in_flight[model] = left
        else:
            self.in_flight.pop(model, None)
            self.started_s.pop(model, None)
        self.total = max(0, self.total - 1)


class RestoreTimes:
    """Recent restore durations per model and tier (path) and their p99 and p50 (nearest
    rank over the last ``window`` restores).  Admission plans with the restore latency's
    p99, not its mean (docs/architecture.md, "Admission").
    Without a ``path``, :meth:`p99_ms` and :meth:`p50_ms` are of the tier the model's last
    restore took, cold boots aside: the next restore most likely takes it too, and a cold boot predicts nothing about the next
    one (it happens once per model version; every later start is a snapshot restore,
    docs/architecture.md), so a model measured only cold-booting has no default p99."""

    def __init__(self, window: int = 64) -> None:
        self.window = window
        self._samples: dict[tuple[str, str], list[float]] = {}
        self._q: dict[tuple[str, str], tuple[float, float]] = {}  # -> (p50, p99)
        self._last: dict[str, str] = {}

    def record(self, model: str, restore_ms: float, path: str = "snapshot_restore") -> None:
        key = (model, path)
        samples = self._samples.setdefault(key, [])
        samples.append(float(restore_ms))
        del samples[:-self.window]
        ordered = sorted(samples)
        self._q[key] = (ordered[max(0, math.ceil(0.5 * len(ordered)) - 1)],
                        ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)])
        if path != "cold_boot":
            self._last[model] = path

    def p99_ms(self, model: str, path: str | None = None) -> float | None:
        """p99 (ms) of ``model``'s restores on ``path`` (default: its last restore's)."""
        q = self._q.get((model, path or self._last.get(model, "")))
        return None if q is None else q[1]

    def p50_ms(self, model: str, path: str | None = None) -> float | None:
        q = self._q.get((model, path or self._last.get(model, "")))
        return None if q is None else q[0]


class NodeAgentCapacity:
    """Restores through node agents' control API: ``{"op": "restore", "model": M}`` answered
    by ``{"type": "result", "result": {"replica": {...ReplicaLoad fields}, "path",
    "restore_ms"}}`` or an error; it carries the control API ``token`` (default
    ``$REWARM_CONTROL_TOKEN``) when there is one.  ``nodes()`` returns candidate ``(host, port)`` pairs, those
    caching the model's snapshot first; each failure moves on to the next node."""

    def __init__(self, nodes: Callable[[str], list[tuple[str, int]]], *,
                 timeout_s: float = 120.0, token: str | None = None) -> None:
        from agent.wire.control import control_token

        self._nodes = nodes
        self._timeout_s = timeout_s
        self._token = (token if token is not None else control_token()) or None
        self._ids = itertools.count(1)

    async def request_restore(self, model: str) -> RestoreResult:
        reasons = []
        loop = asyncio.get_running_loop()
        for host, port in await asyncio.to_thread(self._nodes, model):
            started = loop.time()
            try:
                result = await asyncio.wait_for(self._ask(host, port, model), self._timeout_s)
                if result.restore_ms is None:  # the node did not say: what the front door saw
                    result.restore_ms = (loop.time() - started) * 1000.0
                return result
            except (TimeoutError, OSError, ValueError, KeyError, TypeError) as exc:
                reasons.append(f"{host}:{port}: {type(exc).__name__}: {exc}")
        raise NoCapacity(f"model {model!r}: no node could restore a replica "
                         f"({'; '.join(reasons) or 'no candidate nodes'})", model=model)

    async def _ask(self, host: str, port: int, model: str) -> RestoreResult:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            rid = next(self._ids)
            ask = {"op": "restore", "id": rid, "model": model}
            if self._token is not None:
                ask["token"] = self._token
            writer.write(pack(ask))
            decoder = Decoder()
            while True:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("node agent closed the connection")
                for msg in decoder.feed(data):
                    if msg.get("id") != rid:
                        continue
                    if msg.get("type") == "error":
                        raise ValueError(f"{msg.get('code')}: {msg.get('reason')}")
                    return _result(msg["result"])
        finally:
            writer.close()


def _result(result: dict) -> RestoreResult:
    """Read a node agent's ``restore`` answer (agent/node/agent.py ``ReplicaRecord.describe``).

    The replica is used at once when the answer carries its ``address`` and ``load`` (the
    :data:`~agent.frontdoor.router.META_KEYS` ints, and the speed and queue keys when the
    replica reports them), or when ``replica`` is itself a map of
    :class:`ReplicaLoad` fields; otherwise it is found through the registry.  ``path`` uses
    the node agent's names (:data:`NODE_PATHS`).  Raises KeyError/ValueError/TypeError on a
    malformed answer."""
    rep = result.get("replica")
    load = None
    if isinstance(rep, dict):
        load = ReplicaLoad(**rep)
    elif isinstance(rep, str) and result.get("address") and isinstance(result.get("load"), dict):
        address = str(result["address"])
        if address.startswith("unix:"):
            address = address[len("unix:"):]
        load = ReplicaLoad.from_meta(rep, str(result.get("model", "")), address, result["load"])
    path = result.get("path") or "snapshot_restore"
    return RestoreResult(load, NODE_PATHS.get(path, path if path in PATHS else
                                              "snapshot_restore"), result.get("restore_ms"))


def nodes_from_registry(registry) -> Callable[[str], list[tuple[str, int]]]:
    """Candidate node agents for a model from ``registry``'s passing ``rewarm-agent``
    instances: those with a parked replica of it first (the suspended tier, meta
    ``suspended``; the lowest resume ETA, meta ``resume_p99_s``, first: their restore is a
    resume), then those whose meta ``snapshots`` lists ``<model>@<version>``, then the rest
    (a cold boot is still a way up)."""
    from agent.cluster.base import parked_replicas, resume_eta_s

    def nodes(model: str) -> list[tuple[str, int]]:
        agents = registry.healthy(AGENT_SERVICE)
        def caches(inst) -> bool:
            return any(s.split("@", 1)[0] == model
                       for s in inst.meta.get("snapshots", "").split(",") if s)

        def tier(inst) -> tuple[bool, float]:
            if not parked_replicas(inst.meta, model):
                return True, 0.0
            known = resume_eta_s(inst.meta)
            return False, float("inf") if known is None else known
        agents.sort(key=lambda inst: (*tier(inst), not caches(inst), inst.id))
        return [(inst.address, inst.port) for inst in agents]
    return nodes


class ScalerCapacity:
    """Restores by raising a :class:`Scaler`'s target by one and waiting (polling the front
    door's cached view through ``warm_count``) until a replica more than before is warm;
    serialised per model by :class:`agent.cluster.scale_up.ScaleUp`.  Raises
    :class:`NoCapacity` when the scaler refuses or none shows within ``timeout_s``."""

    def __init__(self, scaler: Scaler, warm_count: Callable[[str], int], *,
                 timeout_s: float = 120.0, poll_s: float = 0.05) -> None:
        from agent.cluster.scale_up import ScaleUp

        self.up = ScaleUp(scaler, warm_count, timeout_s=timeout_s, poll_s=poll_s)

    async def request_restore(self, model: str) -> RestoreResult:
        elapsed_s = await self.up.one_more(model)
        return RestoreResult(None, "snapshot_restore", elapsed_s * 1000.0)
