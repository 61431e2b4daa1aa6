"""The request path's answers to ``health``, ``models`` and ``stats`` (docs/protocol.md).

``stats`` is what the predictor and the dashboards read: the request path's counters, per
model its arrivals and cold arrivals (those that found no warm replica) with their SLO
misses, the queues, the restores in flight and each warm replica's use.
"""

from __future__ import annotations

from agent.frontdoor.model_state import ModelStates
from agent.frontdoor.router import Router


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
            "replicas": {r.replica_id: {"model": r.model, "active_seqs": r.active_seqs,
                                        "kv_used_tokens": r.kv_used_tokens,
                                        "kv_capacity_tokens": r.kv_capacity_tokens}
                         for m in router.models() for r in router.warm(m)}}
