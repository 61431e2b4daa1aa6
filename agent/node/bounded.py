"""A blocking call bounded by a timeout: the call runs on a helper thread and the caller
stops waiting after ``timeout_s`` (the thread is a daemon; what it was doing is abandoned).

Used for the CUDA checkpoint driver's blocking toggles (agent/node/suspend.py) and for a
zygote's restore (agent/node/ladder.py), neither of which can be interrupted from outside.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def call_within(fn: Callable[[], T], timeout_s: float, step: str) -> T:
    """``fn()``'s value, or what it raised, re-raised on the caller's thread; TimeoutError
    naming ``step`` and ``timeout_s`` when it has not finished by then."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"bounded-{step}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{step} did not finish within {timeout_s} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]  # the BaseException fn raised
    return box["value"]  # type: ignore[return-value]  # fn's T
