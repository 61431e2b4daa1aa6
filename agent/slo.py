"""The TTFT SLO a request is held to, and the deadline it is refused against.

Two numbers per request, kept apart:

- the **SLO** is what capacity aims for and what attainment counts: ``base + prefill``, where
  ``prefill = prompt_tokens / prefill_tokens_per_s`` at the serving replicas' measured prefill
  speed (agent/speed.py), and ``base`` is the budget for the rest of the path: 2 s when a
  warm replica serves it, 4 s when it waits for a restore (the default warm-hit and
  restore-path TTFT p99 SLOs of docs/architecture.md, "Admission").  A 12k-token prompt at
  4,000 tokens/s has a 3 s prefill: its SLO is 5 s warm,
  not a 2 s it could never meet.
- the **deadline** is what admission refuses against: the client's (``deadline_ms``, or the
  HTTP header ``x-rewarm-deadline-ms``), else ``deadline_factor`` times the SLO (default
  :data:`DEADLINE_FACTOR`, 1: the deadline is the SLO).  A request that cannot get its first
  token before its deadline is refused at once with the reason.  So by default a request is
  either answered within its SLO or refused at once: a late answer is a miss too, and one
  admitted late would also delay every request queued behind it, so the default never trades
  misses for fewer refusals.  A client that would rather wait longer than be refused says
  so with its own deadline (the client's choice); one answered after its SLO but before that
  deadline is served and counted as an SLO miss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent.errors import ConfigError

WARM_BASE_S = 2.0
RESTORE_BASE_S = 4.0
DEADLINE_FACTOR = 1.0


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"TtftSlo: {name}={value!r}; limit is > 0 and finite", name=name,
                          value=value, limit="> 0")
    return float(value)


@dataclass(frozen=True)
class TtftSlo:
    """One model's SLO and default deadline (module docstring).

    ``warm_base_s`` / ``restore_base_s``: seconds beyond the request's own prefill;
    ``deadline_factor``: the default deadline over the SLO (>= 1: a deadline inside the SLO
    would refuse requests the SLO counts as met).  Raises :class:`ConfigError` otherwise.
    """

    warm_base_s: float = WARM_BASE_S
    restore_base_s: float = RESTORE_BASE_S
    deadline_factor: float = DEADLINE_FACTOR

    def __post_init__(self) -> None:
        _positive("warm_base_s", self.warm_base_s)
        _positive("restore_base_s", self.restore_base_s)
        _positive("deadline_factor", self.deadline_factor)
        if self.deadline_factor < 1.0:
            raise ConfigError(f"TtftSlo: deadline_factor={self.deadline_factor}; limit is >= 1",
                              name="deadline_factor", value=self.deadline_factor, limit=">= 1")

    def slo_s(self, prefill_s: float, restore: bool) -> float:
        """TTFT SLO (s) of a request whose prefill takes ``prefill_s`` seconds at the serving
        replicas' measured speed; ``restore``: it found no warm replica of its model."""
        return (self.restore_base_s if restore else self.warm_base_s) + max(0.0, prefill_s)

    def deadline_s(self, prefill_s: float, restore: bool,
                   client_deadline_s: float | None = None) -> float:
        """Seconds from arrival to the last acceptable first token: the client's when given,
        else ``deadline_factor`` times :meth:`slo_s`."""
        if client_deadline_s is not None:
            return float(client_deadline_s)
        return self.deadline_factor * self.slo_s(prefill_s, restore)


def prefill_s(prompt_tokens: int, prefill_tokens_per_s: float) -> float:
    """Seconds to prefill ``prompt_tokens`` at ``prefill_tokens_per_s`` (a replica's measured
    prefill speed, tokens/s); ConfigError for a rate that is not > 0 or a negative count."""
    _positive("prefill_tokens_per_s", prefill_tokens_per_s)
    if prompt_tokens < 0:
        raise ConfigError(f"prompt_tokens={prompt_tokens}; limit is >= 0", name="prompt_tokens",
                          value=prompt_tokens, limit=">= 0")
    return prompt_tokens / prefill_tokens_per_s
