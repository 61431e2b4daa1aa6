"""Demand forecasting: Holt's double exponential smoothing of a model's request rate.

The predictor samples each model's request rate once per step (1 s by default) and forecasts
it ``lead_time_s`` ahead, far enough that a replica restored now is warm when the demand
arrives (snapshot design document, ../shared/seeds/002_b8b5536ec4319928.txt, "Cold Start
Predictor": the lead time must exceed restore latency plus decision latency).

Holt's method with optional damping (Gardner & McKenzie 1985), one step per sample:

    level_t = alpha * x_t + (1 - alpha) * (level_{t-1} + phi * trend_{t-1})
    trend_t = beta * (level_t - level_{t-1}) + (1 - beta) * phi * trend_{t-1}
    forecast(h) = level_t + (phi + phi^2 + ... + phi^h) * trend_t

Real inputs are untidy, so:

- a missing sample (``None``, NaN, inf) advances the state on its own forecast
  (``level += phi * trend``, ``trend *= phi``) instead of pretending the rate was zero;
- a negative sample is clamped to 0 (a rate cannot be negative);
- the level is kept >= 0 and the forecast is clamped to >= 0; it is never NaN.

:class:`CounterRate` turns the front doors' cumulative request counters into
``(arrivals, window_s)`` pairs, surviving counter resets and gaps after a restart.
"""

from __future__ import annotations

import math

from agent.errors import ConfigError


def _check_unit(name: str, value: float, *, low_open: bool) -> float:
    value = float(value)
    ok = (0.0 < value <= 1.0) if low_open else (0.0 <= value <= 1.0)
    if not ok or math.isnan(value):
        limit = "0 < x <= 1" if low_open else "0 <= x <= 1"
        raise ConfigError(f"Holt: {name}={value} is out of range; limit is {limit}",
                          name=name, value=value, limit=limit)
    return value


class Holt:
    """Holt's linear (optionally damped) exponential smoothing of a non-negative series.

    ``alpha`` (level) in (0, 1], ``beta`` (trend) in [0, 1], ``phi`` (damping) in (0, 1];
    ``phi = 1`` is undamped Holt. Raises :class:`~agent.errors.ConfigError` otherwise.
    """

    def __init__(self, alpha: float, beta: float, phi: float = 1.0) -> None:
        self.alpha = _check_unit("alpha", alpha, low_open=True)
        self.beta = _check_unit("beta", beta, low_open=False)
        self.phi = _check_unit("phi", phi, low_open=True)
        self.level: float | None = None   # units of x (req/s); None until the first sample
        self.trend = 0.0                  # units of x per step
        self.samples = 0                  # real samples seen
        self.missing = 0                  # missing samples seen

    def update(self, x: float | None) -> None:
        """Feed one sample (a rate, >= 0); ``None``/NaN/inf count as a missing sample."""
        if x is None or not math.isfinite(float(x)):
            self.missing += 1
            if self.level is not None:
                self.level = max(0.0, self.level + self.phi * self.trend)
                self.trend *= self.phi
            return
        x = max(0.0, float(x))
        self.samples += 1
        if self.level is None:
            self.level, self.trend = x, 0.0
            return
        prev = self.level
        level = self.alpha * x + (1.0 - self.alpha) * (prev + self.phi * self.trend)
        level = max(0.0, level)
        self.trend = self.beta * (level - prev) + (1.0 - self.beta) * self.phi * self.trend
        self.level = level

    def reset(self, x: float) -> None:
        """Restart from ``x`` with no trend (after a gap too long to bridge)."""
        self.level, self.trend = max(0.0, float(x)), 0.0

    def forecast(self, h_steps: float) -> float:
        """The rate expected ``h_steps`` steps ahead (>= 0, never NaN; 0 before any sample)."""
        if self.level is None:
            return 0.0
        h = max(0.0, float(h_steps))
        if self.phi == 1.0:
            gain = h
        else:
            gain = self.phi * (1.0 - self.phi ** h) / (1.0 - self.phi)
        value = self.level + gain * self.trend
        if not math.isfinite(value) or value < 0.0:
            return 0.0
        return value


class CounterRate:
    """Arrivals between successive readings of a cumulative request counter.

    ``sample(counter, t_s)`` returns ``(arrivals, window_s)`` since the previous reading, or
    ``None`` for the first reading or a reading that does not move time forward. A counter
    that went down was reset (the front door restarted): the new value is all the arrivals
    since the restart, so ``arrivals = counter``. A gap (a long ``window_s``) is returned as
    is; :meth:`agent.predictor.loop.Predictor.observe` spreads it over the steps it covers.
    """

    def __init__(self) -> None:
        self._last: tuple[int, float] | None = None
        self.resets = 0

    def sample(self, counter: int, t_s: float) -> tuple[int, float] | None:
        """A counter or time that is NaN or infinite is a missing reading: None, and the
        previous reading stays the base of the next window."""
        if not (math.isfinite(counter) and math.isfinite(t_s)):
            return None
        counter = int(counter)
        if counter < 0:
            raise ConfigError(f"CounterRate: counter={counter} is negative; limit is >= 0",
                              name="counter", value=counter, limit=0)
        last, self._last = self._last, (counter, float(t_s))
        if last is None:
            return None
        prev, prev_t = last
        window_s = float(t_s) - prev_t
        if window_s <= 0.0:
            self._last = last
            return None
        if counter < prev:
            self.resets += 1
            return counter, window_s
        return counter - prev, window_s
