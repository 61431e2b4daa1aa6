"""Python side of the CUDA checkpoint driver API (driver r570+), loaded at run time.

The cffi declarations come from ``ext/cuda_checkpoint_build.py`` (built into
``agent._cuda_checkpoint`` by ``setup.py``); the library is opened with ``ffi.dlopen`` on
first use, so importing this module never needs a GPU.  Without the library, or with a driver
older than r570 (the ``cuCheckpointProcess*`` symbols missing, or ``cuDriverGetVersion`` below
:data:`MIN_DRIVER_VERSION` or unreadable), every call raises one
:class:`~agent.errors.DriverUnavailable` naming what is missing.  Every non-zero ``CUresult``
becomes a :class:`~agent.errors.CudaCheckpointError` carrying the driver's name for it
(``CUDA_ERROR_...``; table taken from the ``CUresult`` enum of CUDA 13's ``cuda.h``).

The library path is ``libcuda.so.1`` unless ``REWARM_LIBCUDA`` or the ``library`` argument
names another (the tests load a small fake driver built with gcc).
"""

from __future__ import annotations

import enum
import math
import os
import threading
from typing import Any
from collections.abc import Sequence

from agent.errors import ConfigError, CudaCheckpointError, DriverUnavailable

LIBRARY_ENV = "REWARM_LIBCUDA"
DEFAULT_LIBRARY = "libcuda.so.1"
MIN_DRIVER_VERSION = 12080
"""``cuDriverGetVersion`` of the first driver with the checkpoint API (r570 ships CUDA 12.8)."""

MAX_LOCK_TIMEOUT_MS = 0xFFFFFFFF
"""``CUcheckpointLockArgs.timeoutMs`` is an unsigned 32-bit field."""

CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessGetRestoreThreadId", "cuCheckpointProcessGetState",
    "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock",
)

