"""``rewarm jobs render|run`` (Nomad's parser, Nomad's API) and ``rewarm hold MODEL`` (the
task of a replica allocation)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from agent import logs
from agent.argtypes import positive_float, positive_int
from agent.errors import ConfigError, RewarmError
from agent.exitcodes import exit_code


def _var(text: str) -> tuple[str, str]:
    import argparse

    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def register(subparsers) -> None:
    from agent.wire.control import default_agent
    from agent.cluster.jobs import REPLICA_TEMPLATE

    jobs = subparsers.add_parser("jobs", help="Nomad job specs (through Nomad's own parser)")
    sub = jobs.add_subparsers(dest="jobs_command", required=True)
    render = sub.add_parser("render", help="the per-model replica job as Nomad parses it "
                                           "(POST /v1/jobs/parse; NOMAD_ADDR)")
    render.add_argument("--model", required=True, help="model the replica job serves")
    render.add_argument("--max-replicas", type=positive_int, default=8,
                        help="the job's scaling max")
    render.add_argument("--template", type=Path, default=REPLICA_TEMPLATE,
                        help="jobspec template (default: jobs/rewarm-replica.nomad.hcl)")
    render.set_defaults(func=_render)
    run = sub.add_parser("run", help="parse FILE with -var values and register it "
                                     "(nomad job run -var ..., without the nomad binary)")
    run.add_argument("file", type=Path, help="jobspec (HCL2)")
    run.add_argument("--var", "-var", action="append", default=[], type=_var,
                     metavar="NAME=VALUE", help="a job variable (repeatable)")
    run.set_defaults(func=_run)

    hold = subparsers.add_parser("hold", help="the task of a replica allocation: restore "
                                              "MODEL on this node's agent, hold it, drain on SIGTERM")
    hold.add_argument("model", help="model to restore and hold")
    hold.add_argument("--agent", default=default_agent(),
                      help="the node agent's control address, HOST:PORT or unix:PATH")
    hold.add_argument("--timeout-s", type=positive_float, default=600.0,
                      help="how long the restore may take (s)")
    hold.add_argument("--poll-s", type=positive_float, default=1.0,
                      help="how often the held replica is checked (s)")
    hold.add_argument("--drain-timeout-s", type=positive_float, default=30.0,
                      help="at SIGTERM, how long in-flight requests may finish (s)")
    hold.set_defaults(func=_hold)


def _render(args) -> int:
    from agent.cluster.jobs import replica_job
    from agent.cluster.nomad_http import nomad_client

    try:
        job = replica_job(nomad_client(), args.model, args.max_replicas, args.template)
    except RewarmError as exc:   # a bad --model: 2; Nomad unreachable: 69, its ACL: 77
        logs.error(f"{exc}")
        return 2 if isinstance(exc, ConfigError) else exit_code(exc)
    json.dump({"Job": job}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def _run(args) -> int:
    from agent.cluster.jobs import register_job
    from agent.cluster.nomad_http import nomad_client

    try:
        out = register_job(nomad_client(), args.file.read_text(), dict(args.var))
    except (RewarmError, OSError) as exc:   # and a FILE that does not exist: 66
        logs.error(f"{exc}")
        return 2 if isinstance(exc, ConfigError) else exit_code(exc)
    print(json.dumps(out))
    return 0


def _hold(args) -> int:
    from agent.cluster.hold import run_hold

    return run_hold(args)
