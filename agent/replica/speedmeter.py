"""A replica measuring its own speed while it serves: the online fit of agent/speed.py's model.

The engine times each prefill call (one chunk ``[k, L]`` of one or several sequences: agent/speed.py
``plan_prefill_call``; the first tokens it completes sampled) and each decode step (B sequences,
S=1, sampling included) and hands the seconds to a :class:`SpeedMeter`.  The meter fits the two
linear models of :class:`~agent.speed.SpeedProfile`:

- prefill: ``y = prefill_overhead_s + N * (1 / prefill_tokens_per_s)`` for a call computing
  ``N = k * L`` tokens (padding included), features ``[1, N]``: the intercept is a call's fixed
  cost, which the step's budget charges per call, and chunks of many sizes (a step's budget
  cuts prompts where it runs out) pin both coefficients;
- decode: ``y = decode_base_s + (B - 1) * decode_per_seq_s + C * decode_per_ctx_token_s``,
  features ``[1, B - 1, C]``.

Why exponentially weighted least squares with a ridge prior, not an EWMA per batch bucket:
the step cost is linear in (B, C) by construction (weights read once per step, attention over
every cached token), so three coefficients describe every batch and context, including ones the
replica has not run yet (the front door asks about B+1); a bucket table would need a second
dimension for context and has no answer for an empty bucket.  The fit minimises

    sum_i lambda^(n - i) (y_i - x_i . theta)^2  +  w * sum_j s_j^2 (theta_j - prior_j)^2

(recursive least squares with forgetting factor lambda, Ljung & Soderstrom, "Theory and
Practice of Recursive Identification", 1983, ch. 2, in its normal-equation form).  The prior term
is not forgotten, so a direction the traffic does not excite (a replica that only ever runs
B=8 cannot separate base from per-sequence cost) stays at the prior instead of drifting — the
covariance wind-up of plain RLS with forgetting.  ``s_j^2`` is the mean square of feature j
over every sample so far (a given typical size before any), so ``w`` counts the prior as about
``w`` observations at the sizes the replica really sees (0.05: enough to pin an unexcited
direction, too little to bias a fit of tens of samples by more than a percent or so).  Forgetting follows
a machine whose speed changes (a neighbour on the same CPU, thermal limits): ``lambda`` 0.995
per decode step remembers about 200 steps (seconds of serving), 0.98 per prefill about 50
prompts.  A sample more than ``clip`` times off the
current prediction is clipped to that factor (a GC pause or a page fault is one sample, not a
new speed), once the fit rests on at least a few samples.

The meter also keeps how far each engine step that ran a prefill call overran its plan (the
fit's prediction of its calls and decode, against the step's wall time as the replica's loop
saw it: the loop's own time between calls, and the noise a fit of means does not hold):
:meth:`SpeedMeter.step_overrun_s` is the 99th percentile of the last :data:`STEP_WINDOW`
overruns by nearest rank, which the engine takes off its ITL target before it sizes a step's
prefill budget, so the steps' p99, not their mean, lands within the target.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Sequence

import numpy as np

from agent.speed import SpeedProfile

DEFAULT_PRIOR = SpeedProfile(prefill_tokens_per_s=2000.0, prefill_overhead_s=0.01,
                             decode_base_s=0.02, decode_per_seq_s=0.002,
                             decode_per_ctx_token_s=1e-6)
"""A generic starting point (a ~100M-parameter model on a few CPU cores); weak, replaced by the
boot profile within a few calls.  Never reported: a replica reports only measured speed."""

MIN_BASE_S = 1e-6          # floors for the two coefficients SpeedProfile needs > 0
STEP_WINDOW = 100
"""Steps whose overrun is kept: their p99 by nearest rank is the second largest of 100."""
MIN_S_PER_TOKEN = 1e-9


class ForgettingLeastSquares:
    """Exponentially weighted least squares of ``y ~ x . theta`` with a ridge prior.

    ``prior`` [n] the coefficients before any data; ``scale`` [n] a typical magnitude of each
    feature before any is seen (the ridge then follows the features' mean square);
    ``prior_weight`` the prior's worth in observations; ``forget`` lambda in (0, 1].  :meth:`update` is O(n^2), :meth:`theta` solves
    an n x n system (n is 2 or 3 here).
    """

    def __init__(self, prior: Sequence[float], scale: Sequence[float], *,
                 prior_weight: float = 2.0, forget: float = 0.99) -> None:
        if not 0 < forget <= 1:
            raise ValueError(f"forget={forget} must be in (0, 1]")
        self.prior = np.asarray(prior, dtype=np.float64)
        self.prior_weight = prior_weight
        self._x2_sum = np.asarray(scale, dtype=np.float64) ** 2  # one pseudo-sample
        self.forget = forget
        n = len(self.prior)
        self._a = np.zeros((n, n))
        self._b = np.zeros(n)
        self.count = 0
        self.weight = 0.0        # sum of the forgetting weights of the samples held
        self._theta: np.ndarray | None = self.prior.copy()

    def predict(self, x: Sequence[float]) -> float:
        return float(np.dot(self.theta(), x))

    def update(self, x: Sequence[float], y: float) -> None:
        xv = np.asarray(x, dtype=np.float64)
        self._a *= self.forget
        self._b *= self.forget
        self._a += np.outer(xv, xv)
        self._b += xv * y
        self._x2_sum += xv * xv
        self.weight = self.weight * self.forget + 1.0
        self.count += 1
        self._theta = None

    def theta(self) -> np.ndarray:
        if self._theta is None:
            ridge = np.diag(self.prior_weight * self._x2_sum / (1 + self.count))
            self._theta = np.linalg.solve(self._a + ridge, self._b + ridge @ self.prior)
        return self._theta


class SpeedMeter:
    """The replica's measured :class:`SpeedProfile`, updated by every prefill and decode step.

    ``prior``: where the fit starts (the snapshot's recorded profile, else
    :data:`DEFAULT_PRIOR`); ``measured_prior``: whether that prior is itself a measurement (a
    recorded profile may be reported at once; the generic default may not).  Thread-safe:
    the engine thread observes, the event loop reads :meth:`profile`.
    """

    MIN_SAMPLES_TO_CLIP = 8

    def __init__(self, prior: SpeedProfile = DEFAULT_PRIOR, *, measured_prior: bool = False,
                 prior_weight: float = 0.05, prefill_forget: float = 0.98,
                 decode_forget: float = 0.995, clip: float = 4.0,
                 ctx_scale_tokens: float = 1024.0, batch_scale: float = 8.0,
                 prompt_scale_tokens: float = 256.0) -> None:
        self.measured_prior = measured_prior
        self.clip = clip
        self._prefill = ForgettingLeastSquares(
            [prior.prefill_overhead_s, 1.0 / prior.prefill_tokens_per_s],
            [1.0, prompt_scale_tokens], prior_weight=prior_weight, forget=prefill_forget)
        self._decode = ForgettingLeastSquares(
            [prior.decode_base_s, prior.decode_per_seq_s, prior.decode_per_ctx_token_s],
            [1.0, batch_scale, ctx_scale_tokens], prior_weight=prior_weight, forget=decode_forget)
        self._lock = threading.Lock()
        self._profile: SpeedProfile | None = prior
        self._overruns: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        self._overrun_p99_s = 0.0

    @property
    def prefill_samples(self) -> int:
        return self._prefill.count

    @property
    def decode_samples(self) -> int:
        return self._decode.count

    @property
    def measured(self) -> bool:
        """Whether :meth:`profile` rests on measurements (both kinds seen, or a recorded
        prior): only then does the replica report it."""
        return self.measured_prior or (self._prefill.count > 0 and self._decode.count > 0)

    def _observe(self, fit: ForgettingLeastSquares, x: list[float], elapsed_s: float) -> None:
        if not (isinstance(elapsed_s, (int, float)) and math.isfinite(elapsed_s)
                and elapsed_s >= 0):
            return  # a broken clock reading is no sample
        with self._lock:
            if fit.count >= self.MIN_SAMPLES_TO_CLIP:
                pred = fit.predict(x)
                if pred > 0:
                    elapsed_s = min(max(elapsed_s, pred / self.clip), pred * self.clip)
            fit.update(x, elapsed_s)
            self._profile = None

    def observe_prefill(self, prompt_tokens: int, elapsed_s: float) -> None:
        """One prefill call over ``prompt_tokens`` tokens (all its rows) took ``elapsed_s``
        seconds."""
        if prompt_tokens > 0:
            self._observe(self._prefill, [1.0, float(prompt_tokens)], elapsed_s)

    def observe_decode(self, batch: int, context_tokens: int, elapsed_s: float) -> None:
        """One decode step over ``batch`` sequences holding ``context_tokens`` cached tokens
        in total (before the step) took ``elapsed_s`` seconds."""
        if batch > 0:
            self._observe(self._decode, [1.0, float(batch - 1), float(context_tokens)], elapsed_s)

    def observe_step(self, planned_s: float, elapsed_s: float) -> None:
        """One engine step the fit planned at ``planned_s`` took ``elapsed_s`` (s): its
        overrun ``max(0, elapsed - planned)`` joins the window.  A broken reading (not a
        finite number >= 0, or no plan) is no sample, nor is a step planned before the fit
        rests on :attr:`MIN_SAMPLES_TO_CLIP` samples of each kind (or a recorded prior): the
        boot profile's steps, planned on the generic prior, overran by most of their length."""
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                   for v in (planned_s, elapsed_s)) or planned_s <= 0:
            return
        if not self.measured_prior and min(self._prefill.count, self._decode.count) \
                < self.MIN_SAMPLES_TO_CLIP:
            return
        with self._lock:
            self._overruns.append(max(0.0, elapsed_s - planned_s))
            if len(self._overruns) >= 2:       # the full window's rank: the second largest
                self._overrun_p99_s = sorted(self._overruns)[-2]

    def step_overrun_s(self) -> float:
        """The 99th percentile (nearest rank at a full window's rank) of the last
        :data:`STEP_WINDOW` steps' overruns (s); 0 until two steps were seen."""
        return self._overrun_p99_s

    def profile(self) -> SpeedProfile:
        """The current fit as a valid SpeedProfile: a negative coefficient (noise around a
        true zero) is reported as 0, the base and the per-token prefill cost at their floors."""
        with self._lock:
            if self._profile is None:
                overhead, per_token = self._prefill.theta()
                base, per_seq, per_ctx = self._decode.theta()
                self._profile = SpeedProfile(
                    prefill_tokens_per_s=1.0 / max(float(per_token), MIN_S_PER_TOKEN),
                    prefill_overhead_s=max(0.0, float(overhead)),
                    decode_base_s=max(MIN_BASE_S, float(base)),
                    decode_per_seq_s=max(0.0, float(per_seq)),
                    decode_per_ctx_token_s=max(0.0, float(per_ctx)))
            return self._profile


