"""The replica's speed meter: it converges to a known speed (fake clock, fake forward with a
known cost model), follows a change, shrugs off one outlier, and the engine reports its queue."""

import math

import pytest
import torch

from agent.replica.config import LlamaConfig
from agent.replica.engine import Engine
from agent.replica.speedmeter import DEFAULT_PRIOR, ForgettingLeastSquares, SpeedMeter, boot_profile
from agent.speed import SPEED_META_KEYS, SpeedProfile

TRUE = SpeedProfile(prefill_tokens_per_s=800.0, prefill_overhead_s=0.004, decode_base_s=0.012,
                    decode_per_seq_s=0.0015, decode_per_ctx_token_s=2e-6)


class FakeForward:
    """A forward whose only effect is to move a fake clock by ``profile``'s cost: a prefill
    call ``[B, S]`` costs ``prefill_s(B * S)``, a decode step over B sequences
    ``decode_step_s(B, C)`` with C the sum of their positions.  Logits are zeros (greedy
    token 0).  A call is a decode while the engine it is :meth:`attach`-ed to runs
    :meth:`Engine.decode` (a one-token prefill chunk has a decode's shape); ``calls`` counts
    each kind."""

    def __init__(self, profile: SpeedProfile, vocab: int) -> None:
        self.profile, self.vocab, self.now_s = profile, vocab, 0.0
        self.calls = {"prefill": 0, "decode": 0}
        self.decoding = False

    def clock(self) -> float:
        return self.now_s

    def attach(self, engine: Engine) -> Engine:
        """Tell this forward when ``engine`` decodes (wraps its ``decode``); returns it."""
        decode = engine.decode

        def decoding():
            self.decoding = True
            try:
                return decode()
            finally:
                self.decoding = False
        engine.decode = decoding  # type: ignore[method-assign]
        return engine

    def __call__(self, tokens, input_pos, cache_batch_idx, k_caches, v_caches, logit_pos):
        b, s = tokens.shape
        if self.decoding:
            self.calls["decode"] += 1
            self.now_s += self.profile.decode_step_s(b, int(input_pos.sum()))
        else:
            self.calls["prefill"] += 1
            self.now_s += self.profile.prefill_s(b * s)
        return torch.zeros((b, logit_pos.shape[1], self.vocab))


def fake_engine(tiny_dir, profile=TRUE, **kw):
    config = LlamaConfig.from_dir(tiny_dir)
    fwd = FakeForward(profile, config.vocab_size)
    engine = Engine(config, None, max_seqs=8, max_seq_len=256, forward=fwd, clock=fwd.clock, **kw)
    return fwd.attach(engine), fwd


def serve_mixed(engine, rounds=12):
    """Batches of 1..8 prompts of 2..200 tokens, each generating 4..20 tokens."""
    for r in range(rounds):
        batch = 1 + r % 8
        prompts = [[1] * (2 + (37 * (r + i)) % 199) for i in range(batch)]
        engine.generate(prompts, 4 + (r * 5) % 17)


def assert_close(got: SpeedProfile, want: SpeedProfile, rel: float, *,
                 coefficients: bool = True) -> None:
    """Predictions within ``rel`` over the range served, and the rates within ``rel``; the small
    intercepts (a few ms under a term ten times larger) within ``rel`` of that larger term."""
    for p in (2, 50, 200):
        assert got.prefill_s(p) == pytest.approx(want.prefill_s(p), rel=rel,
                                                 abs=rel * want.prefill_s(100)), p
    for b, c in ((1, 10), (4, 400), (8, 1600)):
        assert got.decode_step_s(b, c) == pytest.approx(want.decode_step_s(b, c), rel=rel), (b, c)
    if not coefficients:
        return
    assert got.prefill_tokens_per_s == pytest.approx(want.prefill_tokens_per_s, rel=rel)
    assert got.decode_per_seq_s == pytest.approx(want.decode_per_seq_s, rel=rel)
    assert got.decode_base_s == pytest.approx(want.decode_base_s, rel=rel)
    assert got.prefill_overhead_s == pytest.approx(want.prefill_overhead_s,
                                                   abs=rel * want.prefill_s(100))
    assert got.decode_per_ctx_token_s == pytest.approx(want.decode_per_ctx_token_s,
                                                       abs=rel * want.decode_base_s / 1000)


