"""Injected clocks: production reads the monotonic clock, tests and the simulator move time by hand.

Every long-running loop (agent, front door, predictor) and every component with a timeout
takes a :class:`Clock` so that nothing in the test suite or the simulator sleeps.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (the origin is arbitrary)."""
        ...


class SystemClock:
    """``time.monotonic``."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to. ``advance`` refuses to go backwards."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._t = float(start_s)

    def now(self) -> float:
        return self._t

    def advance(self, dt_s: float) -> float:
        if dt_s < 0:
            raise ValueError(f"ManualClock.advance: dt_s={dt_s} is negative; limit is >= 0")
        self._t += dt_s
        return self._t

    def set(self, t_s: float) -> None:
        if t_s < self._t:
            raise ValueError(f"ManualClock.set: t_s={t_s} is before now={self._t}")
        self._t = float(t_s)
