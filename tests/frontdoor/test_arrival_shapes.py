"""Synthetic arrival shapes (steady, step burst, ramp, long idle gap) through the request path
in virtual time, with replicas whose real speed is the speed they report and restores that
take their measured time: when predictions are right there is no 504 and no late first
token, every request is answered, served ones start within their SLO, and refusals are 429s
answered at arrival (tests/frontdoor/virtual_fleet.py; offered load is a fraction of one
replica's capacity computed from its profile, not a tuned rate)."""

import asyncio
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from virtual_fleet import capacity_rps as fleet_capacity_rps, FAST, Fleet  # noqa: E402

PROMPT, GEN, SEQS = (16, 128), (8, 64), 8


def capacity_rps() -> float:
    """One replica's request rate at its sustainable concurrency within the warm SLO."""
    return fleet_capacity_rps(FAST, PROMPT, GEN, SEQS)


def arrivals(shape: str, rng) -> np.ndarray:
    """Arrival times (s) for ``shape``, as rates relative to one replica's capacity."""
    cap = capacity_rps()
    pieces = {"steady": [(60.0, 0.7)],
              "step_burst": [(20.0, 0.3), (10.0, 3.0), (20.0, 0.3)],
              "ramp": [(5.0, 0.1 + 0.1 * k) for k in range(12)],
              "idle_gap": [(10.0, 0.5), (120.0, 0.0), (10.0, 0.5)],
              "overload": [(30.0, 3.0)]}[shape]
    out, t = [], 0.0
    for length_s, load in pieces:
        if load > 0:
            n = rng.poisson(load * cap * length_s)
            out.extend(t + np.sort(rng.uniform(0, length_s, n)))
        t += length_s
    return np.array(out)


@pytest.mark.parametrize("shape,restore_s", [
    ("steady", 1.0), ("step_burst", 1.0), ("ramp", 1.0), ("idle_gap", 1.0),
    ("overload", 6.0),   # restores slower than the 4 s restore SLO: refusals must be 429s
    ("step_burst", 6.0)])
def test_no_504_when_predictions_are_right(shape, restore_s):
    rng = np.random.default_rng(12)
    times = arrivals(shape, rng)

    async def main():
        f = Fleet(speed=FAST, max_seqs=SEQS, restore_s=restore_s,
                  measured_restores_s=(restore_s,), restores_per_model=2, restores_overall=4)
        t0 = f.clock.now()
        for t in times:
            f.arrive(t0 + t, int(rng.integers(*PROMPT)), int(rng.integers(*GEN)))
        await f.timeline.run_until(t0 + times[-1] + 60)
        return f

    f = asyncio.run(main())
    codes = [s.code for s in f.sinks]
    assert len(codes) == len(times) and None not in codes          # every request answered
    assert f.path.counts["expired_504"] == 0 and 504 not in codes
    assert f.path.counts["late_first_token"] == 0
    assert set(codes) <= {200, 429}
    served = [s for s in f.sinks if s.code == 200]
    assert all(s.first_s - s.arrival_s <= 4.0 for s in served)     # within the path's SLO
    warm = [s for s in served if s.final["path"] == "warm_hit"]
    assert all(s.first_s - s.arrival_s <= 2.0 for s in warm)
    refused = [s for s in f.sinks if s.code == 429]
    at_once = [s for s in refused if s.at_s - s.arrival_s <= 0.050]   # answered at once: 50 ms
    assert len(at_once) >= 0.95 * len(refused), (len(at_once), len(refused))
    if shape in ("steady", "idle_gap", "ramp") or restore_s < 4.0:  # capacity can follow
        assert len(served) >= 0.9 * len(codes), (len(served), len(codes))
    if shape == "overload":        # 3x one replica until restores land 6 s later
        assert len(refused) > 0 and len(served) > 0.5 * len(codes)
