"""The ``rewarm`` command.

Each component owns its subcommands in its own ``cli`` module with one function,
``register(subparsers)``; this module only lists them, so the CLI never reaches into the core.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from agent import exitcodes, logs
from agent.errors import RewarmError

# One place where every subcommand group is registered.
COMMAND_MODULES = (
    "agent.snapshot.cli",    # rewarm snapshot ..., rewarm import
    "agent.replica.cli",     # rewarm model ..., rewarm build, rewarm replica
    "agent.node.cli",        # rewarm agent ...
    "agent.frontdoor.cli",   # rewarm frontdoor, rewarm generate
    "agent.predictor.cli",   # rewarm predictor
    "agent.cluster.cli",     # rewarm jobs render
    "agent.sim.cli",         # rewarm simulate
    "agent.up_cli",          # rewarm up
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rewarm",
        description="Scale-to-zero LLM serving: every cold start after the first is a verified restore.")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", default=os.environ.get("REWARM_LOG_FORMAT") or "text",
                        choices=logs.FORMATS,
                        help="text (default) or json: one object per line with time, level, "
                             "component, message, model/replica/request_id when known "
                             "(default $REWARM_LOG_FORMAT, which the replicas an agent starts "
                             "inherit)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that component is not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status is one of :mod:`agent.exitcodes` (2: bad usage,
    sysexits.h codes for an unreachable service, a refused request, a configuration error)."""
    args = build_parser().parse_args(argv)
    logs.setup(args.log_level, args.log_format)
    try:
        result = args.func(args)
    except BrokenPipeError:
        # The reader went away (``rewarm agent status | head``): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return exitcodes.BROKEN_PIPE
    except (RewarmError, OSError) as exc:
        # A typed error names the thing, the value and the limit: say it, without a traceback
        # (--log-level DEBUG shows where it came from).
        logging.getLogger("agent.cli").debug("command failed", exc_info=True)
        print(f"error: {exc}", file=sys.stderr)
        return exitcodes.exit_code(exc)
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
