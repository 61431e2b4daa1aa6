#!/usr/bin/env bash
# GPU device check: the serving path and the restore rates of rewarm on one GPU node, in one
# call of at most 8 minutes (setup included), on the node's image as it is.
#
#   bench/device_check.sh                # prints a table, writes $WORK/device_check.json
#   OUT=/some/dir bench/device_check.sh  # the JSON goes to $OUT/device_check.json
#   PYTHON=python3 bench/device_check.sh # the interpreter (default: the first python3 on PATH
#                                        # whose torch is built for CUDA)
#   CARRY=DIR bench/device_check.sh      # the folder bench/device_prep.sh made (default
#                                        # var/device_carry)
#   bench/device_check.sh --select       # only say which carried wheels would be installed
#
# Setup (the GPU node has no package registry, and its python holds torch and what torch was
# built against): of the carried wheels, only those whose distribution that python lacks are
# installed, offline, into $WORK/site (pip install --target --no-index --no-deps; the image's
# numpy, typing-extensions... are never shadowed), and $WORK/site goes first on PYTHONPATH;
# the libraries of any nvidia-* wheel installed there go on LD_LIBRARY_PATH (cuda-pathfinder
# searches only site-packages, and kvikio loads libcufile through it).  Every module the check
# needs is then imported once, and ext/ is built with the node's C compiler against the
# carried xxhash header (setuptools, Cython and cffi from the image or the carry).
# $WORK/setup.txt says what was done, and every failure with its own message.
#
# Then bench/device_check.py probes the machine (driver, torch and its CUDA, kvikio and whether
# it reads with GDS or its compat mode, cuCheckpointProcess* in libcuda) and runs its steps in
# phases, each step in its own process under its own limit and only while the 480 s have room
# for it (the driver's docstring has each step, its budget and what it measures):
#   phase 1, side by side (nothing timed): aot_build (rewarm build --device cuda), prep_8b (the
#            Llama-3-8B-shaped checkpoint written from the GPU), gpu_tests (pytest -m gpu)
#   then, each alone: stack (SmolLM2's shape through the serving path: cold boot, capture,
#            restore into a warmed CUDA zygote, first token over HTTP, park, resume), stack_8b
#            (the same on the 8B shape, with a cold restore), throughput_8b and throughput_8gib
#            (restore rates into device memory against the raw read, the pinned copy and
#            safetensors of the same bytes)
# Every figure carries its path (staged | gds | compat | host) and the limit it is compared
# with; a failed step's JSON holds its exception and traceback's tail.  The table is printed
# whatever fails; what is skipped says why.  Without a GPU every step is skipped and the
# script exits 0.
export CHECK_START="$(date +%s)"
set -u
cd "$(dirname "$0")/.."
REPO="$(pwd)"
WORK="${WORK:-var/device_check}"
CARRY="${CARRY:-var/device_carry}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
[ -d "$CARRY" ] && CARRY="$(cd "$CARRY" && pwd)"
export WORK CARRY CHECK_BUDGET_S="${CHECK_BUDGET_S:-480}"
SELECT_ONLY=0
[ "${1:-}" = "--select" ] && SELECT_ONLY=1
SETUP="$WORK/setup.txt"
[ "$SELECT_ONLY" = 1 ] || : > "$SETUP"
note() { if [ "$SELECT_ONLY" = 1 ]; then echo "$*"; else echo "$*" | tee -a "$SETUP"; fi; }
# the last lines of a log, indented, into setup.txt: a failure's own message
quote() { tail -n "${2:-12}" "$1" | sed 's/^/    /' | tee -a "$SETUP"; }

