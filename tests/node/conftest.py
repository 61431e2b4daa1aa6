"""Fixtures of the node agent tests: a fake CUDA driver built with gcc, the cffi declarations."""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent


def _compile(tmp: pathlib.Path, name: str, *defines: str) -> pathlib.Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake libcuda")
    out = tmp / name
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", *defines, "-o", str(out),
                    str(HERE / "fake_libcuda.c")], check=True)
    return out


@pytest.fixture(scope="session")
def fake_libcuda_path(tmp_path_factory) -> pathlib.Path:
    """A driver with the r570 checkpoint API."""
    return _compile(tmp_path_factory.mktemp("fakecuda"), "libcuda_fake.so")


@pytest.fixture(scope="session")
def old_libcuda_path(tmp_path_factory) -> pathlib.Path:
    """A driver without the cuCheckpointProcess* symbols (older than r570)."""
    return _compile(tmp_path_factory.mktemp("fakecuda_old"), "libcuda_old.so", "-DOLD_DRIVER")


@pytest.fixture(scope="session")
def cuda_ffi():
    """The cffi declarations from ext/cuda_checkpoint_build.py (an FFI that can dlopen)."""
    spec = importlib.util.spec_from_file_location(
        "cuda_checkpoint_build", REPO / "ext" / "cuda_checkpoint_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffibuilder


@pytest.fixture
def fake(fake_libcuda_path):
    """ctypes handle on the fake driver's controls (same loaded library as cffi's dlopen)."""
    lib = ctypes.CDLL(str(fake_libcuda_path))
    lib.fake_last_new_uuid.restype = ctypes.c_char_p
    lib.fake_last_timeout_ms.restype = ctypes.c_uint
    lib.fake_reset()
    yield lib
    lib.fake_reset()


# call indices of fake_set_result / fake_calls
C_STATE, C_TID, C_LOCK, C_CHECKPOINT, C_RESTORE, C_UNLOCK = range(6)
