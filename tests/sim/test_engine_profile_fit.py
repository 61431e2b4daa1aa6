"""bench/engine_profile.py's fit: agent/speed.py's model from measured points, non-negative,
by relative error (the numbers the simulator's replicas run at)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from engine_profile import fit, nnls_relative  # noqa: E402

from agent.speed import SpeedProfile  # noqa: E402

TRUE = SpeedProfile(prefill_tokens_per_s=900.0, prefill_overhead_s=0.008, decode_base_s=0.025,
                    decode_per_seq_s=0.004, decode_per_ctx_token_s=3e-6)
GRID = [(b, c) for b in (1, 2, 4, 8) for c in (40, 300, 900)]


def points(noise=None):
    rng = np.random.default_rng(1)
    jitter = (lambda: 1.0) if noise is None else (lambda: float(rng.uniform(1 - noise, 1 + noise)))
    pre = [{"prompt_tokens": n, "s": TRUE.prefill_s(n) * jitter()} for n in (8, 32, 128, 448)]
    dec = [{"batch": b, "context_tokens": b * c, "step_s": TRUE.decode_step_s(b, b * c) * jitter()}
           for b, c in GRID]
    return pre, dec


def test_fit_recovers_an_exact_profile():
    got, quality = fit(*points())
    for k in ("prefill_tokens_per_s", "prefill_overhead_s", "decode_base_s", "decode_per_seq_s",
              "decode_per_ctx_token_s"):
        assert getattr(got, k) == pytest.approx(getattr(TRUE, k), rel=1e-6), k
    assert quality == {"prefill_max_rel_err": 0.0, "decode_max_rel_err": 0.0}


def test_fit_under_noise_stays_close_and_never_negative():
    got, quality = fit(*points(noise=0.1))
    for b, c in GRID:
        assert got.decode_step_s(b, b * c) == pytest.approx(TRUE.decode_step_s(b, b * c), rel=0.12)
    assert quality["decode_max_rel_err"] <= 0.2


def test_nnls_holds_a_coefficient_at_zero_rather_than_negative():
    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 2.0, 1.0])             # a falling line: the slope would be negative
    theta = nnls_relative(x, y)
    assert theta[1] == 0.0 and theta[0] > 0
