"""Assembles a node agent from settings and runs it: control API, agent loop, zygote pool.

``build_agent`` is what ``rewarm agent run``, ``rewarm up`` and the fault-matrix benchmark
call; ``run_agent`` serves until SIGTERM/SIGINT, then drains every replica (forced, at most
``--drain-grace-s``) and deregisters.  With ``--metrics-listen`` it serves ``/metrics``,
``/healthz`` and ``/readyz`` (agent/node/metrics.py); under systemd it says READY=1 once the
control API listens, feeds the watchdog while the agent loop ticks, and says STOPPING=1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from agent import sdnotify
from agent import logs
from agent.cluster import (ClusterChoice, choice_from_args, choose, cluster_model_catalog,
                           node_metadata, snapshot_summary)
from agent.cluster.base import Registry
from agent.errors import ConfigError
from agent.health import serve_status
from agent.limits import raise_nofile
from agent.node.agent import AgentConfig, NodeAgent
from agent.node.backend import Backend, InProcessBackend, ModelSpec
from agent.node.control import ControlServer, check_control_bind
from agent.node.inventory import Inventory
from agent.node.metrics import readiness
from agent.snapshot.catalog import Catalog
from agent.snapshot.store import LocalStore
from agent.wire.control import control_token

log = logging.getLogger(__name__)


def build_agent(state_dir: Path, model_dirs: list[Path], *, backend: Backend | None = None,
                registry: Registry | None = None, remote_root: Path | None = None,
                capacity_bytes: int = 64 << 30, node_id: str | None = None,
                release: Path | None = None, listen: str = "127.0.0.1:0",
                zygotes_per_device: int = 1, suspender=None, summary=None,
                node_meta=None, **config) -> NodeAgent:
    """A NodeAgent with its catalog (``state_dir/catalog.db``) and local tier
    (``state_dir/snapshots``).  Defaults: in-process backend, at most the replicas the
    node's cores or devices serve at speed (``limit_to_node``, agent/node/capacity.py), the
    embedded default's registry (:func:`agent.cluster.choose` of a default :class:`~agent.cluster.ClusterChoice`),
    and on a node with a GPU the CUDA checkpoint suspender when the driver has the API (r570+)."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    host, _, port = listen.rpartition(":")
    config.setdefault("limit_to_node", True)   # a node runs what its cores serve at speed
    cfg = AgentConfig(node_id=node_id or socket.gethostname(), remote_root=remote_root,
                      zygotes_per_device=zygotes_per_device,
                      control_address=host if port.isdigit() else listen,
                      control_port=int(port) if port.isdigit() else 0, **config)
    inventory = Inventory.detect()
    if suspender is None and not inventory.cpu_only:   # GPU node: the suspended tier
        suspender = _suspender()
    return NodeAgent(cfg, models=[ModelSpec(Path(d), release) for d in model_dirs],
                     backend=backend or InProcessBackend(), catalog=Catalog(state_dir / "catalog.db"),
                     store=LocalStore(state_dir / "snapshots", capacity_bytes),
                     registry=registry or choose("registry", ClusterChoice()), inventory=inventory,
                     suspender=suspender, summary=summary, node_meta=node_meta)


class ModelAnnouncer(Protocol):
    """What the node needs of the cluster's model catalog (agent.cluster.model_catalog:
    ``announce`` creates ``rewarm/models/<model>`` unless it exists; True when created)."""

    def announce(self, model: str, version: str = "", node: str = "") -> bool: ...


def _announce_models(agent: NodeAgent, catalog: ModelAnnouncer) -> None:
    """Put this node's models in the cluster catalog (``rewarm/models/<m>``, created once)
    so that front doors accept them before any snapshot exists.  Best effort: a failure is
    logged (the snapshot summary announces the model later too)."""
    from agent.errors import RewarmError

    for spec in agent.models.values():
        try:
            catalog.announce(spec.name, spec.version, agent.config.node_id)
        except (RewarmError, OSError) as exc:
            log.warning("model %s not announced in the catalog: %s", spec.name, exc)


def _suspender():
    from agent.node.cuda_checkpoint import CudaCheckpointDriver
    from agent.node.suspend import Suspender

    driver = CudaCheckpointDriver()
    return Suspender(driver) if driver.available() else None


