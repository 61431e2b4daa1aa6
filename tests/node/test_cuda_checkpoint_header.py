"""ext/cuda_checkpoint_build.py's declarations (the cffi CDEF agent.node.cuda_checkpoint calls
the driver through) against CUDA 13's own ``cuda.h``, compiled with gcc: every struct's size,
every field's offset and size, every enumerator, every scalar typedef's size and sign, and
every function's prototype (a pointer of the CDEF's type initialised with the header's function
under ``-Werror``).  The CUresult name table and ProcessState are checked against it too.

The header: ``$CUDA_HOME/include/cuda.h`` or ``/usr/local/cuda/include/cuda.h`` (the CUDA
toolkit), else the one the nvidia-cuda-runtime 13.0 wheel ships (``nvidia/cu13/include``; the
Makefile installs it); the Makefile pins the same CUDA 13.0 the toolkit is."""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cffi import FFI
from pycparser import c_ast, c_generator, c_parser

from agent.node import cuda_checkpoint as cc

REPO = Path(__file__).resolve().parents[2]


def _cdef() -> str:
    spec = importlib.util.spec_from_file_location("cuda_checkpoint_build", REPO / "ext" / "cuda_checkpoint_build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CDEF


def cuda_header(toolkits: list[Path] | None = None) -> Path | None:
    """The cuda.h to check against: a toolkit's (``toolkits``, default $CUDA_HOME, $CUDA_PATH,
    /usr/local/cuda), else the nvidia-cuda-runtime wheel's on sys.path."""
    if toolkits is None:
        toolkits = [Path(os.environ[v]) for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
        toolkits.append(Path("/usr/local/cuda"))
    for root in toolkits:
        if (root / "include" / "cuda.h").is_file():
            return root / "include" / "cuda.h"
    for entry in sys.path:
        candidate = Path(entry) / "nvidia" / "cu13" / "include" / "cuda.h"
        if candidate.is_file():
            return candidate
    return None


HEADER = cuda_header()
CDEF = _cdef()
FFI_ = FFI()
FFI_.cdef(CDEF)
AST = c_parser.CParser().parse(CDEF)
GCC = shutil.which("gcc") or shutil.which("cc")

pytestmark = pytest.mark.skipif(GCC is None, reason="no C compiler (ext/ cannot be built either)")


def _decls() -> tuple[dict, dict, dict, list]:
    """(scalar typedefs {name: C type}, structs {name: [fields]}, enums {name: [enumerators]},
    function declarations) of the CDEF."""
    scalars, structs, enums, funcs = {}, {}, {}, []
    for ext in AST.ext:
        if isinstance(ext, c_ast.Typedef) and isinstance(ext.type, c_ast.TypeDecl):
            inner = ext.type.type
            if isinstance(inner, c_ast.IdentifierType):
                scalars[ext.name] = " ".join(inner.names)
            elif isinstance(inner, c_ast.Struct):
                structs[ext.name] = [d.name for d in inner.decls]
            elif isinstance(inner, c_ast.Enum):
                enums[ext.name] = [e.name for e in inner.values.enumerators]
        elif isinstance(ext, c_ast.Decl) and isinstance(ext.type, c_ast.FuncDecl):
            funcs.append(ext)
    return scalars, structs, enums, funcs


SCALARS, STRUCTS, ENUMS, FUNCS = _decls()


def _compile(tmp_path: Path, source: str, *, run: bool) -> str:
    if HEADER is None:
        pytest.fail("no cuda.h: install the CUDA toolkit or `make install` (nvidia-cuda-runtime)")
    src = tmp_path / "check.c"
    src.write_text(f"#include <stddef.h>\n#include <stdio.h>\n#include <cuda.h>\n{source}")
    out = tmp_path / ("check" if run else "check.o")
    p = subprocess.run([GCC, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-type-limits",
                        f"-I{HEADER.parent}",
                        *([] if run else ["-c"]), str(src), "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"{HEADER}:\n{p.stderr[-3000:]}"
    if not run:
        return ""
    return subprocess.run([str(out)], capture_output=True, text=True, check=True, timeout=30).stdout


def test_the_cdef_declares_what_the_binding_calls():
    """What the comparisons below cover (a CDEF parsed into nothing would pass them)."""
    names = {f.name for f in FUNCS}
    assert set(cc.CHECKPOINT_SYMBOLS) | {"cuInit", "cuDriverGetVersion", "cuGetErrorName"} == names
    assert set(STRUCTS) == {"CUuuid", "CUcheckpointLockArgs", "CUcheckpointCheckpointArgs",
                            "CUcheckpointGpuPair", "CUcheckpointRestoreArgs", "CUcheckpointUnlockArgs"}
    assert ENUMS == {"CUprocessState": [f"CU_PROCESS_STATE_{s.name}" for s in cc.ProcessState]}


def test_struct_sizes_and_field_offsets_match_the_header(tmp_path):
    lines = []
    for name, fields in STRUCTS.items():
        lines.append(f'printf("{name} size %zu\\n", sizeof({name}));')
        for f in fields:
            lines.append(f'printf("{name}.{f} %zu %zu\\n", offsetof({name}, {f}), sizeof((({name} *)0)->{f}));')
    got = _compile(tmp_path, "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n", run=True)
    header = dict(line.split(" ", 1) for line in got.splitlines())
    ours = {}
    for name in STRUCTS:
        ctype = FFI_.typeof(name)
        ours[name] = f"size {FFI_.sizeof(ctype)}"
        for fname, field in ctype.fields:
            ours[f"{name}.{fname}"] = f"{field.offset} {FFI_.sizeof(field.type)}"
    assert ours == header
    assert header["CUcheckpointLockArgs.timeoutMs"] == "0 4" and cc.MAX_LOCK_TIMEOUT_MS == 2**32 - 1


def test_enumerators_and_scalar_typedefs_match_the_header(tmp_path):
    lines = [f'printf("{e} %lld\\n", (long long){e});' for names in ENUMS.values() for e in names]
    for name in SCALARS:
        lines.append(f'printf("{name} %zu %d\\n", sizeof({name}), ((({name})-1) < 0) ? 1 : 0);')
    got = _compile(tmp_path, "int main(void) {\n" + "\n".join(lines) + "\nreturn 0;\n}\n", run=True)
    header = {k: v.split() for k, v in (line.split(" ", 1) for line in got.splitlines())}
    for name, members in ENUMS.items():
        elements = FFI_.typeof(name).elements
        for e in members:
            value = next(v for v, n in elements.items() if n == e)
            assert int(header[e][0]) == value, e
            assert cc.ProcessState[e.removeprefix("CU_PROCESS_STATE_")] == value
    text = HEADER.read_text(errors="replace") if HEADER else ""
    for name in SCALARS:
        size, signed = (int(x) for x in header[name])
        assert FFI_.sizeof(name) == size, name
        ours_signed = int(FFI_.cast(name, -1)) < 0
        # an enum's integer type is the compiler's choice (gcc: unsigned int for CUresult, whose
        # values all lie in 0..999): a 32-bit int of either sign reads every value alike
        is_enum = re.search(rf"typedef\s+enum\s+\w*\s*\{{[^}}]*\}}\s*{name}\s*;", text) is not None
        assert ours_signed == bool(signed) or is_enum, name
    assert SCALARS == {"CUresult": "int", "cuuint64_t": "unsigned long long"}


def test_function_prototypes_match_the_header(tmp_path):
    gen = c_generator.CGenerator()
    out = []
    for decl in FUNCS:
        d = copy.deepcopy(decl)
        func = d.type
        inner = func.type
        while not isinstance(inner, c_ast.TypeDecl):     # a pointer return type
            inner = inner.type
        inner.declname = f"check_{decl.name}"
        d.name = f"check_{decl.name}"
        d.type = c_ast.PtrDecl(quals=[], type=func)
        d.init = c_ast.ID(decl.name)
        d.storage = []
        out.append(gen.visit(d) + ";")
    source = "\n".join(out) + "\n"
    assert source.count("= cu") == len(FUNCS)
    _compile(tmp_path, source, run=False)


def test_a_wrong_declaration_is_caught(tmp_path):
    """The prototype check fails for a parameter type the header does not have."""
    with pytest.raises(AssertionError, match="incompatible"):
        _compile(tmp_path, "CUresult (*check)(unsigned int pid, int *tid) = "
                           "cuCheckpointProcessGetRestoreThreadId;\n", run=False)


def test_the_curesult_table_is_the_headers_enum():
    """agent.node.cuda_checkpoint.CURESULT_NAMES against ``typedef enum cudaError_enum``."""
    if HEADER is None:
        pytest.fail("no cuda.h: install the CUDA toolkit or `make install` (nvidia-cuda-runtime)")
    text = HEADER.read_text(errors="replace")
    body = re.search(r"typedef enum cudaError_enum \{(.*?)\}\s*CUresult;", text, re.S)
    assert body, f"{HEADER}: no CUresult enum"
    code = re.sub(r"/\*.*?\*/", "", body.group(1), flags=re.S)
    header = {int(v): n for n, v in re.findall(r"\b(CUDA_\w+)\s*=\s*(\d+)", code)}
    assert len(header) > 90
    assert cc.CURESULT_NAMES == header


def test_without_a_toolkit_the_runtime_wheels_header_is_used():
    header = cuda_header(toolkits=[])
    assert header is not None and header.parts[-4:] == ("nvidia", "cu13", "include", "cuda.h")
    assert "cuCheckpointProcessLock" in header.read_text(errors="replace")
