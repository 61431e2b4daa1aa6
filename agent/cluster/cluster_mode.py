"""Cluster-mode wiring for the front door, kept here so its CLI stays small.

- :func:`nomad_scaler`: the scaler of the models' replica jobs in Nomad (NOMAD_* variables
  honoured), registering a missing job through Nomad's parser on first use (the front door's
  ``ScalerCapacity`` drives it);
- :func:`watch_catalog`: the thread that feeds the front door the models in Consul KV.
"""

from __future__ import annotations

from collections.abc import Callable


def nomad_scaler(max_replicas: int = 8, **job_variables: object):
    """A NomadScaler whose missing jobs are registered from ``jobs/rewarm-replica.nomad.hcl``
    with ``model``, ``max_replicas`` and ``job_variables``."""
    from agent.cluster.jobs import replica_job
    from agent.cluster.nomad_http import nomad_client
    from agent.cluster.nomad_scaler import NomadScaler

    client = nomad_client()
    return NomadScaler(client, register_job=lambda m: replica_job(
        client, m, max_replicas, **job_variables))


def watch_catalog(consul_address: str, on_change: Callable[[dict[str, dict]], None]):
    """A started :class:`~agent.cluster.model_catalog.CatalogWatcher` on ``consul_address``."""
    from agent.cluster.consul_http import consul_client
    from agent.cluster.model_catalog import CatalogWatcher, ModelCatalog

    return CatalogWatcher(ModelCatalog(consul_client(consul_address)), on_change).start()
