"""agent/speed.py: the replica speed model shared by replica, front door, predictor, simulator."""

import dataclasses
import json
import math

import pytest

from agent.errors import ConfigError
from agent.speed import (DEFAULT_ITL_SLO_S, MAX_PREFILL_TOKENS_PER_S, MAX_PROFILE_S,
                         MIN_PREFILL_BUDGET_TOKENS, MIN_PREFILL_TOKENS_PER_S, SPEED_META_KEYS,
                         SpeedProfile, plan_prefill_call)

P = SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.01, decode_base_s=0.02,
                 decode_per_seq_s=0.001, decode_per_ctx_token_s=1e-6)


def test_prefill_and_decode_follow_the_linear_model():
    assert P.prefill_s(500) == pytest.approx(0.01 + 0.5)
    assert P.decode_step_s(0) == 0.0
    assert P.decode_step_s(1) == pytest.approx(0.02)
    assert P.decode_step_s(5, 10_000) == pytest.approx(0.02 + 0.004 + 0.01)


def test_predicted_ttft_counts_step_in_progress_queue_and_own_prefill():
    idle = P.predict_ttft_s(100)
    assert idle == pytest.approx(0.01 + 0.1)
    busy = P.predict_ttft_s(100, active_seqs=4, active_ctx_tokens=2000, waiting_seqs=2,
                            queued_prefill_tokens=1000)
    assert busy == pytest.approx(P.decode_step_s(4, 2000) + 2 * 0.01 + 1.0 + 0.11)
    assert busy > idle


def test_sustainable_concurrency_shrinks_with_a_tighter_slo():
    loose = P.sustainable_concurrency(2.0, 200, 100, max_seqs=64)
    tight = P.sustainable_concurrency(0.3, 200, 100, max_seqs=64)
    assert 1 <= tight < loose <= 64
    assert P.sustainable_concurrency(1e-9, 200, 100, max_seqs=64) == 1
    assert P.service_rps(200, 100, loose) > P.service_rps(200, 100, 1)


def test_meta_round_trip_and_missing_or_bad_values():
    assert SpeedProfile.from_meta(P.to_meta()) == P
    assert set(P.to_meta()) == set(SPEED_META_KEYS)
    meta = P.to_meta()
    del meta["decode_base_s"]
    assert SpeedProfile.from_meta(meta) is None
    assert SpeedProfile.from_meta({**P.to_meta(), "prefill_tokens_per_s": "nan"}) is None
    assert SpeedProfile.from_meta({**P.to_meta(), "decode_base_s": "x"}) is None


@pytest.mark.parametrize("field,value", [("prefill_tokens_per_s", 0.0), ("decode_base_s", 0.0),
                                         ("decode_per_seq_s", -1.0), ("prefill_overhead_s", math.inf),
                                         ("decode_per_ctx_token_s", True)])
def test_bad_profile_is_a_config_error_naming_the_field(field, value):
    kwargs = {f: getattr(P, f) for f in SPEED_META_KEYS}
    kwargs[field] = value
    with pytest.raises(ConfigError, match=field):
        SpeedProfile(**kwargs)


def test_slot_wait_and_decode_rate():
    base = P.predict_ttft_s(100, active_seqs=4, active_ctx_tokens=2000)
    waited = P.predict_ttft_s(100, active_seqs=4, active_ctx_tokens=2000, slot_wait_steps=10)
    assert waited - base == pytest.approx(10 * P.decode_step_s(4, 2000))
    assert P.decode_tokens_per_s(4, 2000) == pytest.approx(1 / P.decode_step_s(4, 2000))
    assert P.decode_tokens_per_s(0) == pytest.approx(1 / P.decode_base_s)


def test_profile_file_round_trip_and_typed_refusals(tmp_path):
    import json

    from agent.speed import PROFILE_SCHEMA

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "speed": P.to_dict()}))
    assert SpeedProfile.from_file(path) == P
    cases = {
        "schema": {"schema": "other/9", "speed": P.to_dict()},
        "speed": {"schema": PROFILE_SCHEMA, "speed": [1, 2]},
        "decode_base_s": {"schema": PROFILE_SCHEMA, "speed": {**P.to_dict(), "decode_base_s": -1}},
    }
    for name, data in cases.items():
        path.write_text(json.dumps(data))
        with pytest.raises(ConfigError) as err:
            SpeedProfile.from_file(path)
        assert err.value.name == name and str(path) in err.value.message
    missing = {k: v for k, v in P.to_dict().items() if k != "prefill_overhead_s"}
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "speed": missing}))
    with pytest.raises(ConfigError, match="prefill_overhead_s"):
        SpeedProfile.from_file(path)
    path.write_bytes(b"\xff not json")
    with pytest.raises(ConfigError, match="cannot read"):
        SpeedProfile.from_file(path)
    with pytest.raises(ConfigError, match="cannot read"):
        SpeedProfile.from_file(tmp_path / "absent.json")


# --- the step: the prefill budget, its calls, and the TTFT on that schedule ----------------