async def _feed_watchdog(agent: NodeAgent, interval_s: float, stall_s: float) -> None:
    """WATCHDOG=1 every ``interval_s`` while the agent loop ticked within ``stall_s``: a hung
    loop stops the pings and systemd restarts the unit."""
    while True:
        await asyncio.sleep(interval_s)
        last = agent.last_tick_s
        if last is None or agent.clock.now() - last <= stall_s:
            sdnotify.watchdog()


async def serve(agent: NodeAgent, listen: str, stop: asyncio.Event,
                restore: Sequence[str] = (), token: str | None = None,
                metrics_listen: str | None = None) -> None:
    """Control API (``token``: required of every op when set) + agent loop until ``stop``;
    the status port on ``metrics_listen`` (HOST:PORT) when given."""
    server = ControlServer(agent, listen, token)
    address = await server.start()
    agent.agent_instance.address, _, port = address.rpartition(":")
    agent.agent_instance.port = int(port) if port.isdigit() else 0
    agent.registrar.want(agent.agent_instance)  # again, with the bound address
    status = None
    if metrics_listen:
        host, _, mport = metrics_listen.rpartition(":")
        try:
            status = serve_status(agent.metrics.registry, host or "127.0.0.1", int(mport),
                                  ready=lambda: readiness(agent), component="agent")
        except OSError as exc:
            await server.close()
            raise ConfigError(f"--metrics-listen {metrics_listen}: cannot listen: {exc}",
                              name="metrics_listen", value=metrics_listen,
                              limit="a free HOST:PORT") from exc
    logs.say(f"rewarm agent {agent.config.node_id} listening on {address}"
             + (f"; metrics on {status.url}/metrics" if status else ""), address=address)
    loop_stop = threading.Event()
    loop_thread = threading.Thread(target=agent.run, args=(loop_stop,), daemon=True,
                                   name="agent-loop")
    loop_thread.start()
    loop = asyncio.get_running_loop()
    sdnotify.ready(f"control API on {address}")
    watchdog_s = sdnotify.watchdog_interval_s()
    tasks = [asyncio.create_task(_feed_watchdog(agent, watchdog_s, 10.0))] if watchdog_s else []
    for model in restore:
        await loop.run_in_executor(None, agent.restore, model)
    try:
        await stop.wait()
    finally:
        sdnotify.stopping(f"draining replicas (at most {agent.config.drain_timeout_s} s)")
        for task in tasks:
            task.cancel()
        await server.close()
        loop_stop.set()
        await loop.run_in_executor(None, agent.close)
        if status is not None:
            status.close()


def run_agent(args: argparse.Namespace) -> int:
    from agent.node.processes import ProcessBackend

    raise_nofile("agent")
    token = control_token()
    check_control_bind(args.listen, token, args.allow_open)   # before anything starts
    state = Path(args.state_dir)
    backend: Backend
    if args.backend == "process":
        backend = ProcessBackend(state / "run", buffer_mib=args.buffer_mib, threads=args.threads,
                                 data_host=getattr(args, "replica_host", None))
    else:
        backend = InProcessBackend(buffer_bytes=args.buffer_mib << 20)
    choice = choice_from_args(args)
    registry, summary = choose("registry", choice), snapshot_summary(choice)
    node_meta = None
    if getattr(args, "nomad_metadata", False):
        node_meta = node_metadata(args.nomad_node_id)
    agent = build_agent(state, [Path(d) for d in args.model_dir], backend=backend,
                        registry=registry, summary=summary,
                        remote_root=Path(args.remote) if args.remote else None,
                        capacity_bytes=int(args.capacity_gib * (1 << 30)), node_id=args.node_id,
                        release=Path(args.release) if args.release else None, listen=args.listen,
                        zygotes_per_device=args.zygotes, suspender=_suspender(),
                        max_replicas_per_model=args.max_replicas_per_model,
                        node_meta=node_meta,
                        drain_timeout_s=args.drain_grace_s)

    catalog = cluster_model_catalog(choice)
    if catalog is not None:
        _announce_models(agent, catalog)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(agent, args.listen, stop, args.restore, token,
                    metrics_listen=args.metrics_listen)

    asyncio.run(main())
    return 0