# "value NAME" pairs of cuda.h's CUresult enum (CUDA 13), without the CUDA_ prefix.
_CURESULT_TABLE = """
0 SUCCESS 1 ERROR_INVALID_VALUE 2 ERROR_OUT_OF_MEMORY 3 ERROR_NOT_INITIALIZED
4 ERROR_DEINITIALIZED 5 ERROR_PROFILER_DISABLED 6 ERROR_PROFILER_NOT_INITIALIZED
7 ERROR_PROFILER_ALREADY_STARTED 8 ERROR_PROFILER_ALREADY_STOPPED 34 ERROR_STUB_LIBRARY
36 ERROR_CALL_REQUIRES_NEWER_DRIVER 46 ERROR_DEVICE_UNAVAILABLE 100 ERROR_NO_DEVICE
101 ERROR_INVALID_DEVICE 102 ERROR_DEVICE_NOT_LICENSED 200 ERROR_INVALID_IMAGE
201 ERROR_INVALID_CONTEXT 202 ERROR_CONTEXT_ALREADY_CURRENT 205 ERROR_MAP_FAILED
206 ERROR_UNMAP_FAILED 207 ERROR_ARRAY_IS_MAPPED 208 ERROR_ALREADY_MAPPED
209 ERROR_NO_BINARY_FOR_GPU 210 ERROR_ALREADY_ACQUIRED 211 ERROR_NOT_MAPPED
212 ERROR_NOT_MAPPED_AS_ARRAY 213 ERROR_NOT_MAPPED_AS_POINTER
214 ERROR_ECC_UNCORRECTABLE 215 ERROR_UNSUPPORTED_LIMIT 216 ERROR_CONTEXT_ALREADY_IN_USE
217 ERROR_PEER_ACCESS_UNSUPPORTED 218 ERROR_INVALID_PTX
219 ERROR_INVALID_GRAPHICS_CONTEXT 220 ERROR_NVLINK_UNCORRECTABLE
221 ERROR_JIT_COMPILER_NOT_FOUND 222 ERROR_UNSUPPORTED_PTX_VERSION
223 ERROR_JIT_COMPILATION_DISABLED 224 ERROR_UNSUPPORTED_EXEC_AFFINITY
225 ERROR_UNSUPPORTED_DEVSIDE_SYNC 226 ERROR_CONTAINED 300 ERROR_INVALID_SOURCE
301 ERROR_FILE_NOT_FOUND 302 ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND
303 ERROR_SHARED_OBJECT_INIT_FAILED 304 ERROR_OPERATING_SYSTEM 400 ERROR_INVALID_HANDLE
401 ERROR_ILLEGAL_STATE 402 ERROR_LOSSY_QUERY 500 ERROR_NOT_FOUND 600 ERROR_NOT_READY
700 ERROR_ILLEGAL_ADDRESS 701 ERROR_LAUNCH_OUT_OF_RESOURCES 702 ERROR_LAUNCH_TIMEOUT
703 ERROR_LAUNCH_INCOMPATIBLE_TEXTURING 704 ERROR_PEER_ACCESS_ALREADY_ENABLED
705 ERROR_PEER_ACCESS_NOT_ENABLED 708 ERROR_PRIMARY_CONTEXT_ACTIVE
709 ERROR_CONTEXT_IS_DESTROYED 710 ERROR_ASSERT 711 ERROR_TOO_MANY_PEERS
712 ERROR_HOST_MEMORY_ALREADY_REGISTERED 713 ERROR_HOST_MEMORY_NOT_REGISTERED
714 ERROR_HARDWARE_STACK_ERROR 715 ERROR_ILLEGAL_INSTRUCTION
716 ERROR_MISALIGNED_ADDRESS 717 ERROR_INVALID_ADDRESS_SPACE 718 ERROR_INVALID_PC
719 ERROR_LAUNCH_FAILED 720 ERROR_COOPERATIVE_LAUNCH_TOO_LARGE
721 ERROR_TENSOR_MEMORY_LEAK 800 ERROR_NOT_PERMITTED 801 ERROR_NOT_SUPPORTED
802 ERROR_SYSTEM_NOT_READY 803 ERROR_SYSTEM_DRIVER_MISMATCH
804 ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE 805 ERROR_MPS_CONNECTION_FAILED
806 ERROR_MPS_RPC_FAILURE 807 ERROR_MPS_SERVER_NOT_READY
808 ERROR_MPS_MAX_CLIENTS_REACHED 809 ERROR_MPS_MAX_CONNECTIONS_REACHED
810 ERROR_MPS_CLIENT_TERMINATED 811 ERROR_CDP_NOT_SUPPORTED
812 ERROR_CDP_VERSION_MISMATCH 900 ERROR_STREAM_CAPTURE_UNSUPPORTED
901 ERROR_STREAM_CAPTURE_INVALIDATED 902 ERROR_STREAM_CAPTURE_MERGE
903 ERROR_STREAM_CAPTURE_UNMATCHED 904 ERROR_STREAM_CAPTURE_UNJOINED
905 ERROR_STREAM_CAPTURE_ISOLATION 906 ERROR_STREAM_CAPTURE_IMPLICIT
907 ERROR_CAPTURED_EVENT 908 ERROR_STREAM_CAPTURE_WRONG_THREAD 909 ERROR_TIMEOUT
910 ERROR_GRAPH_EXEC_UPDATE_FAILURE 911 ERROR_EXTERNAL_DEVICE
912 ERROR_INVALID_CLUSTER_SIZE 913 ERROR_FUNCTION_NOT_LOADED
914 ERROR_INVALID_RESOURCE_TYPE 915 ERROR_INVALID_RESOURCE_CONFIGURATION
916 ERROR_KEY_ROTATION 999 ERROR_UNKNOWN
"""
_tokens = _CURESULT_TABLE.split()
CURESULT_NAMES: dict[int, str] = {
    int(_tokens[i]): "CUDA_" + _tokens[i + 1] for i in range(0, len(_tokens), 2)}


def result_name(result: int) -> str:
    """``CUDA_ERROR_OUT_OF_MEMORY`` for 2; ``CUresult(<n>)`` for a value cuda.h does not list."""
    return CURESULT_NAMES.get(int(result), f"CUresult({int(result)})")


