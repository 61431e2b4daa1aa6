"""What the import-shape tests share (tests/cluster/test_boundary.py,
tests/test_import_circles.py): the absolute module an ``ast.ImportFrom`` names."""

from __future__ import annotations

import ast


def import_from_base(node: ast.ImportFrom, module: str, *, package: bool = False) -> str:
    """The absolute name of what ``node`` (in ``module``; ``package``: a package's
    ``__init__``) imports from: relative levels resolved against ``module``."""
    base = node.module or ""
    if not node.level:
        return base
    here = module.split(".") if package else module.split(".")[:-1]
    here = here[:len(here) - (node.level - 1)]
    return ".".join([*here, base] if base else here)
