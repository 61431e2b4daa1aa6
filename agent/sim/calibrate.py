"""The simulated replica's capacity, measured the way the live one is: backlogged.

A live replay scales its window by what the replica sustained while backlogged, measured
through the front door (agent/sim/replay.py ``saturate``).  The simulator's replicas step at
a speed profile (agent/sim/replica.py ``SimReplica``), which says nothing of what the live
stack spends around the engine (the batching loop, sockets, the front door and the load
generator on the same cores).  :func:`sim_sustained_rps` runs one simulated replica
backlogged on the same request mix (closed loop, virtual time, no I/O) and returns what it
sustains; the ratio of the live figure to it is the speed the simulated replicas are given
(:func:`matched_speed`), so the simulator's capacity is the one measured live, while the
mechanics (the step, the budget, admission, the predictor) stay its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from agent.errors import ConfigError
from agent.sim.contention import at_speed
from agent.sim.replica import SimReplica
from agent.speed import SpeedProfile
from agent.throughput import BacklogCapacity


def sim_sustained_rps(speed: SpeedProfile, lengths: Sequence[tuple[int, int]], *,
                      max_seqs: int, max_seq_len: int | None, concurrency: int,
                      departures: int = 400, warmup: int = 50,
                      reported: SpeedProfile | None = None,
                      itl_target_s: float | None = None) -> float:
    """Requests per second one :class:`SimReplica` stepping at ``speed`` (planning with
    ``reported``, default ``speed``) completes with ``concurrency`` requests always in it
    (each one that ends replaced by the next of ``lengths``, ``(prompt, output)`` tokens, in
    turn), over ``departures`` completions after the first ``warmup``; ``itl_target_s`` its
    step target as :class:`SimReplica` takes it (None: the profile's, as the simulator's
    replicas plan).  Raises ConfigError
    for an empty ``lengths`` or counts below 1 (a replica of no slots never completes one)."""
    if max_seqs < 1:
        raise ConfigError(f"sim_sustained_rps: max_seqs={max_seqs}; limit is >= 1",
                          name="max_seqs", value=max_seqs, limit=1)
    if not lengths or concurrency < 1 or departures < 1 or warmup < 0:
        raise ConfigError(f"sim_sustained_rps: {len(lengths)} lengths, concurrency="
                          f"{concurrency}, departures={departures}, warmup={warmup}; limits "
                          "are >= 1 each (warmup >= 0)", name="concurrency", value=concurrency,
                          limit=1)
    replica = SimReplica(speed, max_seqs, reported, itl_target_s=itl_target_s,
                         max_seq_len=max_seq_len)
    k = 0

    def submit() -> None:
        nonlocal k
        prompt, output = lengths[k % len(lengths)]
        replica.submit(k, prompt, output)
        k += 1

    for _ in range(concurrency):
        submit()
    t, done, start_s = 0.0, 0, 0.0
    while done < warmup + departures:
        _firsts, t = replica.start_step(t)
        for _ in replica.end_step():
            done += 1
            if done == warmup:
                start_s = t
            submit()
    return departures / (t - start_s) if t > start_s else math.inf


def matched_speed(actual: SpeedProfile, sustained: BacklogCapacity,
                  lengths: Sequence[tuple[int, int]], *, max_seqs: int,
                  max_seq_len: int | None, reported: SpeedProfile | None = None,
                  ) -> tuple[SpeedProfile, float]:
    """``actual`` scaled so that a simulated replica sustains what the live one was measured
    to (``sustained``, at the same request mix ``lengths`` and the concurrency its clients
    kept, ``sustained.batch``), and the factor: every duration divided by it, the prefill
    rate multiplied (``factor`` < 1: the live stack is slower than its engine's profile)."""
    sim = sim_sustained_rps(actual, lengths, max_seqs=max_seqs, max_seq_len=max_seq_len,
                            concurrency=max(1, round(sustained.batch)), reported=reported)
    factor = sustained.rps / sim if math.isfinite(sim) and sim > 0 else 1.0
    return at_speed(actual, factor), factor
