"""The ``rewarm`` command.

Each component owns its subcommands in its own ``cli`` module with one function,
``register(subparsers)``; this module only lists them, so the CLI never reaches into the core.
"""

from __future__ import annotations

import argparse
import errno
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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rewarm")
    except PackageNotFoundError:   # run from a checkout that was never installed
        return "unknown (not installed)"


def _log_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``--log-level`` and ``--log-format``, on the top parser (with the defaults) and on
    every subcommand (without: given after the command, they override the ones before)."""
    default = (lambda value: value) if top else (lambda value: argparse.SUPPRESS)
    parser.add_argument("--log-level", default=default("INFO"), type=logs.level_name,
                        metavar="LEVEL", help="DEBUG, INFO (default), WARNING or ERROR, any case")
    parser.add_argument("--log-format", default=default(os.environ.get("REWARM_LOG_FORMAT")
                                                        or "text"),
                        choices=logs.FORMATS,
                        help="text (default) or json: one object per line with time, level, "
                             "component, message, model/replica/request_id when known "
                             "(default $REWARM_LOG_FORMAT, which the replicas an agent starts "
                             "inherit)")


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:   # argparse keeps subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                yield child
                yield from _subparsers(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rewarm",
        description="Scale-to-zero LLM serving: every cold start after the first is a verified restore.")
    parser.add_argument("--version", action="version", version=f"rewarm {_version()}")
    _log_options(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that component is not built yet
                continue
            raise
        module.register(sub)
    for child in _subparsers(parser):
        _log_options(child, top=False)
        child.set_defaults(_parser=child)   # the innermost chosen one is set last
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that arguments no parser knows are reported by the
    subcommand they were given to, with its usage (argparse's own check names the top
    parser's usage and puts a flag's stray value among them)."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        owner = getattr(args, "_parser", parser)
        owner.error("unrecognized arguments: " + " ".join(extra)
                    + " (see " + owner.prog + " --help)")
    return args


def port_in_use(exc: BaseException) -> bool:
    """An address this command was told to listen on is taken (EADDRINUSE) or is not this
    host's (EADDRNOTAVAIL): a configuration error (:data:`exitcodes.EX_CONFIG`)."""
    return isinstance(exc, OSError) and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


def main(argv: list[str] | None = None) -> int:
    """Run one command; the exit status is one of :mod:`agent.exitcodes` (2: bad usage,
    sysexits.h codes for an unreachable service, a refused request, a configuration error)."""
    args = parse(build_parser(), argv)
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
        if isinstance(exc, OSError) and port_in_use(exc):
            logs.error(f"{exc.strerror or exc}: the address is in use or not this host's; "
                       "stop the process that holds it or choose another port",
                       exit_code=exitcodes.EX_CONFIG)
            return exitcodes.EX_CONFIG
        code = exitcodes.exit_code(exc)
        logs.error(str(exc), exit_code=code)
        return code
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
