"""A tiny trace whose outcome is worked out by hand, through the production queue and router."""

import numpy as np
import pytest

from agent.sim.events import EXPIRED, PATH_QUEUED, PATH_WARM, SERVED, SHED
from agent.sim.fleet import FleetConfig, StartupTimes
from agent.sim.policies import FixedPool
from agent.sim.scenarios import run_workload


def fixed(n):
    return lambda cfg, clock, fleet: FixedPool("m", n)


# One replica: 2 sequence slots, 100 KV tokens.  Admission: depth 1, wait 3 s.
CFG = FleetConfig(model="m", seqs_per_replica=2, kv_capacity_tokens=100)
ROWS = [
    (0.0, 10.0, 0.5, 10),   # r0: free slot -> served at 0, TTFT 0.5, done at 10
    (1.0, 10.0, 0.5, 10),   # r1: second slot -> served at 1, TTFT 0.5, done at 11
    (2.0, 5.0, 0.5, 10),    # r2: full -> queued; deadline 5 < 10 -> expired (504)
    (9.0, 5.0, 0.5, 10),    # r3: queued; r0 ends at 10 -> dispatched, TTFT 1 + 0.5
    (9.5, 5.0, 0.5, 10),    # r4: queue holds r3 (depth 1) -> shed (429)
    (20.0, 5.0, 0.5, 200),  # r5: needs 200 KV tokens > 100 -> can never fit -> shed at once
]


def test_hand_checked_outcome(workload_factory):
    w = workload_factory(ROWS)
    s, rec, sim = run_workload(w, CFG, fixed(1), max_wait_s=3.0, sla_s=1.0, max_depth=1,
                               initial_replicas=1, end_s=30.0)
    assert list(rec.status) == [SERVED, SERVED, EXPIRED, SERVED, SHED, SHED]
    assert s["served"] == 3 and s["shed"] == 2 and s["expired"] == 1
    assert s["shed_too_large"] == 1                          # r5, refused on arrival
    assert s["queued"] == 3                                  # r2, r3, r4 found no slot
    np.testing.assert_allclose(rec.ttft_s[[0, 1, 3]], [0.5, 0.5, 1.5])
    assert list(rec.path[[0, 1, 3]]) == [PATH_WARM, PATH_WARM, PATH_QUEUED]
    assert rec.gpu_s == pytest.approx(30.0)                  # one replica, 0 -> 30 s
    assert rec.busy_slot_s == pytest.approx(25.0)            # 10 + 10 + 5
    assert s["sla_compliance"] == pytest.approx(2 / 6)       # r0, r1 within 1 s
    assert s["idle_gpu_hours"] == pytest.approx((30.0 - 25.0 / 2) / 3600.0)
    assert sim.in_flight == 0 and sim.waiting == 0


def test_start_up_delays_service_and_is_billed(workload_factory):
    # No replica at first; the tick at t=0 asks for one; restore 3.6 s -> warm at 3.6.
    cfg = FleetConfig(model="m", seqs_per_replica=2, kv_capacity_tokens=100,
                      startup=StartupTimes(restore_s=(3.6, 3.6)))
    w = workload_factory([(0.5, 2.0, 0.25, 10), (1.0, 2.0, 0.25, 10), (1.5, 2.0, 0.25, 10)])
    s, rec, _ = run_workload(w, cfg, fixed(1), max_wait_s=3.5, sla_s=4.0, end_s=10.0)
    # r0 waits 0.5 -> 3.6 (3.1 s), r1 1.0 -> 3.6 (2.6 s); at 3.6 both slots are taken, r2
    # would start at 5.6, after its deadline 1.5 + 3.5 = 5.0 -> expired at the tick t=5.
    assert list(rec.status) == [SERVED, SERVED, EXPIRED]
    np.testing.assert_allclose(rec.ttft_s[:2], [3.1 + 0.25, 2.6 + 0.25])
    assert rec.gpu_s == pytest.approx(10.0)          # billed from the restore's start
    assert rec.starts_by_tier == {"suspended": 0, "restore": 1, "naive": 0}
    assert s["sla_compliance"] == pytest.approx(2 / 3)


def test_deadline_before_start_up_expires(workload_factory):
    # Same, with a 2.5 s wait bound: r0 (deadline 3.0) and r1 (3.5) give up before the
    # replica is warm at 3.6; r2 (deadline 4.0) is served at 3.6 with TTFT 2.1 + 0.25.
    cfg = FleetConfig(model="m", seqs_per_replica=2, kv_capacity_tokens=100)
    w = workload_factory([(0.5, 2.0, 0.25, 10), (1.0, 2.0, 0.25, 10), (1.5, 2.0, 0.25, 10)])
    s, rec, _ = run_workload(w, cfg, fixed(1), max_wait_s=2.5, sla_s=4.0, end_s=10.0)
    assert list(rec.status) == [EXPIRED, EXPIRED, SERVED]
    assert rec.ttft_s[2] == pytest.approx(2.35)
    assert s["expired"] == 2 and s["served"] == 1


def test_naive_boot_without_snapshots(workload_factory):
    cfg = FleetConfig(model="m", seqs_per_replica=1, kv_capacity_tokens=100, use_snapshot=False,
                      startup=StartupTimes(naive_s=(60.0, 60.0)))
    w = workload_factory([(1.0, 1.0, 0.0, 1)])
    s, rec, _ = run_workload(w, cfg, fixed(1), max_wait_s=100.0, sla_s=100.0, end_s=100.0)
    assert rec.ttft_s[0] == pytest.approx(59.0)
    assert rec.starts_by_tier["naive"] == 1
    # no demand shortfall once warm; before that 1 call with nowhere to go
    assert s["peak_shortfall"] == 1
