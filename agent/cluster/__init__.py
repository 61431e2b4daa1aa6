"""The two outside systems behind small interfaces: the registry and the scaler.

Every implementation is listed here, in one place, as ``"module:Class"`` so that choosing
one (``--registry consul``, ``--scaler nomad``) does not import the others' clients.
"""

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


def implementation(kind: str, name: str) -> type:
    """The class registered for ``kind`` (registry | scaler) and ``name``; KeyError names
    the choices."""
    import importlib

    try:
        target = IMPLEMENTATIONS[kind][name]
    except KeyError:
        raise KeyError(f"no {kind} implementation {name!r}; choices: "
                       f"{sorted(IMPLEMENTATIONS.get(kind, {}))}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
