"""Running a read that may block (a FIFO in a snapshot) without letting it hang the run."""

from __future__ import annotations

import threading

import pytest


def with_timeout(fn, seconds: float = 10.0, unblock=None):
    """Run ``fn`` in a thread and return what it raised (None if nothing).  If it is still
    running after ``seconds`` the test fails, after ``unblock()`` lets the thread end."""
    box = {}

    def target():
        try:
            fn()
            box["error"] = None
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if unblock:
            unblock()
        pytest.fail(f"{fn} blocked for more than {seconds} s")
    return box["error"]