class ProcessState(enum.IntEnum):
    """``CUprocessState`` of a process as the driver sees it."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


def _load_ffi():
    try:
        from agent._cuda_checkpoint import ffi  # built by setup.py from ext/
    except ImportError:
        return None
    return ffi


class CudaCheckpointDriver:
    """The six ``cuCheckpointProcess*`` calls on a process id, with typed errors.

    ``library``: path or soname of the driver (default ``$REWARM_LIBCUDA`` or libcuda.so.1);
    ``ffi``: the cffi declarations (default: the built ``agent._cuda_checkpoint``).  Loading
    is lazy and happens once; :meth:`available` says whether calls can work without raising.
    """

    def __init__(self, library: str | None = None, ffi: Any = None) -> None:
        self.library = library or os.environ.get(LIBRARY_ENV) or DEFAULT_LIBRARY
        self._ffi = ffi
        self._lib: Any = None
        self._unavailable: DriverUnavailable | None = None
        self._lock = threading.Lock()
        self.driver_version: int | None = None

    # -- loading -------------------------------------------------------------------------
    def _load(self) -> Any:
        with self._lock:
            if self._lib is not None:
                return self._lib
            if self._unavailable is not None:
                raise self._unavailable
            self._unavailable = self._try_load()
            if self._unavailable is not None:
                raise self._unavailable
            return self._lib

    def _try_load(self) -> DriverUnavailable | None:
        ffi = self._ffi or _load_ffi()
        if ffi is None:
            missing = ["agent._cuda_checkpoint (build it: pip install -e . or "
                       "python setup.py build_ext --inplace)"]
            return DriverUnavailable(
                f"CUDA checkpoint binding unavailable: missing {missing[0]}",
                call="load", result=None, name=None, missing=missing)
        self._ffi = ffi
        try:
            lib = ffi.dlopen(self.library)
        except OSError as exc:
            return DriverUnavailable(
                f"CUDA checkpoint API unavailable: cannot load {self.library} ({exc}); "
                "suspend/resume needs the NVIDIA driver r570 or newer",
                call="dlopen", result=None, name=None, missing=[self.library])
        missing = [name for name in CHECKPOINT_SYMBOLS if not _has_symbol(lib, name)]
        if missing:
            return DriverUnavailable(
                f"CUDA checkpoint API unavailable: {self.library} lacks {', '.join(missing)} "
                f"(driver older than r570, which introduced them)",
                call="dlsym", result=None, name=None, missing=missing)
        version = ffi.new("int *")
        if not (_has_symbol(lib, "cuDriverGetVersion") and lib.cuDriverGetVersion(version) == 0):
            # fail closed: a driver that cannot say its version is not trusted to lock a process
            return DriverUnavailable(
                f"CUDA checkpoint API unavailable: {self.library} cannot report its version "
                f"(cuDriverGetVersion); suspend/resume needs a driver >= {MIN_DRIVER_VERSION} (r570)",
                call="cuDriverGetVersion", result=None, name=None, missing=["cuDriverGetVersion"])
        self.driver_version = int(version[0])
        if self.driver_version < MIN_DRIVER_VERSION:
            return DriverUnavailable(
                f"CUDA checkpoint API unavailable: {self.library} reports driver version "
                f"{self.driver_version}, below the minimum {MIN_DRIVER_VERSION} (r570, CUDA 12.8)",
                call="cuDriverGetVersion", result=None, name=None,
                missing=[f"driver version >= {MIN_DRIVER_VERSION} (found {self.driver_version})"])
        self._lib = lib
        return None

    def available(self) -> bool:
        """True when the library loads and has every checkpoint symbol (never raises)."""
        try:
            self._load()
        except DriverUnavailable:
            return False
        return True

    def _check(self, call: str, result: int, pid: int) -> None:
        if result != 0:
            name = result_name(result)
            raise CudaCheckpointError(
                f"{call}(pid={pid}) failed: {name} ({int(result)})",
                call=call, result=int(result), name=name, pid=pid)

    # -- the six calls -------------------------------------------------------------------
    def get_state(self, pid: int) -> ProcessState:
        """``cuCheckpointProcessGetState``. Raises CudaCheckpointError, DriverUnavailable."""
        lib = self._load()
        state = self._ffi.new("CUprocessState *")
        self._check("cuCheckpointProcessGetState", lib.cuCheckpointProcessGetState(pid, state), pid)
        value = int(state[0])
        try:
            return ProcessState(value)
        except ValueError:
            raise CudaCheckpointError(
                f"cuCheckpointProcessGetState(pid={pid}) returned unknown state {value}; "
                "expected 0..3", call="cuCheckpointProcessGetState", result=0,
                name="CUDA_SUCCESS", pid=pid, value=value) from None

    def get_restore_thread_id(self, pid: int) -> int:
        """``cuCheckpointProcessGetRestoreThreadId``: the thread id the restore runs on."""
        lib = self._load()
        tid = self._ffi.new("int *")
        self._check("cuCheckpointProcessGetRestoreThreadId",
                    lib.cuCheckpointProcessGetRestoreThreadId(pid, tid), pid)
        return int(tid[0])

    def lock(self, pid: int, timeout_s: float) -> None:
        """``cuCheckpointProcessLock`` with ``timeoutMs = timeout_s * 1000`` (0 = no timeout).

        Raises ConfigError for a negative, non-finite or non-numeric timeout or one past
        ``timeoutMs``'s 32 bits.
        """
        finite = isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s)
        timeout_ms = int(round(timeout_s * 1000)) if finite else -1
        if not 0 <= timeout_ms <= MAX_LOCK_TIMEOUT_MS:
            raise ConfigError(
                f"lock timeout_s={timeout_s} out of range; limit 0..{MAX_LOCK_TIMEOUT_MS / 1000} s",
                name="lock_timeout_s", value=timeout_s, limit=MAX_LOCK_TIMEOUT_MS / 1000)
        lib = self._load()
        args = self._ffi.new("CUcheckpointLockArgs *")  # zero-filled: reserved fields are 0
        args.timeoutMs = timeout_ms
        self._check("cuCheckpointProcessLock", lib.cuCheckpointProcessLock(pid, args), pid)

    def checkpoint(self, pid: int) -> None:
        """``cuCheckpointProcessCheckpoint``: device memory to host, GPU released."""
        lib = self._load()
        args = self._ffi.new("CUcheckpointCheckpointArgs *")
        self._check("cuCheckpointProcessCheckpoint",
                    lib.cuCheckpointProcessCheckpoint(pid, args), pid)

    def restore(self, pid: int, gpu_pairs: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """``cuCheckpointProcessRestore``; ``gpu_pairs``: (old UUID, new UUID), 16 bytes each."""
        for old, new in gpu_pairs:
            for uuid in (old, new):
                if len(uuid) != 16:
                    raise ConfigError(
                        f"GPU UUID {uuid!r} is {len(uuid)} bytes; expected 16",
                        name="gpu_pairs", value=len(uuid), limit=16)
        lib = self._load()
        args = self._ffi.new("CUcheckpointRestoreArgs *")
        pairs = None
        if gpu_pairs:
            pairs = self._ffi.new("CUcheckpointGpuPair[]", len(gpu_pairs))
            for i, (old, new) in enumerate(gpu_pairs):
                self._ffi.memmove(pairs[i].oldUuid.bytes, old, 16)
                self._ffi.memmove(pairs[i].newUuid.bytes, new, 16)
            args.gpuPairs = pairs
            args.gpuPairsCount = len(gpu_pairs)
        self._check("cuCheckpointProcessRestore", lib.cuCheckpointProcessRestore(pid, args), pid)

    def unlock(self, pid: int) -> None:
        """``cuCheckpointProcessUnlock``: CUDA calls in the process proceed again."""
        lib = self._load()
        args = self._ffi.new("CUcheckpointUnlockArgs *")
        self._check("cuCheckpointProcessUnlock", lib.cuCheckpointProcessUnlock(pid, args), pid)


def _has_symbol(lib: Any, name: str) -> bool:
    try:
        getattr(lib, name)
    except (AttributeError, NotImplementedError):
        return False
    return True


def uuid_bytes(uuid: str) -> bytes:
    """``"GPU-6f1c..."`` (NVML's form) to the 16 bytes ``CUuuid`` holds. Raises ValueError."""
    text = uuid.removeprefix("GPU-").replace("-", "")
    raw = bytes.fromhex(text)
    if len(raw) != 16:
        raise ValueError(f"GPU UUID {uuid!r} has {len(raw)} bytes; expected 16")
    return raw
