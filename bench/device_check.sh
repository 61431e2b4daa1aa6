#!/usr/bin/env bash
# GPU device check: the serving path and the restore rates of rewarm on one GPU node, in one
# call of at most 8 minutes (setup included).
#
#   bench/device_check.sh                # prints a table, writes $WORK/device_check.json
#   OUT=/some/dir bench/device_check.sh  # the JSON goes to $OUT/device_check.json
#   BASE_PYTHON=python3.12 ...           # the interpreter the venv is made from
#   CARRY=DIR bench/device_check.sh      # the folder bench/device_prep.sh made (default
#                                        # var/device_carry)
#
# Setup (the GPU node has no package registry): when the carry folder is there, a venv that
# sees the node's own torch (--system-site-packages) is made in $WORK/venv and every wheel of
# the folder is installed into it offline (pip --no-index --no-deps); then ext/ is built with
# this node's C compiler against the carried xxhash header (said when there is no compiler).
#
# Then bench/device_check.py probes the machine (driver, torch and its CUDA, kvikio and whether
# it reads with GDS or its compat mode, cuCheckpointProcess* in libcuda) and runs, each in its
# own process under its own limit and only while the 480 s have room for it:
#   aot_build        rewarm build --device cuda (the stack serves eager if it fails)
#   stack            the embedded stack on CUDA: cold boot -> capture -> scale to zero ->
#                    restore through the agent into a CUDA zygote with kvikio -> first token
#                    through the HTTP entrance -> park (CUDA checkpoint) -> resume -> first token
#   throughput_8gib  restore into device memory, 8 GiB and an 8B-parameter bf16 shape, cold and
#   throughput_8b    warm, verified and not, beside safetensors.torch.load_file(device="cuda"),
#                    the raw O_DIRECT read and the pinned host-to-device copy of the same bytes
#   gpu_tests        pytest -m gpu
# Every figure carries its path (gds | compat | host) and the limit it is compared with.  The
# table is printed whatever fails; what is skipped says why.  Without a GPU every step is
# skipped and the script exits 0.
export CHECK_START="$(date +%s)"
set -u
cd "$(dirname "$0")/.."
WORK="${WORK:-var/device_check}"
CARRY="${CARRY:-var/device_carry}"
mkdir -p "$WORK"
export WORK CARRY CHECK_BUDGET_S="${CHECK_BUDGET_S:-480}"
SETUP="$WORK/setup.txt"
: > "$SETUP"
note() { echo "$*" | tee -a "$SETUP"; }
PY="${PYTHON:-}"
if [ -z "$PY" ] && [ -d "$CARRY/wheels" ]; then
  BASE="${BASE_PYTHON:-$(command -v python3.12 || command -v python3)}"
  note "setup: venv $WORK/venv from $BASE ($("$BASE" --version 2>&1)), --system-site-packages"
  if [ ! -x "$WORK/venv/bin/python" ]; then
    "$BASE" -m venv --system-site-packages "$WORK/venv" || note "setup: venv failed"
  fi
  PY="$WORK/venv/bin/python"
  if "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check \
       "$CARRY"/wheels/*.whl > "$WORK/pip.log" 2>&1; then
    note "setup: installed $(ls "$CARRY"/wheels/*.whl | wc -l) wheels offline from $CARRY"
  else
    note "setup: offline install failed: $(grep -i error "$WORK/pip.log" | head -1)"
  fi
fi
[ -n "$PY" ] || PY=".venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python3)"
CC_FOUND="$(command -v cc || command -v gcc || command -v clang || true)"
if [ -z "$CC_FOUND" ]; then
  note "setup: no C compiler (cc, gcc, clang): ext/ not built"
elif "$PY" -c "import agent._restore" 2>/dev/null; then
  note "setup: ext/ already built (agent._restore imports)"
else
  INC=""; [ -d "$CARRY/include" ] && INC="-I$(cd "$CARRY/include" && pwd)"
  if CFLAGS="$INC ${CFLAGS:-}" "$PY" setup.py -q build_ext --inplace > "$WORK/build_ext.log" 2>&1; then
    note "setup: ext/ built with $CC_FOUND"
  else
    note "setup: ext/ build failed with $CC_FOUND: $(grep -i error "$WORK/build_ext.log" | head -1)"
  fi
fi
export CC_FOUND
# the driver plans its steps within CHECK_BUDGET_S of CHECK_START (setup included); this
# timeout is only the backstop
LEFT=$(( CHECK_BUDGET_S - ($(date +%s) - CHECK_START) ))
[ "$LEFT" -gt 5 ] || LEFT=5
exec timeout "$LEFT" "$PY" bench/device_check.py
