"""agent/speed.py: the replica speed model shared by replica, front door, predictor, simulator."""

import math

import pytest

from agent.errors import ConfigError
from agent.speed import SPEED_META_KEYS, SpeedProfile

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
