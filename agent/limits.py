"""Process resource limits raised at start, shared by every long-running component.

A server that holds one descriptor per connection runs out at the soft ``RLIMIT_NOFILE``
(systemd's default soft limit is 1024, whatever the hard one is); the soft limit may be
raised up to the hard limit without privilege (getrlimit(2), "RLIMIT_NOFILE").  Each
component calls :func:`raise_nofile` once at start and logs the value then in force, so an
operator reading the log knows how many connections it can hold.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NofileLimit:
    """``soft``/``hard``: descriptors (``resource.RLIM_INFINITY`` for unlimited);
    ``before``: the soft limit found at start; ``raised``: whether it changed."""

    soft: int
    hard: int
    before: int

    @property
    def raised(self) -> bool:
        return self.soft != self.before


# Linux refuses a soft limit above fs.nr_open (1,048,576 by default) with EPERM even when
# the hard limit is RLIM_INFINITY; this is the ceiling tried then.
_NR_OPEN_DEFAULT = 1 << 20


def raise_nofile(component: str = "rewarm", *, logger: logging.Logger | None = None) -> NofileLimit:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit and log the value in force.

    Never raises: a limit that cannot be raised (a sandbox refusing setrlimit) is logged as a
    warning and the soft limit found is returned unchanged."""
    logger = logger or log
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if target == resource.RLIM_INFINITY:
        target = _NR_OPEN_DEFAULT
    new = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            new = target
        except (ValueError, OSError) as exc:
            logger.warning("%s: could not raise RLIMIT_NOFILE soft %d to %d: %s",
                           component, soft, target, exc)
    limit = NofileLimit(new, hard, soft)
    logger.info("%s: RLIMIT_NOFILE soft=%s hard=%s%s", component, _show(new), _show(hard),
                f" (raised from {_show(soft)})" if limit.raised else "")
    return limit


def _show(n: int) -> str:
    return "unlimited" if n == resource.RLIM_INFINITY else str(n)
