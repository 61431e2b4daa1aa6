"""Judging forecasters at the lead time the predictor needs.

A forecast made at step ``t`` is used to size the warm pool for demand at ``t + h``, where
``h`` = restore p99 + decision latency (in steps): a replica asked for now is warm then
(docs/architecture.md, "Sizing": forecast lead time >= restore p99 + decision latency).  So each candidate is fed the series one step at a time and, after step ``t``,
its ``forecast(h)`` is compared with the sample at ``t + h``.

Scores (lower is better):

- MAE, mean ``|y - f|`` (req/s);
- pinball loss at quantile ``q`` (Koenker & Bassett, Econometrica 46(1), 1978):
  ``mean(max(q * (y - f), (q - 1) * (y - f)))``.  At ``q = 0.9`` under-forecasting costs nine
  times what over-forecasting does, the asymmetry of sizing for an SLO: a replica too few
  misses deadlines, a replica too many costs only its idle time;
- ``under_share``: the share of steps forecast below the actual rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from agent.errors import ConfigError
from agent.predictor.forecast import Forecaster


def pinball_loss(actual: np.ndarray, forecast: np.ndarray, q: float) -> float:
    """Mean pinball (quantile) loss of ``forecast`` [T] against ``actual`` [T] at ``q``."""
    diff = np.asarray(actual, dtype=np.float64) - np.asarray(forecast, dtype=np.float64)
    return float(np.mean(np.maximum(q * diff, (q - 1.0) * diff))) if diff.size else 0.0


@dataclass(frozen=True)
class Score:
    """One candidate's scores at one lead time (req/s; ``under_share`` a fraction)."""

    name: str
    lead_steps: int
    mae: float
    pinball: float
    under_share: float
    mean_forecast: float

    def to_json(self) -> dict:
        return dict(self.__dict__)


def forecasts_at_lead(series: Iterable[float | None], forecaster: Forecaster,
                      lead_steps: int) -> np.ndarray:
    """``forecast(lead_steps)`` after each sample of ``series`` [T] -> float64 [T]."""
    out = []
    for x in series:
        forecaster.update(x)
        out.append(forecaster.forecast(lead_steps))
    return np.asarray(out, dtype=np.float64)


def evaluate(series: np.ndarray, candidates: Mapping[str, Callable[[], Forecaster]], *,
             lead_steps: int, q: float = 0.9) -> list[Score]:
    """Score every candidate (name -> a factory of a fresh forecaster) on ``series`` [T]
    (req/s per step) at ``lead_steps`` ahead.  Steps whose target lies past the end are not
    scored.  Raises ConfigError for ``lead_steps`` < 1, ``q`` outside (0, 1) or a series no
    longer than the lead."""
    if not (isinstance(lead_steps, int) and lead_steps >= 1):
        raise ConfigError(f"lead_steps={lead_steps!r}; limit is an integer >= 1",
                          name="lead_steps", value=lead_steps, limit=1)
    if not 0.0 < q < 1.0:
        raise ConfigError(f"q={q}; limit is 0 < q < 1", name="q", value=q, limit="(0, 1)")
    x = np.asarray(series, dtype=np.float64)
    if x.shape[0] <= lead_steps:
        raise ConfigError(f"series of {x.shape[0]} steps is not longer than the lead "
                          f"({lead_steps} steps)", name="series", value=int(x.shape[0]),
                          limit=lead_steps + 1)
    actual = x[lead_steps:]
    scores = []
    for name, make in candidates.items():
        f = forecasts_at_lead(x.tolist(), make(), lead_steps)[:-lead_steps]
        scores.append(Score(name, lead_steps, float(np.mean(np.abs(actual - f))),
                            pinball_loss(actual, f, q), float(np.mean(f < actual)),
                            float(np.mean(f))))
    return scores


def rate_series(arrival_s: np.ndarray, step_s: float = 1.0) -> np.ndarray:
    """Arrivals [N] (seconds, sorted) -> requests per second in each ``step_s`` step [T]."""
    if not (step_s > 0 and math.isfinite(step_s)):
        raise ConfigError(f"step_s={step_s}; limit is > 0", name="step_s", value=step_s,
                          limit="> 0")
    a = np.asarray(arrival_s, dtype=np.float64)
    if not a.size:
        return np.zeros(0)
    bins = np.floor(a / step_s).astype(np.int64)
    return np.bincount(np.maximum(bins, 0)) / step_s
