"""A sparse window keeps its idle gaps when scaled to the machine (replay_scale)."""

import numpy as np
import pytest

from agent.errors import ConfigError
from agent.sim.replay_scale import fit_scale, gap_keeping_speedup
from agent.speed import SpeedProfile

PROFILE = SpeedProfile(prefill_tokens_per_s=1500.0, prefill_overhead_s=0.015,
                       decode_base_s=0.025, decode_per_seq_s=0.003, decode_per_ctx_token_s=1e-6)


def test_a_dense_window_has_no_gap_to_keep():
    arrival = np.arange(0.0, 600.0, 0.5)
    assert gap_keeping_speedup(arrival, 30.0) is None
    assert gap_keeping_speedup(np.array([5.0]), 30.0) is None


def test_a_sparse_window_keeps_its_median_gap_at_the_floor():
    arrival = np.cumsum(np.full(40, 90.0))            # a request every 90 s
    assert gap_keeping_speedup(arrival, 30.0) == pytest.approx(3.0)
    with pytest.raises(ConfigError):
        gap_keeping_speedup(arrival, 0.0)


def test_fit_scale_never_compresses_past_the_cap_and_says_so():
    n = 40
    arrival = np.cumsum(np.full(n, 90.0))
    ctx, gen = np.full(n, 2000), np.full(n, 30)
    args = dict(window_s=3600.0, profile=PROFILE, load=0.3, wall_s=240.0, ttft_slo_s=2.0,
                max_seqs=8, max_tokens_per_request=512)
    free = fit_scale(ctx, gen, **args)
    assert free.speedup > 3.0                          # the budget alone: 3600 s into ~240 s
    cap = gap_keeping_speedup(arrival, 30.0)
    held = fit_scale(ctx, gen, max_speedup=cap, **args)
    assert held.speedup <= cap + 1e-12 and held.bound == "idle_gaps"
    assert held.wall_s >= 3600.0 / cap - 1e-6         # the replay takes the time it needs
    assert np.median(np.diff(arrival)) / held.speedup >= 30.0 - 1e-9
    with pytest.raises(ConfigError):
        fit_scale(ctx, gen, max_speedup=float("nan"), **args)
