"""The two outside systems behind small interfaces, and the one place that chooses them.

Every registry and scaler implementation is listed in :data:`IMPLEMENTATIONS`, as
``"module:Class"`` so that choosing one does not import the others' clients.  Every entry
point (``rewarm frontdoor``, ``rewarm agent run``, ``rewarm predictor``, ``rewarm up``) builds
them with :func:`choose` from a :class:`ClusterChoice`; the commands make theirs with
:func:`add_flags` and :func:`choice_from_args`, so all of them speak one vocabulary:

=========================== ======================================================================
flag                        meaning (default)
=========================== ======================================================================
``--registry local|consul`` where services register and are found (``local``: in-process;
                            ``consul`` when ``--consul`` is given)
``--consul HOST:PORT``      the Consul agent's HTTP address (``$CONSUL_HTTP_ADDR``, else
                            127.0.0.1:8500; ``CONSUL_HTTP_TOKEN`` and the TLS variables apply)
``--scaler local|nomad``    how a model gets replicas: ``local`` asks node agents through their
                            control API, ``nomad`` scales the model's replica job
                            (``NOMAD_ADDR``, ``NOMAD_TOKEN``) (``local``)
``--node-agent HOST:PORT``  a node agent the local scaler asks; repeatable (the predictor:
                            ``$REWARM_AGENT``, else 127.0.0.1:7733; the front door: every
                            passing ``rewarm-agent`` in the registry)
``--max-replicas N``        with ``--scaler nomad``: the scaling max of a replica job registered on
                            first use (8)
=========================== ======================================================================

``--scaler agents`` is the former spelling of ``--scaler local`` and is still accepted.
The cluster-mode services beside the registry (a Consul client, the snapshot summary in
Consul KV and the scale-in guard over it, the predictor's leader lock, the model catalog,
Nomad node metadata, the ACL-refusal gauge) are built here too (:func:`consul_client`,
:func:`snapshot_summary`, :func:`snapshot_durable`, :func:`leader_lock`,
:func:`cluster_model_catalog`, :func:`catalog_watcher`, :func:`node_metadata`,
:func:`acl_denied_gauge`).  No function here takes a module's name: importing
``agent.cluster.NAME`` binds ``NAME`` in this package to the module, over a function of that
name.

Code outside this package imports this package's functions and two of its modules, never the
modules behind the functions (tests/cluster/test_boundary.py scans ``agent/`` for it):

- :mod:`agent.cluster.base`: the Protocols (``Registry``, ``Scaler``), ``ServiceInstance``
  and the registry meta keys every side reads;
- :mod:`agent.cluster.scale_up`: ``ScaleUp``, the front door's serialised scale-from-zero;
  it drives any ``Scaler`` through the Protocol alone and reaches no outside system.

The node agent's control-API client (its token, the default address, ``control_call``) is no
registry or scaler: it is the control API's wire protocol, in :mod:`agent.wire.control` beside
the other clients of rewarm's wire, where the front door, the predictor, ``rewarm up`` and
the node agent's server and commands all reach it (``agent.cluster.control`` names the same
objects, for scripts that import it there).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

if TYPE_CHECKING:
    import consul

    from agent.clock import Clock
    from agent.cluster.base import Registry, Scaler
    from prometheus_client import Gauge

    from agent.cluster.consul_kv import DurableCatalog, SnapshotKV
    from agent.cluster.leader import LeaderLock
    from agent.cluster.model_catalog import CatalogWatcher, ModelCatalog
    from agent.cluster.node_meta import SnapshotMetadata

log = logging.getLogger(__name__)

IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "registry": {
        "local": "agent.cluster.local:LocalRegistry",
        "consul": "agent.cluster.consul_registry:ConsulRegistry",
    },
    "scaler": {
        "local": "agent.cluster.local_scaler:LocalScaler",
        "nomad": "agent.cluster.nomad_scaler:NomadScaler",
    },
}

SCALER_ALIASES = {"agents": "local"}
"""Former ``--scaler`` spellings, still accepted."""

DEFAULT_MAX_REPLICAS = 8
"""``--max-replicas``: the scaling max of a Nomad replica job registered on first use."""

CONTROL_TIMEOUT_S = 600.0
"""How long the local scaler waits for one node-agent call (a cold boot takes minutes)."""


def implementation_path(kind: str, name: str) -> str:
    """``"module:Class"`` registered for ``kind`` (registry | scaler) and ``name``; KeyError
    names the choices."""
    try:
        return IMPLEMENTATIONS[kind][name]
    except KeyError:
        raise KeyError(f"no {kind} implementation {name!r}; choices: "
                       f"{sorted(IMPLEMENTATIONS.get(kind, {}))}") from None


def implementation(kind: str, name: str) -> type:
    """The class registered for ``kind`` (registry | scaler) and ``name`` (imported now);
    KeyError names the choices."""
    module, _, cls = implementation_path(kind, name).partition(":")
    return getattr(importlib.import_module(module), cls)


@dataclass(frozen=True)
class ClusterChoice:
    """What an entry point chose: ``registry`` and ``scaler`` name entries of
    :data:`IMPLEMENTATIONS`; ``consul`` is the Consul agent's ``HOST:PORT`` (None: the
    environment's); ``node_agents`` are control addresses (``HOST:PORT`` or ``unix:PATH``) for
    the local scaler (empty: ``$REWARM_AGENT``, else 127.0.0.1:7733); ``max_replicas`` bounds
    a Nomad replica job registered on first use."""

    registry: str = "local"
    scaler: str = "local"
    consul: str | None = None
    node_agents: tuple[str, ...] = ()
    max_replicas: int = DEFAULT_MAX_REPLICAS

    def __post_init__(self) -> None:
        for kind in ("registry", "scaler"):
            implementation_path(kind, getattr(self, kind))


def add_flags(parser: argparse.ArgumentParser, *, scaler: bool = True,
              node_agents: bool = True, max_replicas: bool = False) -> None:
    """Add the vocabulary above to ``parser``: ``--registry`` and ``--consul`` always, the
    others when asked for (a node agent chooses no scaler)."""
    from agent.argtypes import host_port, positive_int

    parser.add_argument("--registry", choices=sorted(IMPLEMENTATIONS["registry"]), default=None,
                        help="where services register and are found (default local; consul "
                             "when --consul is given)")
    parser.add_argument("--consul", type=host_port, metavar="HOST:PORT", default=None,
                        help="the Consul agent (default $CONSUL_HTTP_ADDR or 127.0.0.1:8500)")
    if scaler:
        parser.add_argument("--scaler", default="local",
                            choices=sorted([*IMPLEMENTATIONS["scaler"], *SCALER_ALIASES]),
                            help="local: node agents' control API (--node-agent); nomad: "
                                 "scale the model's replica job (NOMAD_ADDR, NOMAD_TOKEN); "
                                 "'agents' is the former name of local")
    if node_agents:
        parser.add_argument("--node-agent", action="append", default=[], type=host_port,
                            metavar="HOST:PORT",
                            help="node agent control API asked for replicas (repeatable; "
                                 "default $REWARM_AGENT or 127.0.0.1:7733, and the front "
                                 "door asks every passing rewarm-agent in the registry)")
    if max_replicas:
        parser.add_argument("--max-replicas", type=positive_int, default=DEFAULT_MAX_REPLICAS,
                            help="with --scaler nomad: the scaling max of a replica job it "
                                 "registers")


def choice_from_args(args: argparse.Namespace) -> ClusterChoice:
    """The :class:`ClusterChoice` of flags added by :func:`add_flags` (absent ones: defaults)."""
    consul = getattr(args, "consul", None)
    registry = getattr(args, "registry", None) or ("consul" if consul else "local")
    scaler = getattr(args, "scaler", "local")
    if scaler in SCALER_ALIASES:
        log.warning("--scaler %s is the former name of --scaler %s", scaler,
                    SCALER_ALIASES[scaler])
        scaler = SCALER_ALIASES[scaler]
    return ClusterChoice(registry=registry, scaler=scaler, consul=consul,
                         node_agents=tuple(getattr(args, "node_agent", None) or ()),
                         max_replicas=getattr(args, "max_replicas", DEFAULT_MAX_REPLICAS))


@overload
def choose(kind: Literal["registry"], choice: ClusterChoice, *,
           clock: Clock | None = None) -> Registry: ...
@overload
def choose(kind: Literal["scaler"], choice: ClusterChoice, *, clock: Clock | None = None,
           agents: Mapping[str, Callable[..., dict]] | None = None,
           max_replicas: Callable[[str], int] | None = None) -> Scaler: ...
def choose(kind: str, choice: ClusterChoice, *, clock: Clock | None = None,
           agents: Mapping[str, Callable[..., dict]] | None = None,
           max_replicas: Callable[[str], int] | None = None) -> Any:
    """Build the ``kind`` (registry | scaler) implementation ``choice`` names.

    ``clock`` drives TTLs and back-offs (default: the system clock).  For a local scaler,
    ``agents`` maps node names to ``call(op, **fields)`` functions (default: each of
    ``choice.node_agents`` through :func:`agent.wire.control.control_call`); for a Nomad
    scaler, ``max_replicas(model)`` is the scaling max of a job it registers (default
    ``choice.max_replicas`` for every model).  KeyError names the choices for an unknown
    ``kind``; what the implementation's constructor raises passes through.
    """
    if kind not in IMPLEMENTATIONS:
        raise KeyError(f"no implementation kind {kind!r}; choices: {sorted(IMPLEMENTATIONS)}")
    name = choice.registry if kind == "registry" else choice.scaler
    return _BUILDERS[kind, name](implementation(kind, name), choice, clock, agents=agents,
                                 max_replicas=max_replicas)


def _local_registry(cls: type, choice: ClusterChoice, clock: Clock | None, **_: Any) -> Any:
    return cls(clock=clock)


def _consul_registry(cls: type, choice: ClusterChoice, clock: Clock | None, **_: Any) -> Any:
    from agent.cluster.consul_http import consul_client

    return cls(consul_client(choice.consul), clock=clock)


def _local_scaler(cls: type, choice: ClusterChoice, clock: Clock | None, *,
                  agents: Mapping[str, Callable[..., dict]] | None, **_: Any) -> Any:
    from agent.wire.control import control_call, default_agent

    if agents is None:
        agents = {a: functools.partial(control_call, a, timeout_s=CONTROL_TIMEOUT_S)
                  for a in choice.node_agents or (default_agent(),)}
    return cls(agents, clock=clock)


def _nomad_scaler(cls: type, choice: ClusterChoice, clock: Clock | None, *,
                  max_replicas: Callable[[str], int] | None, **_: Any) -> Any:
    from agent.cluster.jobs import replica_job
    from agent.cluster.nomad_http import nomad_client

    bound = max_replicas or (lambda model: choice.max_replicas)
    client = nomad_client()
    # A missing job is registered from jobs/rewarm-replica.nomad.hcl, parsed by Nomad.
    return cls(client, clock=clock,
               register_job=lambda model: replica_job(client, model, bound(model)))


_BUILDERS: dict[tuple[str, str], Callable[..., Any]] = {
    ("registry", "local"): _local_registry,
    ("registry", "consul"): _consul_registry,
    ("scaler", "local"): _local_scaler,
    ("scaler", "nomad"): _nomad_scaler,
}
"""How each entry of :data:`IMPLEMENTATIONS` is built from a :class:`ClusterChoice`."""


# --- cluster-mode services beside the registry -------------------------------------------------

def consul_client(choice: ClusterChoice, *, token: str | None = None) -> consul.Consul:
    """A py-consul client for ``choice.consul`` (None: ``$CONSUL_HTTP_ADDR``, else
    127.0.0.1:8500; TLS from the ``CONSUL_*`` variables) with ACL ``token`` (None:
    ``$CONSUL_HTTP_TOKEN``).  One call at a time per client: each thread that talks to Consul
    gets its own."""
    from agent.cluster.consul_http import consul_client as client

    return client(choice.consul, token)


def snapshot_summary(choice: ClusterChoice) -> SnapshotKV | None:
    """The cluster-wide per-model snapshot summary in Consul KV, or None with a local
    registry (nothing beyond this node to tell)."""
    if choice.registry != "consul":
        return None
    from agent.cluster.consul_kv import SnapshotKV

    return SnapshotKV(consul_client(choice))


def snapshot_durable(catalog: DurableCatalog | None, summary: SnapshotKV | None
                     ) -> Callable[[str], bool]:
    """The predictor's scale-in guard, ``check(model) -> bool``: the model's snapshot is
    ready and durable in ``catalog`` (the node's SQLite catalog) and in ``summary``
    (:func:`snapshot_summary`); each source that is given must agree, neither given answers
    False, and an unreachable Consul answers False."""
    from agent.cluster.consul_kv import snapshot_durable as guard

    return guard(catalog, summary)


def acl_denied_gauge() -> Gauge:
    """``rewarm_cluster_acl_denied{service}``: 1 while Consul or Nomad refuses this process's
    token (agent/cluster/acl.py), for a process to register on its status port."""
    from agent.cluster.acl import ACL_DENIED

    return ACL_DENIED


def leader_lock(choice: ClusterChoice, *, clock: Clock, name: str) -> LeaderLock | None:
    """The predictor's leader lock (a Consul session held as ``name``), or None with a local
    registry (one predictor: it always acts)."""
    if choice.registry != "consul":
        return None
    from agent.cluster.leader import LeaderLock

    return LeaderLock(consul_client(choice), clock=clock, name=name)


def cluster_model_catalog(choice: ClusterChoice) -> ModelCatalog | None:
    """The models and their policies in Consul KV (``rewarm/models/``), or None with a local
    registry."""
    if choice.registry != "consul":
        return None
    from agent.cluster.model_catalog import ModelCatalog

    return ModelCatalog(consul_client(choice))


def catalog_watcher(choice: ClusterChoice,
                    on_change: Callable[[dict[str, dict]], None]) -> CatalogWatcher | None:
    """A started watch of :func:`cluster_model_catalog` calling ``on_change({model:
    policy})`` from its own thread at each change, or None with a local registry."""
    catalog = cluster_model_catalog(choice)
    if catalog is None:
        return None
    from agent.cluster.model_catalog import CatalogWatcher

    return CatalogWatcher(catalog, on_change).start()


def node_metadata(nomad_node_id: str | None = None) -> SnapshotMetadata:
    """Nomad dynamic node metadata for this node's cached snapshots (``NOMAD_*`` variables;
    ``nomad_node_id`` None: the local Nomad agent's node)."""
    from agent.cluster.node_meta import SnapshotMetadata
    from agent.cluster.nomad_http import nomad_client

    return SnapshotMetadata(nomad_client(), nomad_node_id)

