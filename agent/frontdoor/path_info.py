"""The request path's answers to ``health``, ``models`` and ``stats`` (docs/protocol.md).

``stats`` is what the predictor and the dashboards read: the request path's counters, per
model its arrivals and cold arrivals (those that found no warm replica) with their SLO
misses, the queues, the restores in flight, the mean request lengths it sees (``lengths``)
and each warm replica's use, measured speed and the capacity it sustained while backlogged
(agent/speed.py, agent/throughput.py: what the predictor sizes the warm pool with).
"""

from __future__ import annotations

from typing import Any

from agent.frontdoor.model_state import ModelStates
from agent.frontdoor.router import ReplicaLoad, Router


def replica_entry(load: ReplicaLoad) -> dict[str, Any]:
    """One warm replica in ``stats``: its model, use, slots and, once measured, its speed
    (floats, agent/speed.py's keys) and sustained capacity (agent/throughput.py's keys)."""
    out: dict[str, Any] = {"model": load.model, "active_seqs": load.active_seqs,
                           "max_seqs": load.max_seqs, "kv_used_tokens": load.kv_used_tokens,
                           "kv_capacity_tokens": load.kv_capacity_tokens}
    if load.speed is not None:
        out.update(load.speed.to_dict())
    if load.backlog is not None:
        out.update(load.backlog.to_meta())
    return out


def info_answer(op: str, connections: int, *, counts: dict[str, int], known_models: set[str],
                models: ModelStates, router: Router, restores_in_flight: int) -> dict:
    """The answer to ``op`` (``health``, ``models``, else ``stats``); ``connections``: the
    entrance's open client connections."""
    if op == "health":
        return {"status": "ok", "connections": connections}
    if op == "models":
        return {m: {"warm": len(router.warm(m)), "queued": len(models.queue(m) or ())}
                for m in sorted(known_models)}
    # every known model from 0: a reader's first reading is its baseline, so a counter
    # that first appeared at 1 would hide the model's first request (and cold arrival)
    names = sorted(known_models)   # (a request's model is known before it counts)
    states = {m: models.get(m) for m in names}
    return {**counts,
            "arrivals": {m: s.arrivals if s else 0 for m, s in states.items()},
            "connections": connections,
            "cold": {m: {"arrivals": s.cold_arrivals if s else 0,
                         "misses": s.cold_misses if s else 0} for m, s in states.items()},
            "restores_in_flight": restores_in_flight,
            "queued": {m: len(q) for m, q in models.queues().items() if q},
            "lengths": {m: dict(zip(("mean_prompt_tokens", "mean_gen_tokens"),
                                    s.mean_shape(), strict=True))
                        for m, s in states.items() if s is not None and s.shape is not None},
            "replicas": {r.replica_id: replica_entry(r)
                         for m in router.models() for r in router.warm(m)}}
