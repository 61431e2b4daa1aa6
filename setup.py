"""Builds the C-extension hot path in ext/ (Cython) and the cffi binding to the CUDA
checkpoint driver API.  Everything else is declared in pyproject.toml."""

import os
import sys

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def cython_extensions():
    from Cython.Build import cythonize

    extensions = [
        Extension(
            "agent._restore",
            sources=["ext/restore.pyx"],
            # xxhash.h (Debian: libxxhash-dev) is used header-only with XXH_INLINE_ALL.
            define_macros=[("XXH_INLINE_ALL", "1")],
            include_dirs=["ext"],  # ext/xxh3_dispatch.h: run-time choice of XXH3's vector kernel
            extra_compile_args=["-O3"],
        ),
    ]
    return cythonize(extensions, language_level=3, quiet=True)


def cffi_modules():
    path = os.path.join(HERE, "ext", "cuda_checkpoint_build.py")
    return [path.replace(HERE + os.sep, "") + ":ffibuilder"] if os.path.exists(path) else []


setup(ext_modules=cython_extensions() if os.path.exists(os.path.join(HERE, "ext", "restore.pyx")) else [],
      cffi_modules=cffi_modules())