def test_forgetting_least_squares_recovers_a_line_and_keeps_the_prior_where_unexcited():
    fit = ForgettingLeastSquares([0.0, 0.0], [1.0, 100.0], prior_weight=0.2, forget=0.98)
    for x in range(1, 200):
        fit.update([1.0, float(x % 50)], 0.5 + 0.01 * (x % 50))
    assert fit.theta() == pytest.approx([0.5, 0.01], rel=0.02)  # a prior far off: ~1 % bias
    flat = ForgettingLeastSquares([0.1, 7.0], [1.0, 1.0], prior_weight=0.2, forget=0.9)
    for _ in range(500):   # only x = [1, 0]: the slope is never seen, it stays at the prior
        flat.update([1.0, 0.0], 2.0)
    # 10 samples' worth of data (1 / (1 - 0.9)) against a prior worth 0.2 of one
    assert flat.theta()[0] == pytest.approx((10 * 2.0 + 0.2 * 0.1) / 10.2, rel=1e-3)
    assert flat.theta()[1] == pytest.approx(7.0)
    with pytest.raises(ValueError):
        ForgettingLeastSquares([0.0], [1.0], forget=0.0)


def test_meter_converges_to_the_engines_known_speed(tiny_dir):
    engine, fwd = fake_engine(tiny_dir)
    assert not engine.meter.measured           # the generic prior is never reported
    serve_mixed(engine)
    meter = engine.meter
    # one sample per call: prompts chunked under the step budget, short ones sharing a call
    assert meter.measured and meter.prefill_samples == fwd.calls["prefill"] > 12
    assert meter.decode_samples == fwd.calls["decode"]
    assert_close(meter.profile(), TRUE, rel=0.02)
    # and so predicts what it has not run: B=8 over 3,000 cached tokens
    assert meter.profile().decode_step_s(8, 3000) == pytest.approx(TRUE.decode_step_s(8, 3000),
                                                                   rel=0.02)


def test_meter_follows_a_slowdown_and_clips_one_outlier(tiny_dir):
    engine, fwd = fake_engine(tiny_dir)
    serve_mixed(engine)
    slow = SpeedProfile(**{k: getattr(TRUE, k) * (0.5 if k == "prefill_tokens_per_s" else 2.0)
                           for k in SPEED_META_KEYS})
    fwd.profile = slow                          # a neighbour took half the CPU
    serve_mixed(engine, rounds=60)
    # what it predicts has moved to the new speed (B and C rise together in this traffic, so
    # the split between per-sequence and per-context cost is the slowest part to follow)
    assert_close(engine.meter.profile(), slow, rel=0.05, coefficients=False)
    before = engine.meter.profile().decode_base_s
    engine.meter.observe_decode(1, 10, 100.0)   # one 100 s step (a pause), not a new speed
    assert engine.meter.profile().decode_base_s < 1.1 * before
    n = engine.meter.decode_samples
    engine.meter.observe_decode(1, 10, math.nan)  # a broken reading is no sample
    engine.meter.observe_decode(1, 10, -1.0)
    assert engine.meter.decode_samples == n


def test_recorded_prior_is_reported_at_once_and_boot_profile_measures(tiny_dir):
    assert SpeedMeter(TRUE, measured_prior=True).measured
    assert SpeedMeter(TRUE, measured_prior=True).profile() == TRUE
    engine, _ = fake_engine(tiny_dir)
    taken = boot_profile(engine)
    assert taken["prefill"] == 2 + 1 and taken["decode"] == 3 * 3   # the 4 short ones: one call
    assert engine.meter.measured and not engine.busy
    # three (B, C) points pin the decode model; three call sizes (16, 128 and the four short
    # prompts' 4 x 16) the prefill one, to within 5 % of a 128-token call (3 samples: the
    # ridge prior still holds the small intercept a few ms off)
    got = engine.meter.profile()
    for b, c in ((1, 18), (1, 130), (4, 70)):
        assert got.decode_step_s(b, c) == pytest.approx(TRUE.decode_step_s(b, c), rel=0.02)
    for n in (16, 64, 128):
        assert got.prefill_s(n) == pytest.approx(TRUE.prefill_s(n),
                                                 abs=0.05 * TRUE.prefill_s(128))


def test_engine_load_and_predicted_ttft_follow_the_queue(tiny_dir):
    """Without a prefill budget (itl_target_s 0): one step admits every prompt a slot takes."""
    engine, _ = fake_engine(tiny_dir, meter=SpeedMeter(TRUE, measured_prior=True),
                            itl_target_s=0.0)
    engine.meter.observe_prefill = lambda *a: None    # keep the known profile fixed
    engine.meter.observe_decode = lambda *a: None
    assert engine.predict_ttft_s(100) == pytest.approx(TRUE.prefill_s(100))
    ids = [engine.submit([1] * 50, max_tokens=5 + i) for i in range(8)]  # fills all 8 slots
    engine.submit([1] * 30, max_tokens=5)                                   # waits
    cap = engine.capacity()
    assert (cap["waiting_seqs"], cap["queued_prefill_tokens"], cap["active_ctx_tokens"]) == (9, 430, 0)
    engine.step()                 # 8 admitted (prefill + one decode), one still waiting
    load = engine.load
    assert (load.active_seqs, load.waiting_seqs, load.active_ctx_tokens) == (8, 1, 8 * 51)
    assert load.remaining_tokens == tuple(5 + i - 2 for i in range(8))
    # a new request waits for two sequences to end (the waiting one takes the first slot)
    step = TRUE.decode_step_s(8, 8 * 51)
    want = step * (1 + load.remaining_tokens[1]) + 1 * TRUE.prefill_overhead_s \
        + 30 / TRUE.prefill_tokens_per_s + TRUE.prefill_s(20)
    assert engine.predict_ttft_s(20) == pytest.approx(want)
    for i in ids:
        engine.cancel(i)
    assert engine.load.active_seqs == 0 and engine.load.waiting_seqs == 1


