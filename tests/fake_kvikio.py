"""A stand-in for the kvikio package at the driver boundary: ``CuFile.pread`` into host tensors.

It has kvikio 26.10's shape (the wheel the Makefile installs; tests/snapshot/test_fake_kvikio.py
compares every public name and signature here with it) and is no kinder than it:

* A package whose ``defaults`` submodule is reachable only once imported: kvikio's
  ``__init__.py`` imports ``kvikio._lib.defaults``, not ``kvikio.defaults``, so after a bare
  ``import kvikio`` the attribute is missing and ``import kvikio.defaults`` is what adds it.
  The fake is a real package object: its submodules are served by an import finder while
  :meth:`FakeKvikio.installed` holds it in ``sys.modules``, and Python's import system sets the
  attribute exactly as it does for the wheel.  ``FakeKvikio()`` is the package as
  ``agent.snapshot.gpu.load_kvikio`` leaves it (that function runs against the fake), so a
  submodule load_kvikio forgets to import is missing here too.
* ``defaults.set``/``defaults.get`` (python/kvikio/kvikio/defaults.py) take kvikio's keys, one
  ``(key, value)`` pair or one dict, return a context manager that restores the old values,
  refuse an unknown key with KeyError and convert and check each value as
  ``kvikio/_lib/defaults.pyx`` and ``cpp/src/defaults.cpp`` do (C integer conversion: a float
  is truncated, a negative or too large value is OverflowError, a string or None TypeError;
  ``num_threads``, ``task_size``, ``bounce_buffer_size``... must be positive: ValueError).
* ``CuFile(file, flags="r")`` (python/kvikio/kvikio/cufile.py): a missing file is RuntimeError
  ("Unable to open file", the C++ ``FileHandle`` throws), an unknown flag ValueError; the fake
  only reads (write flags: ValueError).
* ``pread(buf, size=None, file_offset=0, task_size=None) -> IOFuture`` checks its arguments as
  ``parse_buffer_argument`` (kvikio/_lib/arr.pyx) and the size_t conversions do: a buffer that
  is neither C- nor F-contiguous is ValueError, ``size`` larger than the buffer ValueError, a
  negative size, offset or task size OverflowError, an object that is neither a torch tensor
  nor a buffer TypeError.  A torch tensor stands in for a CUDA tensor (kvikio reads its
  ``__cuda_array_interface__``); the real package refuses a host tensor, which has neither.
* a read that reaches end of file before ``size`` bytes raises RuntimeError ("POSIX error on
  pread ...: EOF"), as cpp/include/kvikio/posix_io.hpp ``posix_device_io`` throws there; kvikio
  never returns a short count for a regular file.  A closed handle refuses reads.
* ``IOFuture.get()`` may be called once: a second call raises RuntimeError (``std::future::get``
  leaves the future without state; Cython turns the ``std::future_error`` into RuntimeError).

Faults for tests: ``fail_at`` (a file offset whose read raises RuntimeError, like an EIO),
``flip_at`` (a file offset whose byte is delivered flipped: a bad DMA or a bad bounce copy).
"""

from __future__ import annotations

import contextlib
import enum
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch

VERSION = "26.10.00"
"""``kvikio.__version__`` of the wheel this fake follows (the Makefile's pin)."""

_SIZE_T, _UINT, _LONG, _UINT8 = 2**64 - 1, 2**32 - 1, 2**63 - 1, 255


class CompatMode(enum.IntEnum):
    """``kvikio.CompatMode`` (cpp/include/kvikio/compat_mode.hpp)."""
    OFF = 0
    ON = 1
    AUTO = 2


class RemoteIOBackend(enum.IntEnum):
    EASY_THREADPOOL = 0
    MULTI_POLL = 1


class RemoteReactorDispatch(enum.IntEnum):
    PER_CHUNK = 0
    PER_PREAD = 1


def _c_int(value: Any, name: str, top: int, *, signed: bool = False) -> int:
    """Python -> C integer as Cython converts an argument typed ``int`` into a C variable."""
    if isinstance(value, float):
        value = int(value)
    elif not hasattr(type(value), "__index__"):
        raise TypeError(f"Argument '{name}' has incorrect type (expected int, got "
                        f"{type(value).__name__})")
    value = int(value)
    if value < 0 and not signed:
        raise OverflowError(f"can't convert negative value to {'size_t' if top == _SIZE_T else 'unsigned int'}")
    if value > top:
        raise OverflowError(f"value too large to convert to {name}")
    return value


