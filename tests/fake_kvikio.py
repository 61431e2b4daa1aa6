"""A stand-in for the kvikio module at the driver boundary: ``CuFile.pread`` into host tensors.

It follows kvikio's Python API (python/kvikio/kvikio/cufile.py: ``CuFile(file, flags)``,
``pread(buf, size=None, file_offset=0, task_size=None) -> IOFuture``, ``IOFuture.get() -> int``,
``close()``; python/kvikio/kvikio/defaults.py: ``is_compat_mode_preferred()``) and is no
kinder than it:

* ``pread`` checks the buffer as ``parse_buffer_argument`` does (kvikio/_lib/arr.pyx): a
  non-contiguous buffer is refused, and ``size`` larger than the buffer raises ValueError.
* a read that reaches end of file before ``size`` bytes raises RuntimeError ("POSIX error on
  pread ...: EOF"), as cpp/include/kvikio/posix_io.hpp ``posix_device_io`` throws
  CUfileException there; kvikio never returns a short count for a regular file.
* a closed handle refuses reads (the C++ FileHandle's fd is gone).
* ``IOFuture.get()`` may be called once: a second call raises (std::future's ``get`` leaves
  it invalid).

Faults for tests: ``fail_at`` (a file offset whose read raises RuntimeError, like an EIO),
``flip_at`` (a file offset whose byte is delivered flipped: a bad DMA or a bad bounce copy).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch


class IOFuture:
    def __init__(self, result: int | None = None, error: BaseException | None = None) -> None:
        self._result, self._error, self._valid = result, error, True

    def get(self) -> int:
        if not self._valid:
            raise RuntimeError("std::future_error: No associated state")
        self._valid = False
        if self._error is not None:
            raise self._error
        return int(self._result or 0)

    def done(self) -> bool:
        return True


@dataclass
class Defaults:
    compat: bool = True

    def is_compat_mode_preferred(self) -> bool:
        return self.compat


@dataclass
class FakeKvikio:
    """Use as the ``kvikio`` argument of agent/snapshot/gpu.py's functions."""

    defaults: Defaults = field(default_factory=Defaults)
    fail_at: int | None = None
    flip_at: int | None = None
    reads: list[tuple[str, int, int]] = field(default_factory=list)   # (file, offset, size)
    opened: list[CuFile] = field(default_factory=list)

    def CuFile(self, file: Path | str, flags: str = "r") -> CuFile:   # noqa: N802 - kvikio's name
        handle = CuFile(self, Path(file), flags)
        self.opened.append(handle)
        return handle


class CuFile:
    def __init__(self, owner: FakeKvikio, path: Path, flags: str) -> None:
        if flags != "r":
            raise ValueError(f"fake kvikio reads only; flags {flags!r}")
        self.owner, self.path = owner, path
        self.fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)   # FileNotFoundError

    @property
    def closed(self) -> bool:
        return self.fd is None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def pread(self, buf: torch.Tensor, size: int | None = None, file_offset: int = 0,
              task_size: int | None = None) -> IOFuture:
        if self.fd is None:
            raise RuntimeError(f"{self.path}: file handle is closed")
        if not buf.is_contiguous():
            raise ValueError("Array must be C or F contiguous")
        nbytes = buf.numel() * buf.element_size()
        size = nbytes if size is None else size
        if size > nbytes:
            raise ValueError("Size is greater than the size of the buffer")
        self.owner.reads.append((self.path.name, file_offset, size))
        if self.owner.fail_at is not None and file_offset <= self.owner.fail_at < file_offset + size:
            return IOFuture(error=RuntimeError(f"POSIX error on pread at: posix_io.hpp: "
                                               f"Input/output error (offset {self.owner.fail_at})"))
        data = bytearray()
        while len(data) < size:
            got = os.pread(self.fd, size - len(data), file_offset + len(data))
            if not got:
                return IOFuture(error=RuntimeError("POSIX error on pread at: posix_io.hpp: EOF"))
            data += got
        if self.owner.flip_at is not None and file_offset <= self.owner.flip_at < file_offset + size:
            data[self.owner.flip_at - file_offset] ^= 0xFF
        flat = buf.reshape(-1).view(torch.uint8)
        flat[:size].copy_(torch.frombuffer(data, dtype=torch.uint8) if size else flat[:0])
        return IOFuture(result=size)