def boot_profile(engine, *, prompt_tokens: Sequence[int] = (16, 128), batch: int = 4,
                 new_tokens: int = 4) -> dict[str, int]:
    """A short profile before a replica reports ready, so its first report carries measured
    speed: one prompt of each length in ``prompt_tokens`` alone (B=1: two prefill sizes, two
    contexts), then ``batch`` short prompts together (B=batch; their prefill one call of
    ``batch`` rows, a third size), each generating ``new_tokens`` greedily.  Three (B, C) points
    separate the decode coefficients; the three call sizes the prefill ones.  On SmolLM2-135M on
    two CPU cores this is ~20 forward calls (a fraction of a second).  Needs an idle engine (as
    :meth:`Engine.generate`); lengths are capped to the KV slot.  Returns the samples taken:
    ``{"prefill": n, "decode": n}`` (a prompt longer than a step's budget is more than one)."""
    meter = engine.meter
    before = (meter.prefill_samples, meter.decode_samples)
    vocab = engine.config.vocab_size
    room = max(1, engine.kv.max_seq_len - new_tokens)

    def prompt(n: int, salt: int) -> list[int]:
        return [(7 * i + salt) % vocab for i in range(max(1, min(n, room)))]

    for k, n in enumerate(prompt_tokens):
        engine.generate([prompt(n, k)], new_tokens)
    b = max(1, min(batch, engine.kv.max_seqs))
    engine.generate([prompt(min(prompt_tokens), 100 + i) for i in range(b)], new_tokens)
    return {"prefill": meter.prefill_samples - before[0],
            "decode": meter.decode_samples - before[1]}