def _positive(what: str):
    def check(value: int) -> int:
        if value <= 0:   # cpp/src/defaults.cpp: "<what> must be a positive integer"
            raise ValueError(f"KvikIO failure at: defaults.cpp: {what} must be a positive integer")
        return value
    return check


def _enum(kind: type[enum.IntEnum]):
    def convert(value: Any) -> enum.IntEnum:
        if isinstance(value, str) or value is None or isinstance(value, list):
            raise TypeError("an integer is required")
        raw = int(value) if isinstance(value, float) else _c_int(value, "uint8_t", _UINT8)
        if raw < 0:
            raise OverflowError("can't convert negative value to uint8_t")
        try:
            return kind(raw)
        except ValueError:
            # the wheel stores it and fails on the next get(); refused here at once
            raise ValueError(f"{raw} is not a valid {kind.__name__}") from None
    return convert


def _status_codes(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise TypeError(f"Argument 'status_codes' has incorrect type (expected list, got "
                        f"{type(value).__name__})")
    return [_c_int(v, "int", _UINT, signed=True) for v in value]


def _number(arg: str, top: int, check: Any = None, *, signed: bool = False):
    def convert(value: Any) -> int:
        v = _c_int(value, arg, top, signed=signed)
        return check(v) if check else v
    return convert


# key -> (convert-and-check, default): python/kvikio/kvikio/defaults.py's keys, with the
# defaults the wheel reports without KVIKIO_* environment variables.
_SETTINGS: dict[str, tuple[Any, Any]] = {
    "compat_mode": (_enum(CompatMode), CompatMode.AUTO),
    "num_threads": (_number("nthreads", _UINT, _positive("number of threads")), 1),
    "task_size": (_number("nbytes", _SIZE_T, _positive("task size")), 4 << 20),
    "gds_threshold": (_number("nbytes", _SIZE_T), 16 << 10),
    "bounce_buffer_size": (_number("nbytes", _SIZE_T, _positive("size of the bounce buffer")), 16 << 20),
    "http_max_attempts": (_number("attempts", _SIZE_T, _positive("attempts")), 3),
    "http_status_codes": (_status_codes, [429, 500, 502, 503, 504]),
    "http_timeout": (_number("timeout", _LONG, _positive("timeout_seconds"), signed=True), 60),
    "auto_direct_io_read": (bool, False),
    "auto_direct_io_write": (bool, True),
    "remote_io_backend": (_enum(RemoteIOBackend), RemoteIOBackend.EASY_THREADPOOL),
    "remote_io_num_reactors": (_number("num_reactors", _UINT, _positive("remote_io_num_reactors")), 1),
    "remote_io_reactor_dispatch": (_enum(RemoteReactorDispatch), RemoteReactorDispatch.PER_CHUNK),
    "remote_io_max_concurrent_requests": (_number("max_requests", _SIZE_T), 256),
}
_PROCESS_LIFETIME = frozenset({"remote_io_num_reactors", "remote_io_reactor_dispatch",
                               "remote_io_max_concurrent_requests"})
_SET_USAGE = ("Valid arguments are kvikio.defaults.set(config: dict) or "
              "kvikio.defaults.set(key: str, value: Any)")


class Defaults(types.ModuleType):
    """The ``kvikio.defaults`` submodule.  ``compat``: the ``compat_mode`` setting (True: ON,
    False: OFF, None: AUTO, kvikio's default without ``KVIKIO_COMPAT_MODE``, which prefers
    compat mode when cuFile is unusable, as it always is here)."""

    def __init__(self, compat: bool | None = None) -> None:
        super().__init__("kvikio.defaults")
        self._values = {k: (list(d) if isinstance(d, list) else d) for k, (_, d) in _SETTINGS.items()}
        self._values["compat_mode"] = {True: CompatMode.ON, False: CompatMode.OFF, None: CompatMode.AUTO}[compat]
        defaults = self

        class ConfigContextManager:
            """Sets each key on creation; restores the old values when its block ends."""

            def __init__(self, config: dict[str, str]):
                self._old_properties: dict[str, Any] = {}
                for key, value in config.items():
                    self._old_properties[key] = defaults.get(key)
                    defaults._store(key, value)

            def __enter__(self):
                return None

            def __exit__(self, type_unused, value, traceback_unused):
                for key, value in self._old_properties.items():
                    defaults._store(key, value)

        self.ConfigContextManager = ConfigContextManager

    def _store(self, key: str, value: Any) -> None:
        if key not in _SETTINGS:
            raise KeyError(key)
        self._values[key] = _SETTINGS[key][0](value)

    def set(self, *config) -> Any:
        """``set(dict)`` or ``set(key, value)``; see the module docstring."""
        if len(config) == 1:
            if not isinstance(config[0], dict):
                raise ValueError(_SET_USAGE)
            fixed = _PROCESS_LIFETIME.intersection(config[0])
            if fixed:
                raise ValueError(f"{sorted(fixed)} are fixed for the process's remaining lifetime "
                                 "once the first remote I/O has been issued; set them one by one")
            return self.ConfigContextManager(config[0])
        if len(config) == 2:
            if not isinstance(config[0], str):
                raise ValueError(_SET_USAGE)
            key, value = config
            if key in _PROCESS_LIFETIME:
                self._store(key, value)
                return None
            return self.ConfigContextManager({key: value})
        raise ValueError(_SET_USAGE)

    def get(self, config_name: str) -> Any:
        if config_name not in _SETTINGS:
            raise KeyError(config_name)
        value = self._values[config_name]
        return list(value) if isinstance(value, list) else value

    def is_compat_mode_preferred(self) -> bool:
        mode = self._values["compat_mode"]
        return mode == CompatMode.ON or (mode == CompatMode.AUTO and not self._cufile_usable)

    _cufile_usable = False
    """For AUTO: whether cuFile (libcufile and the driver) loaded; never here."""


class _Handle:
    """The C++ ``std::future<size_t>`` a fake read resolves to."""

    def __init__(self, result: int | None = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.valid = result, error, True

    def take(self) -> int:
        if not self.valid:
            raise RuntimeError("std::future_error: No associated state")
        self.valid = False
        if self.error is not None:
            raise self.error
        return int(self.result or 0)


class IOFuture:
    """``kvikio.cufile.IOFuture``: ``get()`` waits and returns the bytes read (once)."""

    __slots__ = "_handle"

    def __init__(self, handle):
        self._handle = handle

    def get(self) -> int:
        return self._handle.take()

    def done(self) -> bool:
        if not self._handle.valid:
            raise RuntimeError("std::future_error: No associated state")
        return True


def _contiguous(buf: torch.Tensor) -> bool:
    """C- or F-contiguous, as ``Array._contiguous`` (kvikio/_lib/arr.pyx) judges the strides."""
    if buf.is_contiguous():
        return True
    expect = 1
    for size, stride in zip(buf.shape, buf.stride(), strict=True):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True


class CuFile:
    """``kvikio.CuFile``: reads a regular file into a tensor (a device tensor's stand-in) or a
    writable buffer.  ``FakeKvikio.CuFile`` is a subclass bound to its package (``_owner``)."""

    _owner: FakeKvikio

    def __init__(self, file: Path | str, flags: str = "r"):
        if any(ch not in "rwa+" for ch in flags):
            raise ValueError("KvikIO failure at: file_utils.cpp: Unknown file open flag")
        if flags != "r":
            raise ValueError(f"fake kvikio reads only; flags {flags!r}")
        self._path = Path(file)
        try:
            self._fd: int | None = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise RuntimeError(f"Unable to open file. Linux system/library function call error at: "
                               f"file_utils.cpp: {exc.strerror}") from None
        self._owner.opened.append(self)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def fileno(self) -> int:
        return -1 if self._fd is None else self._fd

    def __enter__(self) -> CuFile:
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        self.close()

    def pread(self, buf, size: int | None = None, file_offset: int = 0,
              task_size: int | None = None) -> IOFuture:
        if isinstance(buf, torch.Tensor):
            if not _contiguous(buf):
                raise ValueError("Array must be contiguous")
            flat = buf.detach().reshape(-1).view(torch.uint8) if buf.is_contiguous() else None
            nbytes = buf.numel() * buf.element_size()
        else:
            view = memoryview(buf)     # TypeError: a bytes-like object is required
            if not (view.c_contiguous or view.f_contiguous):
                raise ValueError("Array must be contiguous")
            flat, nbytes = None, view.nbytes
        size = nbytes if size is None else _c_int(size, "size_t", _SIZE_T)
        if size > nbytes:
            raise ValueError("Size is greater than the size of the buffer")
        file_offset = _c_int(file_offset, "size_t", _SIZE_T)
        _c_int(task_size or 0, "size_t", _SIZE_T)
        if self._fd is None:
            raise RuntimeError(f"{self._path}: cannot read from a closed file handle")
        owner = self._owner
        owner.reads.append((self._path.name, file_offset, size))
        if owner.fail_at is not None and file_offset <= owner.fail_at < file_offset + size:
            return IOFuture(_Handle(error=RuntimeError(
                f"POSIX error on pread at: posix_io.hpp: Input/output error (offset {owner.fail_at})")))
        data = bytearray()
        while len(data) < size:
            got = os.pread(self._fd, size - len(data), file_offset + len(data))
            if not got:
                return IOFuture(_Handle(error=RuntimeError("POSIX error on pread at: posix_io.hpp: EOF")))
            data += got
        if owner.flip_at is not None and file_offset <= owner.flip_at < file_offset + size:
            data[owner.flip_at - file_offset] ^= 0xFF
        if flat is not None:
            flat[:size].copy_(torch.frombuffer(data, dtype=torch.uint8) if size else flat[:0])
        elif isinstance(buf, torch.Tensor):   # F-contiguous: its dimensions reversed are C order
            mem = buf.detach().permute(*range(buf.dim() - 1, -1, -1)).reshape(-1).view(torch.uint8)
            mem[:size].copy_(torch.frombuffer(data, dtype=torch.uint8))
        else:   # C order bytes, or an F-contiguous array's transpose (C order in memory)
            view = memoryview(buf)
            mem = view if view.c_contiguous else memoryview(np.asarray(view).T)
            mem.cast("B")[:size] = data
        return IOFuture(_Handle(result=size))

    def read(self, buf, size: int | None = None, file_offset: int = 0,
             task_size: int | None = None) -> int:
        return self.pread(buf, size, file_offset, task_size).get()


_LOCK = threading.Lock()

INSTRUMENTS = frozenset({"reads", "opened", "fail_at", "flip_at", "installed"})
"""FakeKvikio's public names that kvikio lacks: the tests' faults and records."""


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``kvikio.<name>`` from the fake package that ``sys.modules['kvikio']`` holds."""

    def __init__(self, package: FakeKvikio) -> None:
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != "kvikio" or name not in self.package._submodules:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=False)

    def create_module(self, spec):
        return self.package._submodules[spec.name.rpartition(".")[2]]

    def exec_module(self, module):
        pass


class FakeKvikio(types.ModuleType):
    """Use as the ``kvikio`` argument of agent/snapshot/gpu.py's functions.

    ``defaults``: the ``kvikio.defaults`` submodule (a fresh :class:`Defaults` when None);
    ``bare``: leave the package as ``import kvikio`` alone does (no ``defaults`` attribute)
    instead of as ``agent.snapshot.gpu.load_kvikio`` returns it.  ``reads`` lists every
    ``(file name, offset, size)`` read, ``opened`` every CuFile."""

    def __init__(self, defaults: Defaults | None = None, *, fail_at: int | None = None,
                 flip_at: int | None = None, bare: bool = False) -> None:
        super().__init__("kvikio")
        self.__path__: list[str] = []
        self.__version__ = VERSION
        self.fail_at, self.flip_at = fail_at, flip_at
        self.reads: list[tuple[str, int, int]] = []
        self.opened: list[CuFile] = []
        self.CompatMode = CompatMode
        self.CuFile = type("CuFile", (CuFile,), {"_owner": self, "__module__": "kvikio.cufile"})
        cufile = types.ModuleType("kvikio.cufile")
        cufile.CuFile, cufile.IOFuture = self.CuFile, IOFuture   # type: ignore[attr-defined]
        # kvikio/__init__.py imports kvikio.cufile itself (for CuFile): reachable at once
        self.cufile = cufile
        self._submodules: dict[str, types.ModuleType] = {"cufile": cufile,
                                                         "defaults": defaults or Defaults()}
        if not bare:
            from agent.snapshot import gpu
            with self.installed(), mock.patch.object(gpu, "cuda_driver_present", return_value=True):
                loaded = gpu.load_kvikio()
            assert loaded is self, "load_kvikio returned another module than sys.modules['kvikio']"

    @contextlib.contextmanager
    def installed(self) -> Iterator[FakeKvikio]:
        """Hold this package as ``sys.modules['kvikio']`` (and no other ``kvikio.*`` module)
        while the block runs, its submodules importable; the modules before are put back."""
        with _LOCK:
            saved = {k: sys.modules.pop(k) for k in list(sys.modules)
                     if k == "kvikio" or k.startswith("kvikio.")}
            finder = _SubmoduleFinder(self)
            sys.modules["kvikio"] = self
            sys.meta_path.insert(0, finder)
            try:
                yield self
            finally:
                sys.meta_path.remove(finder)
                for k in [k for k in sys.modules if k == "kvikio" or k.startswith("kvikio.")]:
                    del sys.modules[k]
                sys.modules.update(saved)
