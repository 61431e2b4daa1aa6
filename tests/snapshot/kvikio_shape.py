"""The shape and the argument checks of a kvikio package, real or fake, as plain data.

    python tests/snapshot/kvikio_shape.py bare      # after `import kvikio` alone
    python tests/snapshot/kvikio_shape.py loaded    # as agent.snapshot.gpu.load_kvikio returns it

prints ``{"shape": describe(kvikio), "settings": settings_outcomes(kvikio), "pread":
pread_outcomes(kvikio, FILE)}`` for the installed package, in this fresh interpreter (what is
reachable depends on what was imported).  tests/snapshot/test_fake_kvikio.py runs it and calls
the same functions on tests/fake_kvikio.py's package, then compares.
"""

from __future__ import annotations

import enum
import inspect
import json
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

SETTING_VALUES: tuple[Any, ...] = (0, -1, 1, 1.5, 2**33, "x", None, True, [500])
"""Values tried for every key.  Left out: an enum key's integer past its last member (kvikio
stores it and fails on the next ``get``; the fake refuses it at ``set``)."""

SET_CALLS: tuple[tuple[Any, ...], ...] = (
    (), ({"task_size": 1}, "x"), (1, 2), ("task_size", 1, 2), ({"nope": 1},), ({},), ("nope", 1),
    ({"task_size": 1, "remote_io_num_reactors": 1},), ({"num_threads": 2, "task_size": 0},),
)
"""Whole ``defaults.set`` calls: the wrong shapes, an unknown key, a key kvikio allows only
on its own, a dict whose second value is refused (the first stays set)."""


