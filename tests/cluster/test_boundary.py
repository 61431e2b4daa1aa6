"""The cluster package's boundary: code outside ``agent/cluster`` reaches registries and
scalers through ``agent.cluster``'s functions and the Protocols of ``agent.cluster.base``,
never through an implementation's module (agent/cluster/__init__.py, "Code outside this
package imports ...").

Every ``import`` and ``from ... import`` in ``agent/`` counts, at any depth: a lazy import in
a function and one under ``TYPE_CHECKING`` tie the code to the module as much as a top-level
one does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.import_graph import import_from_base

AGENT = Path(__file__).resolve().parents[2] / "agent"
CLUSTER = AGENT / "cluster"

ALLOWED = {
    "agent.cluster": "the composition functions (choose, add_flags, consul_client, ...)",
    "agent.cluster.base": "the Protocols, ServiceInstance and the registry meta keys",
    "agent.cluster.scale_up": "ScaleUp: drives any Scaler through the Protocol alone",
}
"""The cluster modules code outside the package may import, each with why it is not an
implementation's module."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(AGENT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cluster_imports(source: str, module: str, *, package: bool = False) -> list[tuple[int, str]]:
    """``(line, module)`` for each ``agent.cluster`` module that ``source`` (the text of
    ``module``; ``package``: it is a package's ``__init__``) imports, relative imports
    resolved and ``from agent.cluster import NAME`` counted as ``agent.cluster.NAME`` when
    NAME is one of the package's modules."""
    submodules = {p.stem for p in CLUSTER.glob("*.py") if p.stem != "__init__"}
    submodules |= {p.name for p in CLUSTER.iterdir() if (p / "__init__.py").is_file()}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = import_from_base(node, module, package=package)
            names = [base]
            if base == "agent.cluster":
                names += [f"{base}.{a.name}" for a in node.names if a.name in submodules]
        else:
            continue
        for name in names:
            if name == "agent.cluster" or name.startswith("agent.cluster."):
                # the module itself, not a name inside it: agent.cluster.base.X -> base
                top = ".".join(name.split(".")[:3])
                found.append((node.lineno, top))
    return found


def forbidden_imports(source: str, module: str, *, package: bool = False) -> list[str]:
    """``"module:line imports cluster_module"`` for each import outside :data:`ALLOWED`."""
    return [f"{module}:{line} imports {name}"
            for line, name in cluster_imports(source, module, package=package)
            if name not in ALLOWED]


def _outside_modules() -> list[Path]:
    return sorted(p for p in AGENT.rglob("*.py") if CLUSTER not in p.parents)


def test_code_outside_the_cluster_package_imports_no_implementation_module():
    bad = []
    for path in _outside_modules():
        bad += forbidden_imports(path.read_text(), _module_name(path),
                                 package=path.name == "__init__.py")
    assert bad == [], ("code outside agent/cluster imports cluster modules it should reach "
                       "through agent.cluster's functions or agent.wire:\n" + "\n".join(bad))


def test_the_scan_sees_every_kind_of_import():
    # each spelling of an implementation import is caught, at any depth, and the allowed
    # ones pass: the boundary test above cannot pass by seeing nothing
    source = '''
import agent.cluster.consul_http
from agent.cluster.base import Registry
from agent.cluster import choose, consul_kv
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from agent.cluster.model_catalog import ModelCatalog
def later():
    from agent.cluster.control import control_call
    from ..cluster import local_scaler
    from ..cluster.nomad_scaler import NomadScaler
'''
    assert forbidden_imports(source, "agent.frontdoor.example") == [
        "agent.frontdoor.example:2 imports agent.cluster.consul_http",
        "agent.frontdoor.example:4 imports agent.cluster.consul_kv",
        "agent.frontdoor.example:7 imports agent.cluster.model_catalog",
        "agent.frontdoor.example:9 imports agent.cluster.control",
        "agent.frontdoor.example:10 imports agent.cluster.local_scaler",
        "agent.frontdoor.example:11 imports agent.cluster.nomad_scaler",
    ]


def test_the_scan_reads_the_tree_it_guards():
    # the boundary's allowed imports are in use and name modules that exist
    seen = set()
    for path in _outside_modules():
        seen |= {name for _, name in cluster_imports(path.read_text(), _module_name(path))}
    assert {"agent.cluster", "agent.cluster.base", "agent.cluster.scale_up"} <= seen
    for name in ALLOWED:
        tail = name.removeprefix("agent.cluster").lstrip(".")
        assert (CLUSTER / f"{tail or '__init__'}.py").is_file(), name


@pytest.mark.parametrize("name", ["control_call", "control_token", "default_agent",
                                  "DEFAULT_AGENT", "TOKEN_ENV", "ControlError"])
def test_the_control_client_is_one_object_under_both_names(name):
    import agent.cluster.control as old_name
    import agent.wire.control as wire

    assert getattr(old_name, name) is getattr(wire, name)
