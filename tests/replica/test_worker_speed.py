"""The replica reports its speed and queue, and refuses (429) what it cannot start in time."""

import asyncio
import dataclasses

import pytest

from agent.protocol import Decoder, pack
from agent.replica import zygote
from agent.replica.engine import Engine
from agent.replica.speedmeter import SpeedMeter
from agent.replica.synthetic import make_synthetic
from agent.replica.worker import Worker
from agent.snapshot.reader import read_manifest
from agent.speed import QUEUE_META_KEYS, SPEED_META_KEYS, SpeedProfile

SLOW = SpeedProfile(prefill_tokens_per_s=100.0, prefill_overhead_s=0.05, decode_base_s=0.2,
                    decode_per_seq_s=0.01, decode_per_ctx_token_s=0.0)


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    model_dir = make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=5)
    return zygote.boot(model_dir, max_seqs=4, max_seq_len=64)


def with_meter(booted, meter: SpeedMeter):
    """The booted model in a fresh engine whose speed meter is ``meter``."""
    engine = Engine(booted.config, booted.weights, max_seqs=4, max_seq_len=64, meter=meter)
    return dataclasses.replace(booted, engine=engine)


async def _session(worker, messages):
    ready = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
    host, port = (await asyncio.wait_for(ready, 10)).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"".join(pack(m) for m in messages))
    pending, answers, decoder = {m["id"] for m in messages}, {}, Decoder()
    while pending:
        data = await asyncio.wait_for(reader.read(65536), 60)
        assert data
        for a in decoder.feed(data):
            answers.setdefault(a["id"], []).append(a)
            if a["type"] in ("done", "error", "result"):
                pending.discard(a["id"])
    writer.write(pack({"op": "shutdown", "id": "bye"}))
    await asyncio.wait_for(serving, 30)
    writer.close()
    return answers


def test_boot_measures_and_stats_carry_speed_and_queue(booted):
    assert "profile_s" in booted.phases_s and booted.engine.meter.measured
    stats = Worker(booted).stats()
    assert set(SPEED_META_KEYS) | set(QUEUE_META_KEYS) <= set(stats)
    assert (stats["waiting_seqs"], stats["queued_prefill_tokens"], stats["active_ctx_tokens"]) \
        == (0, 0, 0)
    profile = SpeedProfile.from_meta({k: str(stats[k]) for k in SPEED_META_KEYS})
    assert profile == booted.engine.profile()      # the meter's fit with the ITL target
    assert stats["decode_tokens_per_s_per_seq"] == pytest.approx(1 / profile.decode_base_s)


def test_unmeasured_replica_reports_no_speed_but_its_queue(booted):
    stats = Worker(with_meter(booted, SpeedMeter())).stats()
    assert not set(SPEED_META_KEYS) & set(stats)
    assert "decode_tokens_per_s_per_seq" not in stats
    assert set(QUEUE_META_KEYS) <= set(stats)


def test_pending_requests_count_in_the_queue_and_the_prediction(booted):
    worker = Worker(with_meter(booted, SpeedMeter(SLOW, measured_prior=True)))
    idle = worker.predict_ttft_s(10)
    assert idle == pytest.approx(SLOW.prefill_s(10))
    worker._submits.append((None, {"prompt": [1] * 20}))      # accepted, not yet submitted
    stats = worker.stats()
    assert (stats["waiting_seqs"], stats["queued_prefill_tokens"]) == (1, 20)
    # computable from the report alone, as the front door does
    from_report = SpeedProfile.from_meta(stats).predict_ttft_s(
        10, active_seqs=stats["active_seqs"], active_ctx_tokens=stats["active_ctx_tokens"],
        waiting_seqs=stats["waiting_seqs"], queued_prefill_tokens=stats["queued_prefill_tokens"])
    assert worker.predict_ttft_s(10) == pytest.approx(from_report)
    # SLOW's 0.2 s decode fills the 0.2 s ITL target: each step holds the budget's floor (16
    # tokens), so the 30, with the 5 tokens of the call where the queued prompt ends, take
    # three steps: four calls, and two decodes of the half-joined batch between (agent/speed.py)
    chunked = dataclasses.replace(SLOW, itl_target_s=0.2)
    assert chunked.prefill_budget_tokens(0.5, 10) == 16
    assert from_report == pytest.approx(4 * 0.05 + 30 / 100 + 2 * chunked.decode_step_s(0.5, 10))
    loaded = with_meter(booted, SpeedMeter(SLOW, measured_prior=True))
    loaded.engine.itl_target_s = 0.0                        # no budget: each prompt whole
    worker = Worker(loaded)
    worker._submits.append((None, {"prompt": [1] * 20}))
    assert worker.predict_ttft_s(10) == pytest.approx(SLOW.prefill_s(20) + SLOW.prefill_s(10))


