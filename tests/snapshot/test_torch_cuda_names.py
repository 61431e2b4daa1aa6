"""The torch names agent/ uses, checked by name in the installed torch (a CPU build has the
``torch.cuda`` module, its classes and functions, and the factories' CUDA keywords such as
``pin_memory=``): a misspelt or removed name fails here, not first on a GPU node.

Every ``torch.a.b...`` attribute chain in agent/ must resolve with getattr after the torch
imports agent performs; every keyword passed to a call of such a chain must be a parameter of
it (its signature, or for torch's C functions the signature line their docstring starts with)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _chain(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "torch" and parts:
        return ".".join(["torch", *reversed(parts)])
    return None


def torch_uses(root: Path) -> tuple[dict[str, list[str]], dict[str, set[str]], set[str]]:
    """({chain: [file:line]}, {called chain: keywords}, torch modules imported) in ``root``."""
    chains: dict[str, list[str]] = {}
    keywords: dict[str, set[str]] = {}
    imports: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        outer = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports |= {a.name for a in node.names if a.name.startswith("torch.")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("torch."):
                imports.add(node.module or "")
            elif isinstance(node, ast.Attribute) and id(node) not in outer:
                name = _chain(node)
                if name:
                    chains.setdefault(name, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
            if isinstance(node, ast.Call):
                name = _chain(node.func)
                if name:
                    keywords.setdefault(name, set()).update(k.arg for k in node.keywords if k.arg)
    return chains, keywords, imports


def _resolve(chain: str):
    obj = torch
    for part in chain.split(".")[1:]:
        obj = getattr(obj, part)
    return obj


# C classes whose installed build carries neither a signature nor a docstring to read: the
# documented signature (pytorch.org/docs, torch.Generator: "Generator(device='cpu')"), which
# test_documented_signatures_hold_here calls to prove.
DOCUMENTED = {"torch.Generator": {"device"}}


def _accepts(func, keyword: str) -> bool:
    for chain, keywords in DOCUMENTED.items():
        if func is _resolve(chain):
            return keyword in keywords
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        doc = (func.__doc__ or "").lstrip()
        head = doc.split("->", 1)[0] if doc else ""
        return re.search(rf"\b{re.escape(keyword)}\s*[=:,)]", head) is not None or "**kwargs" in head
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


CHAINS, KEYWORDS, IMPORTS = torch_uses(REPO / "agent")


def test_every_torch_name_agent_uses_exists_in_the_installed_torch():
    for module in IMPORTS:
        __import__(module)
    missing = {}
    for chain, where in CHAINS.items():
        try:
            _resolve(chain)
        except AttributeError as exc:
            missing[chain] = (where[:3], str(exc))
    assert missing == {}
    # what is covered: the device path's stream, event and copy calls
    assert {"torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.stream", "torch.cuda.synchronize",
            "torch.cuda.is_available"} <= set(CHAINS)


def test_every_keyword_agent_passes_to_torch_is_a_parameter():
    wrong = {(chain, kw) for chain, kws in KEYWORDS.items() for kw in kws
             if callable(f := _resolve(chain)) and not _accepts(f, kw)}
    assert wrong == set()
    assert "pin_memory" in KEYWORDS.get("torch.empty", set())


def test_the_checks_refuse_a_name_and_a_keyword_torch_lacks():
    try:
        _resolve("torch.cuda.Streams")
    except AttributeError:
        pass
    else:
        raise AssertionError("torch.cuda.Streams resolved")
    assert _accepts(torch.empty, "pin_memory") and not _accepts(torch.empty, "pinned")
    assert _accepts(torch.cuda.synchronize, "device") and not _accepts(torch.cuda.synchronize, "dev")


def test_documented_signatures_hold_here():
    assert torch.Generator(device="cpu").device == torch.device("cpu")
    for chain, keywords in DOCUMENTED.items():
        assert keywords and callable(_resolve(chain))