C = dataclasses.replace(P, itl_target_s=0.2)     # P with the default ITL target


def test_budget_fills_the_itl_target_beside_the_decode_and_keeps_its_floor():
    assert P.prefill_budget_tokens(4, 2000) is None          # no target: whole prompts
    # (0.2 - decode(4, 2000) - 0.01) * 1000 = (0.2 - 0.025 - 0.01) * 1000
    assert C.prefill_budget_tokens(4, 2000) == 165
    assert C.prefill_budget_tokens(0) == 190
    # a decode that fills the target leaves the floor: 16 tokens, or one call's overhead
    assert C.prefill_budget_tokens(500) == MIN_PREFILL_BUDGET_TOKENS == C.budget_floor_tokens()
    costly = dataclasses.replace(C, prefill_overhead_s=0.05)   # 50 tokens of overhead
    assert costly.budget_floor_tokens() == 50 == costly.prefill_budget_tokens(500)


def test_a_further_call_in_a_step_pays_its_overhead_and_needs_the_floor():
    assert C.call_overhead_tokens() == 10                  # 0.01 s at 1000 tokens/s
    assert C.call_budget_tokens(156, 0) == 156             # the step's first call: all of it
    assert C.call_budget_tokens(56, 1) == 46
    assert C.call_budget_tokens(26, 1) == 16               # exactly the floor
    assert C.call_budget_tokens(25, 2) == 0                # under it: the step's prefill ends
    assert C.call_budget_tokens(-3, 0) == 0


def test_plan_keeps_the_oldest_first_and_shares_a_call_only_when_cheaper():
    room = [512] * 4
    # the oldest cut by the budget (or the longest row the forward takes): alone
    assert plan_prefill_call([300, 5], room[:2], 100, 256, 10) == [100]
    assert plan_prefill_call([300], room[:1], 400, 256, 10) == [256]
    # the oldest ends: equal short prompts share its call while [k, L] fits the budget
    assert plan_prefill_call([12, 12, 12, 12], room, 40, 256, 10) == [12, 12, 12]
    # a longer one joins (the shorter rows padded) while the padding stays under the
    # overhead of the calls it saves: 8 + 3 <= 2 * 10, then 8 + 3 + 9 + 1 > 3 * 10
    assert plan_prefill_call([12, 20, 17, 29], room, 200, 256, 10) == [12, 20, 17]
    # never past a younger one: the first that cannot join ends the call
    assert plan_prefill_call([10, 40, 10], room[:3], 200, 256, 10) == [10]
    # a padded row may not run past its slot
    assert plan_prefill_call([10, 8], [512, 9], 200, 256, 10) == [10]
    assert plan_prefill_call([], [], 100, 256, 10) == []
    assert plan_prefill_call([7], [7], 1, 256, 10) == [1]  # a budget of one: one token


def test_one_step_of_chunked_prefill_predicts_as_no_budget():
    kw = dict(active_seqs=0, waiting_seqs=2, queued_prefill_tokens=60)
    assert C.predict_ttft_s(20, **kw) == pytest.approx(P.predict_ttft_s(20, **kw))
    assert C.predict_ttft_s(20, **kw) == pytest.approx(3 * 0.01 + 0.08)


def test_chunked_prediction_counts_the_steps_and_the_decodes_between_them():
    # 4 waiting with 800 tokens, 2 running over 600 cached: the batch averages 2 + 4/2 = 4
    # over 600 + 400 cached, so each step holds (0.2 - 0.024 - 0.01) * 1000 = 166 tokens:
    # 800 + 200 + 4 * 10 overheads take ceil(1040 / 166) = 7 steps, 7 + 4 calls, 6 decodes
    kw = dict(active_seqs=2, active_ctx_tokens=600, waiting_seqs=4, queued_prefill_tokens=800)
    dec = C.decode_step_s(4, 1000)
    assert C.prefill_budget_tokens(4, 1000) == 166
    want = C.decode_step_s(2, 600) + 11 * 0.01 + 1.0 + 6 * dec
    assert C.predict_ttft_s(200, **kw) == pytest.approx(want)
    assert C.predict_ttft_s(200, **kw) > P.predict_ttft_s(200, **kw)
    # the same through prefill_wait_s (the router's inlined call)
    assert C.prefill_wait_s(200, waiting_seqs=4, queued_prefill_tokens=800, active_seqs=2,
                            active_ctx_tokens=600) == pytest.approx(want - C.decode_step_s(2, 600))


def test_the_itl_target_travels_and_defaults_to_none():
    assert C.to_meta()["itl_target_s"] == "0.2" and set(C.to_meta()) == set(SPEED_META_KEYS)
    assert SpeedProfile.from_meta(C.to_meta()) == C
    old = {k: v for k, v in C.to_meta().items() if k != "itl_target_s"}
    assert SpeedProfile.from_meta(old) == P                 # a report without it: no budget
    assert SpeedProfile.from_meta({**C.to_meta(), "itl_target_s": "-1"}) is None
    with pytest.raises(ConfigError, match="itl_target_s"):
        dataclasses.replace(C, itl_target_s=math.nan)
    assert DEFAULT_ITL_SLO_S == 0.2


