"""``rewarm jobs render --model M``: print the replica job for Nomad's API as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from agent.argtypes import positive_int
from agent.cluster.jobs import REPLICA_TEMPLATE, render_replica_job


def register(subparsers) -> None:
    jobs = subparsers.add_parser("jobs", help="Nomad job specs")
    sub = jobs.add_subparsers(dest="jobs_command", required=True)
    render = sub.add_parser("render", help="render the per-model replica job as API JSON")
    render.add_argument("--model", required=True)
    render.add_argument("--max-replicas", type=positive_int, default=8)
    render.add_argument("--template", type=Path, default=REPLICA_TEMPLATE)
    render.set_defaults(func=_render)


def _render(args) -> int:
    job = render_replica_job(args.model, args.max_replicas, args.template)
    json.dump({"Job": job}, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0
