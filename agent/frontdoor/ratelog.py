"""A log line per event until ``burst`` in one interval, then one summary line per interval
with the count: a front door under overload must not fill its log."""

from __future__ import annotations

import logging

from agent.clock import Clock


class RateLimitedLog:
    """``warning(msg, *args)``: logged while fewer than ``burst`` were logged in the current
    ``interval_s``; past that, counted and summarised (``"... and N more"``) when the next
    interval begins (or at :meth:`flush`)."""

    def __init__(self, logger: logging.Logger, what: str, *, clock: Clock,
                 interval_s: float = 10.0, burst: int = 5) -> None:
        self.logger, self.what, self.clock = logger, what, clock
        self.interval_s, self.burst = interval_s, burst
        self._start_s = float("-inf")
        self._logged = 0
        self._suppressed = 0

    def warning(self, msg: str, *args) -> None:
        now = self.clock.now()
        if now - self._start_s >= self.interval_s:
            self.flush()
            self._start_s, self._logged = now, 0
        if self._logged < self.burst:
            self._logged += 1
            self.logger.warning(msg, *args)
        else:
            self._suppressed += 1

    def flush(self) -> None:
        if self._suppressed:
            self.logger.warning("%s: %d more in the last %.0f s (not logged one by one)",
                                self.what, self._suppressed, self.interval_s)
            self._suppressed = 0

    def tick(self) -> None:
        """Summarise a finished interval's count (a periodic caller: the sweeper)."""
        if self.clock.now() - self._start_s >= self.interval_s:
            self.flush()