@pytest.mark.parametrize("running", [0, 2])
@pytest.mark.parametrize("prompt", [16, 128, 400])
def test_prediction_against_the_engines_schedule(running, prompt):
    """Bursts replayed on the engine's schedule (agent/sim/replica.py, held equal to the
    engine's by tests/sim/test_replica.py): each request predicted as it is submitted, behind
    the ones before it.  Every prediction is within one ITL target of its first token (rows
    that arrive after it may join its last call; a shared call saves the overheads counted
    for it); the newest of a burst of prompts longer than a step's budget (nothing joins them)
    within 4 % and never under."""
    from agent.sim.replica import SimReplica

    profile = SpeedProfile(prefill_tokens_per_s=550.0, prefill_overhead_s=0.02,
                           decode_base_s=0.0066, decode_per_seq_s=0.0024,
                           decode_per_ctx_token_s=7e-6)
    for burst in (1, 4, 6):
        rep = SimReplica(profile, max_seqs=8, max_seq_len=512)
        t = 0.0
        for r in range(running):
            rep.submit(100 + r, 32, 300)
        while len(rep._active) < running:
            t = rep.start_step(t)[1]
            rep.end_step()
        predicted, start, first = {}, t, {}
        for i in range(burst):
            predicted[i] = rep.predict_ttft_s(prompt)
            rep.submit(i, prompt, 40)
        while len(first) < burst:
            firsts, t = rep.start_step(t)
            rep.end_step()
            first.update({r: s - start for r, s in firsts if r < 100})
        for i in range(burst):
            assert abs(predicted[i] - first[i]) <= 0.2, (burst, i, predicted[i], first[i])
        if prompt > rep.reported.prefill_budget_tokens(0):
            last = burst - 1
            assert predicted[last] == pytest.approx(first[last], rel=0.04)


@pytest.mark.parametrize("field,at,over", [
    ("prefill_tokens_per_s", MAX_PREFILL_TOKENS_PER_S, MAX_PREFILL_TOKENS_PER_S * 1.0001),
    ("prefill_tokens_per_s", MIN_PREFILL_TOKENS_PER_S, MIN_PREFILL_TOKENS_PER_S * 0.9999),
    ("prefill_overhead_s", MAX_PROFILE_S, MAX_PROFILE_S * 1.0001),
    ("decode_base_s", MAX_PROFILE_S, MAX_PROFILE_S * 1.0001),
    ("decode_per_seq_s", MAX_PROFILE_S, MAX_PROFILE_S * 1.0001),
    ("decode_per_ctx_token_s", MAX_PROFILE_S, MAX_PROFILE_S * 1.0001),
    ("itl_target_s", MAX_PROFILE_S, MAX_PROFILE_S * 1.0001),
])
def test_a_reported_profile_is_read_within_its_limits(field, at, over, tmp_path):
    """A load report or profile file states each rate within the limits, at them too; just
    past one, the report reads as not measured (None) and the file is a ConfigError naming
    the field, the value and the limit."""
    from agent.speed import PROFILE_SCHEMA

    meta = {**P.to_meta(), field: repr(at)}
    assert getattr(SpeedProfile.from_meta(meta), field) == at
    assert SpeedProfile.from_meta({**meta, field: repr(over)}) is None
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"schema": PROFILE_SCHEMA, "speed": {**P.to_dict(), field: over}}))
    with pytest.raises(ConfigError) as err:
        SpeedProfile.from_file(path)
    assert (err.value.name, err.value.value) == (field, over) and field in str(err.value)


def test_a_report_at_the_limits_predicts_without_raising():
    """The arithmetic the router, admission and the predictor run on a report at every limit
    at once stays finite where it is turned into integers (a report of 1e308 tokens/s with a
    10 s call overhead raised OverflowError on every request of its model)."""
    worst = SpeedProfile(MAX_PREFILL_TOKENS_PER_S, MAX_PROFILE_S, MAX_PROFILE_S, MAX_PROFILE_S,
                         MAX_PROFILE_S, MAX_PROFILE_S)
    slowest = SpeedProfile(MIN_PREFILL_TOKENS_PER_S, MAX_PROFILE_S, MAX_PROFILE_S,
                           MAX_PROFILE_S, MAX_PROFILE_S, MAX_PROFILE_S)
    for p in (worst, slowest):
        assert p.predict_ttft_s(4096, active_seqs=64, active_ctx_tokens=1 << 20,
                                waiting_seqs=1 << 10, queued_prefill_tokens=1 << 22) > 0
        assert p.prefill_budget_tokens(64, 1 << 20) >= MIN_PREFILL_BUDGET_TOKENS
        assert 1 <= p.sustainable_concurrency(2.0, 1000, 100, 64) <= 64
        assert 0 < p.service_rps(1000, 100, 8) < math.inf
