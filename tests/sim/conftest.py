"""Helpers for the simulator's tests: tiny hand-made workloads."""

import numpy as np
import pytest

from agent.sim.trace import Workload


def make_workload(rows):
    """rows: (arrival_s, occupancy_s, prefill_s, need_tokens)"""
    a = np.array(rows, dtype=np.float64)
    return Workload(a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].astype(np.int64),
                    np.zeros(len(rows), dtype=np.int16))


@pytest.fixture
def workload_factory():
    return make_workload
