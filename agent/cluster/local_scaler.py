"""Embedded default scaler: asks node agents (their control API) to restore, resume,
suspend or drain replicas until a model has its target of serving replicas.

``agents`` maps a node name to a ``call(op, **fields) -> dict`` function (in production
``functools.partial(agent.wire.control.control_call, address)``; tests pass fakes), so this
module needs nothing from ``agent/node``. Ops used (``agent/node/control.py``, the server): ``status``
(``replicas``: ``{"replica", "model", "state"}``), ``restore`` (``model``), ``resume``,
``suspend`` and ``drain`` (``replica``).

Scale-up resumes suspended replicas first (the faster tier), then restores on the node with
the fewest replicas; a node at its replica cap answers with a replica it already has (path
``warm``) and is not asked again in that call.  Replicas coming up (``cold``: a cold boot in
progress, ``restoring``) count toward the target, so a slow cold boot is not doubled. Scale-down releases the newest replicas: suspended when the
predictor's reason says ``release=suspend`` and the node can suspend, else drained. A
node-agent refusal to drain the last replica (409, snapshot not durable) is re-raised as
a retryable ClusterError; so is an unreachable agent.
"""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Callable, Mapping

from agent.clock import Clock, SystemClock
from agent.errors import ClusterError, ConfigError, RewarmError

log = logging.getLogger(__name__)

AgentCall = Callable[..., dict]
UP = ("cold", "restoring", "warm")
"""States that count toward a target: coming up (``cold``: a cold boot in progress; a node
agent keeps no record in ``cold`` otherwise) or serving."""


class LocalScaler:
    """A :class:`agent.cluster.base.Scaler` over one or more node agents."""

    def __init__(self, agents: Mapping[str, AgentCall], clock: Clock | None = None) -> None:
        if not agents:
            raise ConfigError("LocalScaler: no node agents given; limit is >= 1",
                              name="agents", value=0, limit=1)
        self._agents = dict(agents)
        self._clock = clock or SystemClock()
        self._targets: dict[str, int] = {}
        self._parked: dict[str, tuple[str, str, float]] = {}   # replica -> (node, model, at_s)

    def _call(self, node: str, op: str, **fields: Any) -> dict:
        try:
            return self._agents[node](op, **fields)
        except (RewarmError, OSError) as exc:
            status = getattr(exc, "code", None) if isinstance(exc, RewarmError) else None
            raise ClusterError(f"node agent {node}: {op} failed: {exc}", service="agent",
                               status=status, endpoint=op, retryable=True) from exc

    def _replicas(self, model: str) -> list[tuple[str, dict]]:
        out = []
        for node in self._agents:
            for r in self._call(node, "status").get("replicas", []):
                if r.get("model") == model:
                    out.append((node, r))
        return out

    def set_target(self, model: str, count: int, *, reason: str) -> None:
        if count < 0:
            raise ConfigError(f"LocalScaler: count={count} for {model}; limit is >= 0",
                              name="count", value=count, limit=0)
        reps = self._replicas(model)
        serving = [(n, r) for n, r in reps if r.get("state") in UP]
        parked = [(n, r) for n, r in reps if r.get("state") == "suspended"]
        missing = count - len(serving)
        while missing > 0 and parked:
            node, r = parked.pop()
            self._call(node, "resume", replica=r["replica"])
            self._parked.pop(r["replica"], None)
            missing -= 1
        full: set[str] = set()   # nodes at their replica cap (answered with a replica they had)
        while missing > 0 and len(full) < len(self._agents):
            load = {n: 0 for n in self._agents if n not in full}
            for n, _ in serving:
                if n in load:
                    load[n] += 1
            node = min(load, key=lambda n: (load[n], n))
            rep = self._call(node, "restore", model=model)
            if rep.get("path") == "warm":
                full.add(node)
                continue
            serving.append((node, rep))
            missing -= 1
        suspend = "release=suspend" in reason
        # Release the newest warm replicas; one still coming up is left to finish (it cannot
        # be drained yet), and counts again at the next call.
        warm = [(n, r) for n, r in serving if r.get("state") == "warm"]
        extra = max(0, len(serving) - count)
        for node, r in reversed(warm[len(warm) - min(extra, len(warm)):]):   # newest first
            if suspend:
                try:
                    self._call(node, "suspend", replica=r["replica"])
                    self._parked[r["replica"]] = (node, model, self._clock.now())
                    continue
                except ClusterError as exc:   # not suspendable here: stop it instead
                    log.info("local scaler: suspend %s failed (%s); draining", r["replica"], exc)
            self._call(node, "drain", replica=r["replica"])
        self._targets[model] = count

    def expire_parked(self, model: str, park_s: float) -> list[str]:
        """Drain ``model``'s replicas suspended by this scaler more than ``park_s`` ago (the
        keep-alive's suspended stage is over); returns their ids. Failures are logged."""
        now = self._clock.now()
        done = []
        for rid, (node, m, at_s) in list(self._parked.items()):
            if m != model or now - at_s < park_s:
                continue
            try:
                self._call(node, "drain", replica=rid)
            except ClusterError as exc:
                log.warning("local scaler: stopping parked %s failed: %s", rid, exc)
                continue
            del self._parked[rid]
            done.append(rid)
        return done

    def target(self, model: str) -> int:
        """Replicas of ``model`` coming up or warm (states :data:`UP`) on the agents now."""
        try:
            return sum(1 for _, r in self._replicas(model) if r.get("state") in UP)
        except ClusterError as exc:
            log.warning("local scaler: status failed: %s", exc)
            return self._targets.get(model, 0)
