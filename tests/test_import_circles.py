"""No two modules of ``agent/`` import each other, directly or round a longer circle.

Every ``import`` counts, a lazy one inside a function as much as a top-level one (a circle
broken only by import order is still a circle to read); imports under ``if TYPE_CHECKING:``
do not run and are left out.  An import of ``a.b.c`` is an arrow to the deepest module of
``agent/`` it names.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.import_graph import import_from_base

AGENT = Path(__file__).resolve().parents[1] / "agent"


def _name(path: Path) -> str:
    parts = list(path.relative_to(AGENT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported(source: str, module: str, known: set[str], *, package: bool = False) -> set[str]:
    """The modules of ``known`` that ``source`` (the text of ``module``) imports at run
    time; relative imports resolved, ``from p import m`` counted as ``p.m`` when that is a
    module."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child.test):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = import_from_base(node, module, package=package)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            visit(node)
            return
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                out.add(target)

    visit(ast.parse(source))
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's
    algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_module_of_agent_is_in_an_import_circle():
    paths = {_name(p): p for p in AGENT.rglob("*.py")}
    known = set(paths)
    graph = {name: imported(path.read_text(), name, known, package=path.name == "__init__.py")
             for name, path in paths.items()}
    assert sum(map(len, graph.values())) > len(graph)      # the scan saw the imports
    assert circles(graph) == []


def test_the_scan_finds_a_circle_however_it_is_spelled():
    known = {"agent.a", "agent.b", "agent.c", "agent.d", "agent.pkg", "agent.pkg.e"}
    sources = {
        "agent.a": "import agent.b.thing\n",                          # -> agent.b
        "agent.b": "def later():\n    from agent import c\n",         # lazy -> agent.c
        "agent.c": "from .a import x\n",                                # relative -> agent.a
        "agent.d": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import agent.a\n",
        "agent.pkg": "from . import e\n",
        "agent.pkg.e": "from agent.d import y\n",
    }
    graph = {m: imported(s, m, known, package=m == "agent.pkg") for m, s in sources.items()}
    assert graph["agent.d"] == set()                                   # type-only: no arrow
    assert graph["agent.pkg"] == {"agent.pkg.e"}
    assert circles(graph) == [["agent.a", "agent.b", "agent.c"]]
    graph["agent.d"] = {"agent.pkg"}
    assert sorted(circles(graph)) == [["agent.a", "agent.b", "agent.c"],
                                      ["agent.d", "agent.pkg", "agent.pkg.e"]]
