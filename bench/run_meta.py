"""The ``meta`` every benchmark's result JSON carries (bench/render_docs.py renders it):
the command that ran, the machine, its load average, the date and the commit.

    from run_meta import run_meta
    out["meta"] = run_meta()          # at the end of the run: the load average then
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> str:
    """``"2 CPUs (model name), 7.6 GiB, Linux 6.1"``: what the figures were measured on."""
    mem = _memory_gib()
    return (f"{os.cpu_count()} CPUs ({_cpu_model()}), "
            + (f"{mem} GiB, " if mem is not None else "")
            + f"{platform.system()} {platform.release().split('-')[0]}")


def commit() -> str:
    """The checkout's commit (short), ``+dirty`` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_meta(argv: list[str] | None = None) -> dict[str, str]:
    """``{"command", "machine", "loadavg", "date", "commit"}`` for this run; ``loadavg`` is
    /proc/loadavg's three averages now, ``date`` UTC (RFC 3339, seconds)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    try:
        script = script.resolve().relative_to(REPO)
    except ValueError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {"command": " ".join(["python", str(script), *map(shlex.quote, argv[1:])]),
            "machine": machine(), "loadavg": load,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit()}