def test_late_request_is_refused_with_the_prediction_and_on_time_one_served(booted):
    worker = Worker(with_meter(booted, SpeedMeter(SLOW, measured_prior=True)), replica_id="r9")
    want_ms = SLOW.prefill_s(10) * 1e3                       # 150 ms on an idle replica
    answers = asyncio.run(_session(worker, [
        {"op": "generate", "id": "late", "tokens": list(range(1, 11)), "max_tokens": 2,
         "deadline_ms": 100},
        {"op": "generate", "id": "bad", "tokens": [1, 2], "max_tokens": 2, "deadline_ms": -5},
        {"op": "generate", "id": "ok", "tokens": list(range(1, 11)), "max_tokens": 2,
         "deadline_ms": 10_000},
        {"op": "generate", "id": "none", "tokens": [3, 4], "max_tokens": 2}]))
    (late,) = answers["late"]
    assert late["type"] == "error" and late["code"] == 429
    assert late["refusal"] == "deadline_unreachable"
    assert late["predicted_ttft_ms"] == pytest.approx(want_ms)
    assert late["deadline_ms"] == 100 and late["retry_after_ms"] == round(want_ms - 100)
    assert "r9" in late["reason"] and "150.0 ms" in late["reason"] and "100" in late["reason"]
    assert answers["bad"][0]["code"] == 400 and "deadline_ms" in answers["bad"][0]["reason"]
    assert answers["ok"][-1]["type"] == "done" and answers["ok"][-1]["n_tokens"] == 2
    assert answers["none"][-1]["type"] == "done"


def test_capture_records_the_measured_speed_and_restore_starts_from_it(booted, tmp_path):
    manifest = zygote.capture(booted, tmp_path / "snap")
    recorded = manifest.extra["speed_profile"]
    assert SpeedProfile.from_meta(recorded) == booted.engine.meter.profile()
    restored = zygote.restore(tmp_path / "snap")
    assert "profile_s" not in restored.phases_s           # no boot profile: the prior is there
    assert restored.engine.meter.measured and restored.engine.meter.measured_prior
    assert read_manifest(tmp_path / "snap").extra["speed_profile"] == recorded


def test_snapshot_without_a_recorded_speed_restores_with_a_short_profile(booted, tmp_path):
    unmeasured = with_meter(booted, SpeedMeter())
    manifest = zygote.capture(unmeasured, tmp_path / "snap")
    assert "speed_profile" not in manifest.extra          # nothing measured, nothing recorded
    restored = zygote.restore(tmp_path / "snap")
    assert "profile_s" in restored.phases_s and restored.engine.meter.measured
    assert not restored.engine.meter.measured_prior


@pytest.mark.parametrize("itl_target_s, want", [
    (0.0, ["prefill", ("first", "a"), "prefill", ("first", "b"), "prefill", ("first", "c")]),
    (0.2, ["prefill", ("first", "a"), ("first", "b"), ("first", "c")])])
def test_each_first_token_is_sent_once_its_own_prefill_is_done(booted, itl_target_s, want):
    """Three prompts arrive in one tick: each one's first token leaves as soon as the call
    that ends its prefill returns (its TTFT is the calls ahead of it and its own, as
    agent/speed.py predicts), not after every call of the step.  Without a budget each
    prompt is its own call; with one, the three 5-token prompts share a [3, 5] call."""
    loaded = with_meter(booted, SpeedMeter(SLOW, measured_prior=True))
    loaded.engine.itl_target_s = itl_target_s
    engine, log = loaded.engine, []
    forward = engine.forward

    def logged_forward(tokens, input_pos, idx, k, v, logit_pos):
        if tokens.shape[1] > 1:                      # S > 1: a prefill (decode has S = 1)
            log.append(("prefill", len(log)))
        return forward(tokens, input_pos, idx, k, v, logit_pos)
    engine.forward = logged_forward
    worker = Worker(loaded)
    send = worker.batch.send

    def logged_send(writer, message):
        if message.get("type") == "tokens" and "prompt_tokens" in message:
            log.append(("first", message["id"]))
        send(writer, message)
    worker.batch.send = logged_send
    answers = asyncio.run(_session(worker, [
        {"op": "generate", "id": i, "tokens": list(range(1, 6)), "max_tokens": 2}
        for i in ("a", "b", "c")]))
    assert all(answers[i][-1]["type"] == "done" for i in ("a", "b", "c"))
    kinds = [entry[0] if entry[0] == "prefill" else entry for entry in log]
    assert kinds == want
