"""The node agent's scale-in: drain one replica, or every one when the agent closes.

A drain takes a replica out of routing first (its registry entry is dropped, so front doors
stop sending to it), then waits up to a bound for the requests already on it, then stops its
process::

    WARM | SUSPENDED ──drain──► DRAINING ── in flight = 0, or the bound passed ──► DEAD

The scale-in guard refuses to drain a model's last live replica while that model has no
ready snapshot that survives this node (``durable(model)``: the ready local copy with a
remote tier configured, agent/node/snapshots.py), so scaling in never leaves a model with
neither a replica nor a way to restore one; a forced drain (node shutdown) skips it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agent.errors import RewarmError
from agent.node.lifecycle import ReplicaState as S
from agent.node.state import NodeState, ReplicaRecord

log = logging.getLogger("agent.node.agent")


class ScaleInBlocked(RewarmError, RuntimeError):
    """Draining would remove the last replica of a model with no ready, durable snapshot.
    Attributes: ``model``, ``replica``."""

    code = 409


class Drainer:
    """Drains replicas of ``state``'s node: ``durable(model)`` is the scale-in guard (True:
    a ready snapshot of ``model`` survives this node); ``sleep(seconds)`` waits between polls
    of a replica's in-flight count (``config.drain_poll_s`` apart; tests pass a fake)."""

    def __init__(self, state: NodeState, *, durable: Callable[[str], bool],
                 sleep: Callable[[float], None]) -> None:
        self.state, self._durable, self._sleep = state, durable, sleep

    def drain(self, replica_id: str, timeout_s: float | None = None,
              force: bool = False) -> dict[str, Any]:
        """Stop new requests (deregister), wait up to ``timeout_s`` (None: the config's
        ``drain_timeout_s``) for in-flight ones, stop.  Returns the replica's description
        with ``in_flight_at_stop`` (requests still running when it stopped).

        Raises ReplicaNotFound for an unknown id, ScaleInBlocked when this is the model's
        last live replica and its snapshot is not ready and durable (unless ``force``, used
        at node shutdown).
        """
        st = self.state
        rec = st.rec(replica_id)
        model = rec.spec.name
        others = [r for r in st.live(model) if r is not rec]
        if not force and not others and not self._durable(model):
            raise ScaleInBlocked(
                f"replica {replica_id} is the last of {model} and no ready, durable snapshot "
                "exists yet; scale-in waits for the capture", model=model, replica=replica_id)
        rec.lifecycle.move(S.DRAINING, "drain")
        st.registrar.drop(replica_id)
        st.record(rec)
        bound = st.config.drain_timeout_s if timeout_s is None else timeout_s
        start = st.clock.now()
        # While it finishes requests it still takes the node's cores: the node's replica
        # limit counts it (agent/node/capacity.py) until they are done, and until its first
        # poll says how many it has (that poll is a call to the worker).
        rec.draining_in_flight = 1
        while rec.handle is not None and (n := rec.handle.in_flight()) > 0:
            rec.draining_in_flight = n
            if st.clock.now() - start >= bound:
                log.warning("drain of %s: %d requests still in flight after %.1f s; stopping",
                            replica_id, n, bound)
                break
            self._sleep(st.config.drain_poll_s)
        left = rec.handle.in_flight() if rec.handle is not None else 0
        self.stop(rec, "drained")
        rec.draining_in_flight = 0
        return {**rec.describe(), "in_flight_at_stop": left}

    def stop(self, rec: ReplicaRecord, reason: str) -> None:
        """Shut ``rec``'s process down (a failure to is logged: the record is dead either
        way) and record it DEAD for ``reason``."""
        if rec.handle is not None:
            try:
                rec.handle.shutdown()
            except (OSError, RewarmError, RuntimeError) as exc:
                log.warning("shutdown of %s: %s", rec.lifecycle.replica_id, exc)
        rec.lifecycle.move(S.DEAD, reason)
        self.state.record(rec)

    def drain_all(self) -> None:
        """Drain every live replica, forced and all at once, so the whole takes at most
        ``drain_timeout_s`` however many there are (the agent's close)."""
        live = [r.lifecycle.replica_id for r in self.state.live()]
        if live:
            with ThreadPoolExecutor(max_workers=len(live), thread_name_prefix="drain") as pool:
                list(pool.map(lambda rid: self.drain(rid, force=True), live))
