"""``rewarm predictor``: run the predictor (embedded or in a cluster).

Front doors are given with ``--frontdoor HOST:PORT`` or found in Consul
(``rewarm-frontdoor``); the scaler is the node agents' control API (``--scaler local
--node-agent HOST:PORT``; default ``$REWARM_AGENT`` or 127.0.0.1:7733, where ``rewarm agent
run`` listens) or Nomad (``--scaler nomad``; NOMAD_* variables honoured). With
Consul, only the holder of the ``rewarm/predictor/leader`` lock acts. ``--ticks N`` runs N
steps and prints each decision as a JSON line (for scripts and tests).
"""

from __future__ import annotations

import json
import logging
import threading

from agent.argtypes import port, positive_float, positive_int
from agent.cluster import (add_flags, choice_from_args, choose, leader_lock, snapshot_durable,
                           snapshot_summary)

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("predictor", help="forecast demand and keep warm-pool targets")
    p.add_argument("--model", action="append", required=True, metavar="NAME[:MIN:MAX]",
                   help="a model to manage, optionally with its replica bounds (repeatable)")
    # --registry, --consul, --scaler, --node-agent (agent/cluster/__init__.py); a replica
    # job's scaling max is the model's MAX.
    add_flags(p)
    p.add_argument("--frontdoor", action="append", default=[], metavar="HOST:PORT",
                   help="a front door whose stats feed the forecast (repeatable; with Consul: "
                        "found in the registry)")
    p.add_argument("--catalog", help="SQLite catalog for forecast rows (agent/snapshot)")
    p.add_argument("--lead-time-s", type=positive_float, default=15.0,
                   help="how far ahead the forecast looks (s); must exceed restore p99 + "
                        "decision latency")
    p.add_argument("--restore-p99-s", type=positive_float, default=3.6,
                   help="restore time assumed until the node agents report measured ones (s)")
    p.add_argument("--decision-latency-s", type=positive_float, default=1.0,
                   help="from a decision to the scaler acting on it (s)")
    p.add_argument("--occupancy-s", type=positive_float, default=7.0,
                   help="mean time a request holds a sequence slot (s; Little's law's W) until "
                        "a replica reports its speed")
    p.add_argument("--seqs-per-replica", type=positive_int, default=80,
                   help="until a replica reports its KV capacity")
    p.add_argument("--mean-context-tokens", type=positive_float, default=900.0,
                   help="mean KV tokens a request holds, to size sequences per replica from "
                        "its KV capacity")
    p.add_argument("--utilisation", type=float, default=0.75,
                   help="fraction of a replica's sequence slots the plan fills, (0, 1]")
    p.add_argument("--gpu-cost-per-hour", type=positive_float, default=2.80,
                   help="price of one replica-hour ($), for the breakeven keep-alive")
    p.add_argument("--tick-s", type=positive_float, default=1.0,
                   help="seconds between decisions")
    p.add_argument("--ticks", type=positive_int, help="run this many ticks, print decisions, exit")
    p.add_argument("--metrics-port", type=port, help="serve Prometheus /metrics here")
    p.set_defaults(func=_run)


def parse_model(spec: str) -> tuple[str, int, int]:
    """``NAME`` or ``NAME:MIN:MAX`` -> (name, min, max); ConfigError when malformed."""
    from agent.errors import ConfigError

    parts = spec.split(":")
    try:
        if len(parts) == 1:
            return parts[0], 0, 24
        if len(parts) == 3:
            return parts[0], int(parts[1]), int(parts[2])
    except ValueError:
        pass
    raise ConfigError(f"--model {spec!r}: expected NAME or NAME:MIN:MAX", name="model",
                      value=spec, limit="NAME[:MIN:MAX]")


