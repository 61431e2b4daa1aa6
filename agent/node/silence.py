"""How long the node agent waits on a warm replica's stats probe, and how long a replica may
leave its probes unanswered before it is taken out of routing (SIGSTOP, a livelock, a swap
storm).

A fixed bound misfires on a loaded host: a replica on two shared cores, mid-step on a long
batch, answers its probe late without being stopped.  Both bounds therefore grow with what
the replica has shown of itself, and never fall below the configured values (the floors,
:class:`~agent.node.state.AgentConfig` ``probe_timeout_s`` / ``unresponsive_after_s``)::

    measured_s           = max(PROBE_RTT_FACTOR x p99(round trips of its last answered probes),
                               PROBE_STEPS x step_s)
    probe_timeout_s      = min(CEILING x probe_timeout_s, max(probe_timeout_s, measured_s))
    unresponsive_after_s = min(CEILING x unresponsive_after_s,
                               max(unresponsive_after_s, SILENT_PROBES x measured_s))

``step_s`` is the replica's own measured decode step at a full batch (the speed keys of its
last stats, agent/speed.py; none until it has measured itself): its worker answers ``stats``
on its event loop, which a step in progress on the same cores can hold up.  Round trips are
those of the last ``RTT_WINDOW`` probes it answered (its probe history).  A replica that
answered nothing yet is bounded by the floors alone.  The ceilings keep one slow answer (a
swap storm) or a replica's own stats (a huge context or step time it reports) from making it
impossible to call silent, and keep one probe from holding the node agent's tick (which also
renews the registry's TTLs) for minutes.
"""

from __future__ import annotations

import math
from collections import deque

from agent.node.state import AgentConfig, ReplicaRecord
from agent.speed import SpeedProfile

PROBE_RTT_FACTOR = 4.0
"""A probe is waited on four times the p99 round trip of the replica's recent ones."""
PROBE_STEPS = 2.0
"""... and at least two of its decode steps at a full batch (one in progress, one queued)."""
SILENT_PROBES = 3
"""A replica is silent once this many bounded probes in a row went unanswered."""
RTT_WINDOW = 32
CEILING = 6.0
"""Neither bound exceeds this many times its configured floor (a replica whose event loop
answers six times slower than the floor allows is not serving at speed either)."""
"""Answered probes whose round trip is kept per replica."""


def probe_answered(rec: ReplicaRecord, rtt_s: float) -> None:
    """``rec``'s stats probe was answered after ``rtt_s`` seconds (its probe history)."""
    if rec.probe_rtts_s is None:
        rec.probe_rtts_s = deque(maxlen=RTT_WINDOW)
    if math.isfinite(rtt_s) and rtt_s >= 0:
        rec.probe_rtts_s.append(rtt_s)


def _step_s(rec: ReplicaRecord) -> float:
    stats = rec.last_stats
    speed = SpeedProfile.from_meta(stats) if stats else None
    if speed is None:
        return 0.0
    try:
        seqs = max(1, int(stats.get("max_seqs", 1)))
        ctx = max(0, int(stats.get("active_ctx_tokens", 0)))
    except (TypeError, ValueError):
        seqs, ctx = 1, 0
    return speed.decode_step_s(seqs, ctx)


def _measured_s(rec: ReplicaRecord) -> float:
    """What ``rec`` has shown a probe may take: 4 x p99 round trip, 2 decode steps."""
    rtts = sorted(rec.probe_rtts_s or ())
    p99 = rtts[max(0, math.ceil(0.99 * len(rtts)) - 1)] if rtts else 0.0
    measured = max(PROBE_RTT_FACTOR * p99, PROBE_STEPS * _step_s(rec))
    return measured if math.isfinite(measured) else 0.0


def probe_timeout_s(config: AgentConfig, rec: ReplicaRecord) -> float:
    """Seconds to wait on ``rec``'s next stats probe (module docstring)."""
    floor = config.probe_timeout_s
    return min(CEILING * floor, max(floor, _measured_s(rec)))


def unresponsive_after_s(config: AgentConfig, rec: ReplicaRecord) -> float:
    """Seconds of unanswered probes after which ``rec`` leaves routing (module docstring)."""
    floor = config.unresponsive_after_s
    return min(CEILING * floor, max(floor, SILENT_PROBES * _measured_s(rec)))
