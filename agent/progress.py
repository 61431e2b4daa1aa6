"""Progress bars on long work (tqdm), quiet when stderr is not a terminal.

``bar(...)`` is a tqdm bar on stderr with ``disable=None`` — tqdm's own switch that turns the
bar off on a non-TTY stream, so logs, pipes, systemd's journal and tests see nothing.
``REWARM_PROGRESS=0`` turns bars off on a terminal too, ``=1`` forces them on.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from tqdm import tqdm


def _disable() -> bool | None:
    forced = os.environ.get("REWARM_PROGRESS")
    if forced == "0":
        return True
    if forced == "1":
        return False
    return None


def bar(total: float | None, desc: str, *, unit: str = "B") -> tqdm:
    """A bar of ``total`` ``unit`` (bytes scale as kB/MB/GB).  Use as a context manager."""
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B",
                unit_divisor=1024 if unit == "B" else 1000, disable=_disable(),
                file=sys.stderr, leave=False, dynamic_ncols=True)


def byte_callback(desc: str) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """``(progress, close)``: ``progress(done_bytes, total_bytes)`` as agent/snapshot/remote.py
    calls it moves a byte bar to ``done_bytes``; ``close()`` ends the bar."""
    state: dict[str, tqdm] = {}

    def progress(done_bytes: int, total_bytes: int) -> None:
        b = state.get("bar")
        if b is None:
            b = state["bar"] = bar(total_bytes, desc)
        b.update(done_bytes - b.n)

    def close() -> None:
        if "bar" in state:
            state["bar"].close()

    return progress, close