def build(args, clock):
    """Predictor, service and the handles to close, from parsed arguments."""
    from agent.predictor.keepalive import KeepAliveCosts
    from agent.predictor.loop import ModelPolicy, Predictor
    from agent.predictor.service import PredictorService, frontdoor_stats

    costs = KeepAliveCosts(gpu_cost_per_s=args.gpu_cost_per_hour / 3600.0,
                           suspended_cost_per_s=args.gpu_cost_per_hour / 3600.0 / 20.0,
                           restore_s=args.restore_p99_s)
    policies = []
    for spec in args.model:
        name, lo, hi = parse_model(spec)
        policies.append(ModelPolicy(
            name, min_replicas=lo, max_replicas=hi, lead_time_s=args.lead_time_s,
            restore_p99_s=args.restore_p99_s, decision_latency_s=args.decision_latency_s,
            occupancy_s=args.occupancy_s, seqs_per_replica=args.seqs_per_replica,
            mean_context_tokens=args.mean_context_tokens,
            utilisation=args.utilisation, step_s=args.tick_s, costs=costs))
    import os
    import socket

    choice = choice_from_args(args)
    # With Consul: front doors found in the registry, the snapshot summary in KV, and a
    # leader lock held as a name unique per instance (two predictors may share a host name:
    # network namespaces, containers; in Nomad the allocation id is).
    registry = choose("registry", choice, clock=clock) if choice.registry == "consul" else None
    kv = snapshot_summary(choice)
    leader = leader_lock(choice, clock=clock, name=os.environ.get("NOMAD_ALLOC_ID")
                         or f"{socket.gethostname()}-{os.getpid()}")
    # Nomad: NOMAD_TOKEN is the task's workload identity (jobs/rewarm-predictor.nomad.hcl);
    # a replica job it registers scales up to the model's MAX.
    bounds = {p.model: p.max_replicas for p in policies}
    scaler = choose("scaler", choice, clock=clock, max_replicas=lambda m: max(1, bounds[m]))
    catalog = None
    if args.catalog:
        from agent.snapshot.catalog import Catalog
        catalog = Catalog(args.catalog, clock=clock)
    predictor = Predictor(policies, clock=clock, scaler=scaler,
                          snapshot_durable=snapshot_durable(catalog, kv), catalog=catalog)

    # A tenant token for front doors that require one (jobs/rewarm-predictor.nomad.hcl
    # renders it from Nomad Variables).
    doors_token = os.environ.get("REWARM_FRONTDOOR_TOKEN") or None

    def fetch():
        doors = list(args.frontdoor)
        if registry is not None:
            doors += [f"{i.address}:{i.port}" for i in registry.healthy("rewarm-frontdoor")]
        out = {}
        for door in doors:
            try:
                out[door] = frontdoor_stats(door, token=doors_token)
            except (OSError, ValueError) as exc:
                log.warning("predictor: front door %s: %s", door, exc)
        return out

    return PredictorService(predictor, clock=clock, fetch=fetch, leader=leader,
                            scaler=scaler), leader


def _run(args) -> int:
    from agent.clock import SystemClock

    clock = SystemClock()
    service, leader = build(args, clock)
    from agent import sdnotify
    from agent.limits import raise_nofile

    raise_nofile("predictor")
    status = None
    if args.metrics_port:
        from prometheus_client import ProcessCollector

        from agent.health import serve_status
        from agent.cluster import acl_denied_gauge
        ProcessCollector(registry=service.registry)
        service.registry.register(acl_denied_gauge())   # a refused Consul/Nomad token shows here too
        status = serve_status(service.registry, "127.0.0.1", args.metrics_port,
                              ready=service.ready, component="predictor")
    sdnotify.ready()
    stop = threading.Event()
    import signal

    # SIGTERM (Nomad's kill_signal for the job) ends the loop, and the finally below releases
    # the leader lock at once, so a standby takes over on its next tick instead of waiting for
    # the lock's check TTL.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if args.ticks is not None:
            for i in range(args.ticks):
                if i:
                    stop.wait(args.tick_s)
                for d in service.step():
                    print(json.dumps({"model": d.model, "action": d.action, "target": d.target,
                                      "desired": d.desired, "forecast_rps": d.forecast_rps,
                                      "actual_rps": d.actual_rps, "reason": d.reason}),
                          flush=True)
            return 0
        service.run(stop, args.tick_s)
    except KeyboardInterrupt:
        pass
    finally:
        sdnotify.stopping()
        if status is not None:
            status.close()
        if leader is not None:
            leader.release()
    return 0