# --- the interpreter ------------------------------------------------------------------------------
torch_of() {   # "torch <version> (CUDA <v>)" for an interpreter, exit 0 when its torch has CUDA
  env -u PYTHONPATH "$1" -c 'import sys, torch
print(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
sys.exit(0 if torch.version.cuda else 3)' 2>/dev/null
}
PY="${PYTHON:-}"
if [ -n "$PY" ]; then
  PY_WHY="PYTHON"
else
  PY_WHY=""
  for name in python3 python3.12 python3.13 python3.11 /usr/bin/python3 /usr/local/bin/python3 \
              /opt/conda/bin/python3 python; do
    cand="$(command -v "$name" 2>/dev/null)" || continue
    if torch_of "$cand" > /dev/null; then PY="$cand"; PY_WHY="first python3 whose torch has CUDA"; break; fi
    if [ -z "$PY" ] && torch_of "$cand" | grep -q '^torch'; then FALLBACK_PY="$cand"; fi
  done
  if [ -z "$PY" ] && [ -n "${FALLBACK_PY:-}" ]; then PY="$FALLBACK_PY"; PY_WHY="no torch with CUDA found; a python3 with torch"; fi
  if [ -z "$PY" ] && [ -x .venv/bin/python ]; then PY=".venv/bin/python"; PY_WHY="no python3 with torch; the project's venv"; fi
  if [ -z "$PY" ]; then PY="$(command -v python3 || echo python3)"; PY_WHY="no python3 with torch found"; fi
fi
TORCH="$(torch_of "$PY")"
note "setup: python $PY ($PY_WHY): $("$PY" --version 2>&1), ${TORCH:-torch not importable}"

# --- the carried wheels the image lacks ---------------------------------------------------------------
# One line per wheel: "install FILE" when the interpreter has no distribution of that name,
# "have DIST VERSION" when it has one (kept, even at another version: then "(carried V)"),
# "skip FILE" when its name is not a wheel's (the others are still chosen).
select_wheels() {
  env -u PYTHONPATH "$PY" - "$1" <<'EOF'
import importlib.metadata as md, re, sys
from pathlib import Path
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    # wheel file names: {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
    parts = wheel.name[:-len(".whl")].split("-")
    if len(parts) not in (5, 6) or not all(parts):
        print(f"skip {wheel} (not a wheel file name: distribution-version-python-abi-platform.whl)")
        continue
    dist, version = parts[:2]
    name = re.sub(r"[-_.]+", "-", dist).lower()
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        print(f"install {wheel}")
    else:
        print(f"have {name} {have}" + (f" (carried {version})" if have != version else ""))
EOF
}

INSTALL=()
if [ ! -d "$CARRY/wheels" ]; then
  note "setup: no carry at $CARRY (bench/device_prep.sh makes it): nothing installed"
else
  SELECTION="$(select_wheels "$CARRY/wheels" 2> "$WORK/select.log")" || {
    note "setup: choosing the wheels failed with $PY:"; quote "$WORK/select.log"; }
  if [ "$SELECT_ONLY" = 1 ]; then echo "$SELECTION"; exit 0; fi
  while read -r verb rest; do
    [ "$verb" = install ] && INSTALL+=("$rest")
  done <<< "$SELECTION"
  kept="$(grep '^have ' <<< "$SELECTION" | cut -d' ' -f2- | paste -sd';' | sed 's/;/; /g')"
  while read -r skipped; do note "setup: ${skipped}"; done < <(grep '^skip ' <<< "$SELECTION")
  note "setup: carry $CARRY: $(ls "$CARRY"/wheels/*.whl 2>/dev/null | wc -l) wheels, ${#INSTALL[@]} to install; the image's own kept: ${kept:-none}"
fi
[ "$SELECT_ONLY" = 1 ] && exit 0

SITE="$WORK/site"
rm -rf "$SITE"
mkdir -p "$SITE"
if [ "${#INSTALL[@]}" -gt 0 ]; then
  names="$(for w in "${INSTALL[@]}"; do basename "$w" | cut -d- -f1-2; done | paste -sd' ')"
  pipwheel="$(ls "$CARRY"/wheels/pip-*.whl 2>/dev/null | head -1)"
  if "$PY" -m pip --version > /dev/null 2>&1; then
    PIP=("$PY" -m pip); pip_how="$("$PY" -m pip --version | cut -d' ' -f1-2) of the image"
  elif [ -n "$pipwheel" ]; then    # a wheel is a zip archive python can run pip from
    PIP=("$PY" "$pipwheel/pip"); pip_how="pip run from the carried $(basename "$pipwheel")"
  else
    PIP=(false); pip_how="no pip (the python has no pip module, the carry no pip wheel)"
  fi
  pip_target() {
    "${PIP[@]}" install --no-index --no-deps --target "$SITE" --disable-pip-version-check \
      --no-warn-script-location -q "$@"
  }
  if pip_target "${INSTALL[@]}" > "$WORK/pip.log" 2>&1; then
    note "setup: installed ${#INSTALL[@]} wheels into $SITE with $pip_how: $names"
  else
    note "setup: pip install --target of ${#INSTALL[@]} wheels failed with $pip_how; one by one:"
    quote "$WORK/pip.log" 6
    ok=0
    for w in "${INSTALL[@]}"; do
      if pip_target "$w" > "$WORK/pip-one.log" 2>&1; then
        ok=$((ok + 1))
      else
        note "setup: $(basename "$w") failed:"; quote "$WORK/pip-one.log" 6
      fi
    done
    note "setup: installed $ok of ${#INSTALL[@]} wheels into $SITE"
  fi
else
  note "setup: no carried wheel to install (the image has every distribution, or no carry)"
fi
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
libs="$(ls -d "$SITE"/nvidia/*/lib 2>/dev/null | paste -sd:)"
if [ -n "$libs" ]; then
  export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  note "setup: LD_LIBRARY_PATH += $libs (libraries of the nvidia wheels installed here)"
fi
note "setup: PYTHONPATH=$PYTHONPATH"

# --- what the check imports, once, each failure with its own message --------------------------------
# every third-party module agent/ imports (its sources, read with ast), kvikio.defaults and
# pytest; matplotlib is left out of the carry on purpose (only `rewarm simulate --plot`)
"$PY" - > "$WORK/imports.log" 2>&1 <<'EOF'
import ast, importlib, importlib.metadata as md, sys, traceback
from pathlib import Path
tops = set()
for path in Path("agent").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            tops.add(node.module.split(".")[0])
tops -= set(sys.stdlib_module_names) | {"agent", "matplotlib"}
dists = md.packages_distributions()
ok, failed = [], []
for name in sorted(tops | {"kvikio.defaults", "pytest"}, key=str.lower):
    try:
        module = importlib.import_module(name)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        failed.append(f"setup: import {name} FAILED: {line}")
        continue
    where = "carry" if "/site/" in (getattr(module, "__file__", "") or "") else "image"
    try:
        version = md.version(dists.get(name.split(".")[0], [name])[0])
    except md.PackageNotFoundError:
        version = "?"
    ok.append(f"{name} {version} ({where})")
print("setup: imports ok: " + ("; ".join(ok) or "none"))
print("\n".join(failed))
EOF
grep -v '^$' "$WORK/imports.log" | tee -a "$SETUP"

# --- ext/ ------------------------------------------------------------------------------------------------
CC_FOUND="$(command -v cc || command -v gcc || command -v clang || true)"
if "$PY" -c "import agent._restore, agent._cuda_checkpoint" 2>/dev/null; then
  note "setup: ext/ already built (agent._restore and agent._cuda_checkpoint import)"
elif [ -z "$CC_FOUND" ]; then
  note "setup: no C compiler (cc, gcc, clang): ext/ not built"
else
  tools="$("$PY" -c 'import importlib, importlib.metadata as md
out = []
for mod, dist in (("setuptools", "setuptools"), ("Cython", "Cython"), ("cffi", "cffi")):
    try:
        where = "carry" if "/site/" in importlib.import_module(mod).__file__ else "image"
        out.append(dist + " " + md.version(dist) + " (" + where + ")")
    except Exception as exc:
        out.append(dist + " MISSING (" + type(exc).__name__ + ": " + str(exc) + ")")
print(", ".join(out))' 2>&1 | tail -1)"
  INC=""; [ -d "$CARRY/include" ] && INC="-I$CARRY/include"
  if CFLAGS="$INC ${CFLAGS:-}" "$PY" setup.py -q build_ext --inplace > "$WORK/build_ext.log" 2>&1; then
    note "setup: ext/ built with $CC_FOUND ($("$CC_FOUND" --version 2>&1 | head -1)); $tools"
  else
    note "setup: ext/ build FAILED with $CC_FOUND; $tools; the end of $WORK/build_ext.log:"
    quote "$WORK/build_ext.log" 15
  fi
fi
export CC_FOUND
# the driver plans its steps within CHECK_BUDGET_S of CHECK_START (setup included); this
# timeout is only the backstop
LEFT=$(( CHECK_BUDGET_S - ($(date +%s) - CHECK_START) ))
[ "$LEFT" -gt 5 ] || LEFT=5
exec timeout "$LEFT" "$PY" bench/device_check.py