def test_default_prior_is_a_valid_profile():
    assert SpeedProfile.from_meta(DEFAULT_PRIOR.to_meta()) == DEFAULT_PRIOR


def test_chunked_load_counts_a_partly_prefilled_prompt_and_the_report_carries_the_target(tiny_dir):
    """With the default budget the same queue prefills over steps: a prompt part-way through
    holds its slot, counts as waiting with its tokens left, and the prediction is agent/speed.py's
    on that queue."""
    engine, _ = fake_engine(tiny_dir, meter=SpeedMeter(TRUE, measured_prior=True))
    engine.meter.observe_prefill = lambda *a: None    # keep the known profile fixed
    engine.meter.observe_decode = lambda *a: None
    for i in range(8):
        engine.submit([1] * 50, max_tokens=5 + i)
    engine.submit([1] * 30, max_tokens=5)
    profile = engine.profile()
    assert profile.itl_target_s == 0.2 and engine.begin_step() == int((0.2 - 0.004) * 800)  # 156
    engine.step()                 # [3, 50]: 150 of 156 tokens; a further call would hold < 16
    assert (engine.load.active_seqs, engine.load.waiting_seqs) == (3, 6)
    budget = profile.prefill_budget_tokens(3, 3 * 51)
    assert budget == 144
    engine.step()                 # [2, 50] then, after one call's 4 tokens of overhead, [1, 40]
    load = engine.load
    assert (load.active_seqs, load.waiting_seqs, load.queued_prefill_tokens) == \
        (5, 4, 10 + 50 + 50 + 30)
    assert engine.kv.active == 6 and engine.capacity()["active_seqs"] == 6  # the partial one's slot
    want = profile.predict_ttft_s(20, active_seqs=5, active_ctx_tokens=load.active_ctx_tokens,
                                  waiting_seqs=4, queued_prefill_tokens=140,
                                  slot_wait_steps=load.remaining_tokens[1])  # 5 for 3 free
    assert engine.predict_ttft_s(20) == pytest.approx(want)
    report = engine.speed_report()
    assert report["itl_target_s"] == 0.2 and SpeedProfile.from_meta(report) == profile
    assert report["prefill_budget_tokens"] == profile.prefill_budget_tokens(
        5, load.active_ctx_tokens)


def test_step_overrun_is_the_p99_of_the_window_and_ignores_broken_readings():
    from agent.replica.speedmeter import STEP_WINDOW

    meter = SpeedMeter(TRUE, measured_prior=True)
    meter.observe_step(0.2, 0.5)
    assert meter.step_overrun_s() == 0.0            # one step alone sets nothing
    meter.observe_step(0.2, 0.19)                   # under its plan: overrun 0
    assert meter.step_overrun_s() == 0.0            # second largest of (0.3, 0)
    for i in range(STEP_WINDOW):                    # a full window: 0.000 .. 0.099 s over
        meter.observe_step(0.1, 0.1 + i / 1000)
    assert meter.step_overrun_s() == pytest.approx(0.098)   # the second largest: p99
    for planned, elapsed in ((0.0, 1.0), (0.1, math.nan), (-1.0, 1.0), (0.1, -2.0)):
        meter.observe_step(planned, elapsed)
    assert meter.step_overrun_s() == pytest.approx(0.098)
    fresh = SpeedMeter()                            # the generic prior, nothing measured yet:
    for _ in range(3):                              # its plans say nothing of the steps
        fresh.observe_step(0.1, 0.5)
    assert fresh.step_overrun_s() == 0.0
    for _ in range(SpeedMeter.MIN_SAMPLES_TO_CLIP):
        fresh.observe_prefill(64, 0.1)
        fresh.observe_decode(1, 64, 0.01)
    fresh.observe_step(0.1, 0.13)
    fresh.observe_step(0.1, 0.13)
    assert fresh.step_overrun_s() == pytest.approx(0.03)