def _params(obj: Any) -> list | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    return [[p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in sig.parameters.values()]


def _public(obj: Any) -> list[str]:
    names = set(dir(obj))
    if isinstance(obj, types.ModuleType):     # a module subclass's methods live on its type
        names |= set(dir(type(obj))) - set(dir(types.ModuleType))
    return sorted(n for n in names if not n.startswith("_") or n in ("__init__", "__enter__", "__exit__"))


def _entry(value: Any, owner: type | None = None, name: str = "") -> dict:
    if owner is not None:
        static = inspect.getattr_static(owner, name, None)
        if isinstance(static, property):
            return {"kind": "property"}
    if isinstance(value, type) and issubclass(value, enum.Enum):
        return {"kind": "enum", "members": {m.name: int(m.value) for m in value}}
    if isinstance(value, type):
        return {"kind": "class", "params": _params(value)}
    if isinstance(value, types.ModuleType):
        return {"kind": "module"}
    if callable(value):
        return {"kind": "function", "params": _params(value)}
    return {"kind": type(value).__name__}


def describe(package: types.ModuleType) -> dict[str, dict]:
    """``{dotted path: entry}`` for the package's public names, those of its submodules that
    are attributes, and each class's public methods and properties; ``__version__`` too."""
    out: dict[str, dict] = {"kvikio.__version__": {"kind": "str", "value": package.__version__}}

    def walk(obj: Any, path: str, depth: int) -> None:
        for name in _public(obj):
            if obj is package and name == "__version__":
                continue
            value = getattr(obj, name)
            if isinstance(value, types.ModuleType) and not value.__name__.startswith("kvikio"):
                continue                                  # a module kvikio imports (os, io...)
            child = f"{path}.{name}"
            owner = obj if isinstance(obj, type) else None
            out[child] = _entry(value, owner, name)
            if depth and (isinstance(value, types.ModuleType) or
                          (isinstance(value, type) and not issubclass(value, enum.Enum))):
                if isinstance(value, types.ModuleType) or \
                        value.__module__.split(".")[0] not in sys.stdlib_module_names:
                    walk(value, child, depth - 1)     # not typing.Any and the like
    walk(package, "kvikio", 2)
    return out


def _outcome(call: Any) -> str:
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - the exception's type is the outcome
        return f"raises {type(exc).__name__}"
    return f"ok {result!r}" if not hasattr(result, "__exit__") else "ok"


def settings_outcomes(package: types.ModuleType) -> dict[str, str]:
    """``defaults.set(key, value)`` then ``get(key)`` for every key and SETTING_VALUES, each
    undone; SET_CALLS; and a ``with set(...)`` block's value inside and after."""
    d = package.defaults
    keys = ("compat_mode", "num_threads", "task_size", "gds_threshold", "bounce_buffer_size",
            "http_max_attempts", "http_status_codes", "http_timeout", "auto_direct_io_read",
            "auto_direct_io_write", "remote_io_backend", "remote_io_num_reactors",
            "remote_io_reactor_dispatch", "remote_io_max_concurrent_requests")
    out = {}
    for key in keys:
        before = d.get(key)
        out[f"get({key!r})"] = repr(before)
        for value in SETTING_VALUES:
            def one(key=key, value=value):
                d.set(key, value)
                return int(d.get(key)) if not isinstance(d.get(key), list) else d.get(key)
            out[f"set({key!r}, {value!r})"] = _outcome(one)
            d.set(key, before)
    for args in SET_CALLS:
        before = {k: d.get(k) for k in ("task_size", "num_threads")}
        out[f"set{args!r}"] = _outcome(lambda args=args: d.set(*args))
        out[f"set{args!r} leaves"] = repr({k: d.get(k) for k in before})
        for k, v in before.items():
            d.set(k, v)
    out["get('nope')"] = _outcome(lambda: d.get("nope"))
    with d.set({"task_size": 123, "bounce_buffer_size": 4096}):
        out["inside with"] = repr((d.get("task_size"), d.get("bounce_buffer_size")))
    out["after with"] = repr((d.get("task_size"), d.get("bounce_buffer_size")))
    return out


def pread_outcomes(package: types.ModuleType, file: Path) -> dict[str, str]:
    """``CuFile(file).pread(...)``'s argument checks: "raises X" where kvikio refuses the
    arguments, "accepted" where it goes on to read (without libcuda.so.1 the real one then
    fails with RuntimeError naming it, which counts as accepted)."""
    import numpy as np

    bufs = {"bytearray(64)": lambda: bytearray(64),
            "numpy[::2]": lambda: np.zeros(128, dtype=np.uint8)[::2],
            "numpy 2-D F-order": lambda: np.zeros((8, 8), dtype=np.uint8, order="F"),
            "object()": lambda: object()}
    args = {"": ((), {}), "size=None": ((None,), {}), "64, 0": ((64, 0), {}),
            "65, 0": ((65, 0), {}), "-1, 0": ((-1, 0), {}), "8, -1": ((8, -1), {}),
            "8, 1.5": ((8, 1.5), {}), "task_size=0": ((8, 0), {"task_size": 0}),
            "task_size=-1": ((8, 0), {"task_size": -1}), "task_size=4096": ((8, 0), {"task_size": 4096}),
            "nbytes=8": ((), {"nbytes": 8})}
    out = {}
    handle = package.CuFile(file, "r")
    for bname, make in bufs.items():
        for aname, (a, kw) in args.items():
            try:
                handle.pread(make(), *a, **kw)
                result = "accepted"
            except RuntimeError as exc:
                result = "accepted" if "libcuda" in str(exc) else f"raises {type(exc).__name__}"
            except Exception as exc:  # noqa: BLE001 - the exception's type is the outcome
                result = f"raises {type(exc).__name__}"
            out[f"pread({bname}, {aname})"] = result
    for flags in ("x", "r"):
        out[f"CuFile(flags={flags!r})"] = _outcome(lambda flags=flags: package.CuFile(file, flags).close())
    out["CuFile(missing)"] = _outcome(lambda: package.CuFile(file.parent / "missing.bin", "r"))
    handle.close()
    out["closed after close"] = repr(handle.closed)
    handle.close()
    return out


def load(stage: str) -> types.ModuleType:
    """The installed package after ``import kvikio`` ("bare") or as load_kvikio returns it."""
    if stage == "bare":
        import kvikio
        return kvikio
    from unittest import mock

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from agent.snapshot import gpu
    with mock.patch.object(gpu, "cuda_driver_present", return_value=True):
        return gpu.load_kvikio()


if __name__ == "__main__":
    package = load(sys.argv[1])
    doc: dict[str, Any] = {"shape": describe(package)}
    if sys.argv[1] == "loaded":
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "data.bin"
            f.write_bytes(bytes(range(64)))
            doc["pread"] = pread_outcomes(package, f)
        doc["settings"] = settings_outcomes(package)
    print(json.dumps(doc, indent=1))
