"""``rewarm agent run|status`` and ``rewarm agent snapshot ls|verify|evict|restore|drain``.

``run`` starts the node agent (control API, agent loop, zygote pool); the others are clients
of a running agent's control API (``--agent HOST:PORT|unix:PATH``, default ``$REWARM_AGENT``
or 127.0.0.1:7733).  File-level snapshot commands (``inspect|verify PATH``) are under
``rewarm snapshot``.
"""

from __future__ import annotations

import argparse
import json

from agent import logs
from agent.argtypes import host_port, nonneg_int, positive_float, positive_int
from agent.cluster import add_flags
from agent.wire.control import DEFAULT_AGENT, default_agent
from agent.errors import RewarmError
from agent.exitcodes import exit_code


def _client(op: str, **fields):
    def run(args: argparse.Namespace) -> int:
        from agent.wire.control import control_call

        values = {k: getattr(args, v) for k, v in fields.items() if getattr(args, v) is not None}
        try:
            result = control_call(args.agent, op, timeout_s=args.timeout_s, fields=values)
        except (RewarmError, OSError) as exc:
            logs.error(f"{exc}")
            return exit_code(exc)
        print(json.dumps(result, indent=2, default=str))
        return 0
    return run


def _run(args: argparse.Namespace) -> int:
    from agent.node.service import run_agent

    return run_agent(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    agent = subparsers.add_parser("agent", help="the node agent and its control API")
    sub = agent.add_subparsers(dest="agent_command", required=True, metavar="ACTION")

    def client(name: str, help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--agent", default=default_agent(),
                       help="the agent's control address, HOST:PORT or unix:PATH")
        p.add_argument("--timeout-s", type=positive_float, default=600.0,
                       help="how long to wait for the agent's answer (s)")
        return p

    p = sub.add_parser("run", help="run the node agent")
    p.add_argument("--state-dir", required=True, help="catalog, local snapshot tier, sockets, logs")
    p.add_argument("--model-dir", action="append", default=[], required=True,
                   help="HF-layout model this node serves (repeatable)")
    p.add_argument("--release", default=None, help="AOT release directory (rewarm build --out)")
    p.add_argument("--listen", type=host_port, default=DEFAULT_AGENT, help="control API address")
    p.add_argument("--allow-open", action="store_true",
                   help="listen beyond loopback without REWARM_CONTROL_TOKEN (trusted networks)")
    p.add_argument("--node-id", default=None, help="default: the host name")
    p.add_argument("--remote", default=None, help="remote snapshot tier (shared path)")
    p.add_argument("--capacity-gib", type=positive_float, default=64.0, help="local tier capacity")
    p.add_argument("--zygotes", type=nonneg_int, default=1, help="zygotes kept per device")
    p.add_argument("--max-replicas-per-model", type=positive_int, default=None, metavar="N",
                   help="at N replicas of a model, a restore answers with a warm one instead "
                        "of starting another (default: no cap)")
    p.add_argument("--backend", choices=["process", "inproc"], default="process",
                   help="replicas as child processes (default), or in this process (tests, demos)")
    p.add_argument("--buffer-mib", type=positive_int, default=1024, help="restore buffer per zygote")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads per replica")
    p.add_argument("--replica-host", default=None, metavar="HOST",
                   help="replicas also listen on HOST (TCP, any free port) and register that "
                        "address, so front doors on other hosts reach them (process backend)")
    add_flags(p, scaler=False, node_agents=False)   # --registry, --consul (agent/cluster)
    p.add_argument("--nomad-metadata", action="store_true",
                   help="publish cached snapshots as Nomad dynamic node metadata "
                        "(rewarm_snapshots; NOMAD_ADDR, NOMAD_TOKEN honoured)")
    p.add_argument("--nomad-node-id", default=None, metavar="ID",
                   help="the Nomad node to publish for (default: the local Nomad agent's)")
    p.add_argument("--restore", action="append", default=[], metavar="MODEL",
                   help="bring one replica of MODEL up at start (repeatable)")
    p.add_argument("--metrics-listen", type=host_port, default=None, metavar="HOST:PORT",
                   help="serve /metrics, /healthz and /readyz here (port 0: any free port)")
    p.add_argument("--drain-grace-s", type=positive_float, default=30.0,
                   help="at SIGTERM, how long in-flight requests may run before replicas "
                        "stop (systemd TimeoutStopSec and Nomad kill_timeout are set above it)")
    p.set_defaults(func=_run)

    client("status", "the agent's replicas, zygotes, registry health").set_defaults(
        func=_client("status"))
    p = client("restore", "bring up one warm replica of a model")
    p.add_argument("model", help="model name as the agent serves it")
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N] (default: the least busy device of the node)")
    p.set_defaults(func=_client("restore", model="model", device="device"))
    p = client("drain", "drain and stop one replica")
    p.add_argument("replica", help="replica id (rewarm agent status)")
    p.add_argument("--drain-timeout-s", type=positive_float, default=None,
                   help="how long in-flight requests may finish before the stop (s)")
    p.add_argument("--force", action="store_true", default=None,
                   help="stop even the model's last replica before a ready, durable snapshot "
                        "exists")
    p.set_defaults(func=_client("drain", replica="replica", timeout_s="drain_timeout_s",
                                force="force"))
    for op in ("suspend", "resume"):
        p = client(op, f"{op} one replica (GPU nodes: CUDA checkpoint API)")
        p.add_argument("replica", help="replica id (rewarm agent status)")
        p.set_defaults(func=_client(op, replica="replica"))

    snap = sub.add_parser("snapshot", help="the agent's snapshots: ls, verify, evict")
    ssub = snap.add_subparsers(dest="snapshot_command", required=True, metavar="ACTION")
    for name, op, help_, positional in (
            ("ls", "snapshot_list", "list snapshots in the agent's catalog", None),
            ("verify", "snapshot_verify", "re-read every chunk of a local copy", "snapshot"),
            ("evict", "snapshot_evict", "remove a local copy", "snapshot")):
        p = ssub.add_parser(name, help=help_)
        p.add_argument("--agent", default=default_agent(),
                       help="the agent's control address, HOST:PORT or unix:PATH")
        p.add_argument("--timeout-s", type=positive_float, default=600.0,
                       help="how long to wait for the agent's answer (s)")
        if positional:
            p.add_argument(positional, help="snapshot id (rewarm agent snapshot ls)")
            p.set_defaults(func=_client(op, snapshot="snapshot"))
        else:
            p.add_argument("--model", default=None, help="only this model's snapshots")
            p.set_defaults(func=_client(op, model="model"))
