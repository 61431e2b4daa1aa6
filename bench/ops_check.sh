#!/bin/sh
# Operability check (bench/ops_check.py says what it does): systemd units, every component's
# metrics (promtool + a real Prometheus when Debian's `prometheus` package is installed), and
# the front door at the file-descriptor limit.  Prints a table; writes $OUT/ops_check.json
# when OUT is set.  Usage: bench/ops_check.sh [--connections N] [--nofile N] [--keep]
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
[ -x "$python" ] || python=python3
if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    exec "$python" "$here/bench/ops_check.py" --json "$OUT/ops_check.json" "$@"
fi
exec "$python" "$here/bench/ops_check.py" "$@"
