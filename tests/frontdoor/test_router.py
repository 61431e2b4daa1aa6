import pytest

from agent.cluster.base import ServiceInstance
from agent.frontdoor.router import ReplicaLoad, Router


def load(rid, model="m", max_seqs=4, active=0, cap=1000, used=0):
    return ReplicaLoad(rid, model, "127.0.0.1:1", max_seqs, active, cap, used)


def test_most_headroom_that_fits_wins():
    r = Router()
    r.upsert(load("a", used=800))   # headroom 200
    r.upsert(load("b", used=300))   # headroom 700
    r.upsert(load("c", cap=5000, used=0, max_seqs=1, active=1))  # no free sequence slot
    r.upsert(load("x", model="other", used=0))
    assert r.choose("m", 100).replica_id == "b"
    assert r.choose("m", 700).replica_id == "b"
    assert r.choose("m", 701) is None
    assert r.choose("nope", 1) is None


def test_dispatch_and_completion_move_the_choice():
    r = Router()
    r.upsert(load("a", used=0))
    r.upsert(load("b", used=100))
    r.on_dispatch("a", 300)
    assert r.get("a").kv_used_tokens == 300 and r.get("a").active_seqs == 1
    assert r.choose("m", 10).replica_id == "b"
    r.on_complete("a", 300)
    assert r.choose("m", 10).replica_id == "a"
    r.remove("a")
    assert [x.replica_id for x in r.warm("m")] == ["b"]


def test_ties_are_deterministic():
    r = Router()
    for rid in ("z", "k", "q"):
        r.upsert(load(rid))
    assert r.choose("m", 1).replica_id == "k"


def test_from_instance_reads_tag_and_meta():
    inst = ServiceInstance("rewarm-replica", "r9", "10.0.0.2", 7001, tags=["model=llama"],
                           meta={"max_seqs": "8", "active_seqs": "2",
                                 "kv_capacity_tokens": "4096", "kv_used_tokens": "96"})
    got = ReplicaLoad.from_instance(inst)
    assert (got.model, got.address, got.headroom_tokens) == ("llama", "10.0.0.2:7001", 4000)
    inst.meta["max_seqs"] = "eight"
    with pytest.raises(ValueError, match="max_seqs"):
        ReplicaLoad.from_instance(inst)


def test_from_instance_accepts_the_unix_prefix_the_node_agent_publishes():
    meta = {"max_seqs": "8", "active_seqs": "0", "kv_capacity_tokens": "4096",
            "kv_used_tokens": "0"}
    inst = ServiceInstance("rewarm-replica", "r1", "unix:/run/r1.sock", 0, tags=["model=m"],
                           meta={**meta, "address": "unix:/run/r1.sock"})
    assert ReplicaLoad.from_instance(inst).address == "/run/r1.sock"
    bare = ServiceInstance("rewarm-replica", "r2", "", 0, tags=["model=m"],
                           meta={**meta, "address": "/run/r2.sock"})
    assert ReplicaLoad.from_instance(bare).address == "/run/r2.sock"


def test_measured_slowdown_is_the_p99_ratio_kept_across_reports_and_never_below_one():
    from agent.frontdoor.router import SLOWDOWN_WINDOW, ReplicaLoad, Router
    from agent.speed import SpeedProfile

    speed = SpeedProfile(prefill_tokens_per_s=100.0, prefill_overhead_s=0.0,
                         decode_base_s=0.1, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0)
    load = ReplicaLoad("r", "m", "h:1", 4, 0, 1000, 0, speed=speed)
    router = Router()
    router.upsert(load)
    assert load.predict_ttft_s(100, speed) == 1.0
    load.observe_ttft(0.9, 0.4)                 # faster than predicted: stays 1
    assert load.slowdown == 1.0
    load.observe_ttft(0.9, 1.9)                 # (1.9 + 0.1) / (0.9 + 0.1): twice as slow, once
    assert load.slowdown == 1.0                 # one request in a hundred may be (the p99)
    load.observe_ttft(0.9, 1.9)                 # twice: the replica is slower
    assert load.slowdown == 2.0
    assert load.predict_ttft_s(100, speed) == 2.0
    load.observe_ttft(1.8, 1.9, slowdown_then=2.0)   # its prediction already had the 2x
    assert load.slowdown == 2.0 and load.ratios[-1] == 2.0
    for bad in (float("nan"), float("inf"), -1.0):
        load.observe_ttft(bad, 1.0)
        load.observe_ttft(1.0, bad)
    assert len(load.ratios) == 4
    fresh = ReplicaLoad("r", "m", "h:1", 4, 0, 1000, 0, speed=speed)
    router.upsert(fresh)                         # a new load report keeps the measurement
    assert fresh.slowdown == 2.0
    for _ in range(SLOWDOWN_WINDOW):             # a window of on-time first tokens later
        fresh.observe_ttft(1.0, 1.0)
    assert fresh.slowdown == 1.0


def test_one_slow_first_token_in_a_window_is_not_the_replicas_speed():
    from agent.frontdoor.router import SLOWDOWN_WINDOW, ReplicaLoad
    from agent.speed import SpeedProfile

    speed = SpeedProfile(prefill_tokens_per_s=500.0, prefill_overhead_s=0.02,
                         decode_base_s=0.012, decode_per_seq_s=0.001, decode_per_ctx_token_s=0.0)
    load = ReplicaLoad("r", "m", "h:1", 8, 0, 4096, 0, speed=speed)
    load.observe_ttft(0.034, 0.497)              # its first request paid one-off costs: 11x
    assert load.slowdown == 1.0
    assert load.predict_ttft_s(511, speed) < 1.1   # a long prompt is still predicted at speed
    for _ in range(SLOWDOWN_WINDOW - 2):
        load.observe_ttft(0.1, 0.1)
    load.observe_ttft(0.1, 0.5)                  # a second slow one in the same window
    assert load.slowdown > 3.0                   # two in a hundred: past the p99


def test_a_new_replica_starts_at_its_models_measured_slowdown():
    from agent.speed import SpeedProfile

    speed = SpeedProfile(prefill_tokens_per_s=100.0, prefill_overhead_s=0.0,
                         decode_base_s=0.1, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0)
    router = Router()
    a = ReplicaLoad("a", "m", "h:1", 4, 0, 1000, 0, speed=speed)
    router.upsert(a)
    a.observe_ttft(0.9, 2.9)                        # 3x slower than predicted, twice
    a.observe_ttft(0.9, 2.9)
    router.upsert(b := ReplicaLoad("b", "m", "h:2", 4, 0, 1000, 0, speed=speed))
    router.upsert(other := ReplicaLoad("c", "n", "h:3", 4, 0, 1000, 0, speed=speed))
    assert (b.slowdown, other.slowdown) == (3.0, 1.0)   # its model's, not another's
    b.observe_ttft(1.0, 1.0)                        # one on-time token of its own: not yet
    assert b.slowdown == 3.0
    b.observe_ttft(1.0, 1.0)                        # two: its own window replaces it
    assert b.slowdown == 1.0
    router.remove("a")
    router.remove("b")
    router.upsert(d := ReplicaLoad("d", "m", "h:4", 4, 0, 1000, 0, speed=speed))
    assert d.slowdown == 1.0                        # the last one removed said 1.0


def test_sustained_rate_is_the_measured_one_converted_else_the_profiles():
    from agent.speed import SpeedProfile
    from agent.throughput import BacklogCapacity

    speed = SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.01,
                         decode_base_s=0.02, decode_per_seq_s=0.002, decode_per_ctx_token_s=0.0)
    measured = BacklogCapacity(rps=12.0, seconds=8.0, batch=4.0, prompt_tokens=20.0,
                               gen_tokens=2.0)
    r = Router()
    fresh = load("a")
    fresh.speed = speed
    r.upsert(fresh)
    # nothing measured yet: the profile's service rate at the batch asked (within its slots)
    assert r.sustained_rps(fresh, 20, 2, 8) == pytest.approx(speed.service_rps(20, 2, 4))
    assert r.new_replica_rps("m", 20, 2, 4) == pytest.approx(r.held_prior("m").service_rps(20, 2, 4))
    assert r.model_capacity("m") is None
    saturated = load("b")
    saturated.speed, saturated.backlog = speed, measured
    r.upsert(saturated)
    assert r.sustained_rps(saturated, 20, 2, 8) == pytest.approx(12.0)
    # a replica that has not been saturated itself takes its model's measured capacity
    assert r.sustained_rps(fresh, 20, 2, 8) == pytest.approx(12.0)
    assert r.new_replica_rps("m", 20, 2, 4) == pytest.approx(12.0)
    ratio = speed.service_s(20, 2, 4) / speed.service_s(200, 2, 4)
    assert r.sustained_rps(saturated, 200, 2, 8) == pytest.approx(12.0 * ratio)
    r.remove("b")          # kept for the model after its replica is gone
    assert r.model_capacity("m") == measured


def test_load_reports_carry_the_sustained_capacity():
    meta = {"max_seqs": "4", "active_seqs": "0", "kv_capacity_tokens": "1000",
            "kv_used_tokens": "0"}
    assert ReplicaLoad.from_meta("r", "m", "a:1", meta).backlog is None
    measured = {"backlog_rps": "7.5", "backlog_s": "30.0", "backlog_batch": "6.0",
                "backlog_prompt_tokens": "9.0", "backlog_gen_tokens": "1.0"}
    got = ReplicaLoad.from_meta("r", "m", "a:1", {**meta, **measured}).backlog
    assert got is not None and got.rps == 7.5 and got.batch == 6.0
    bad = ReplicaLoad.from_meta("r", "m", "a:1", {**meta, **measured, "backlog_s": "-1"})
    assert bad.backlog is None      # a malformed measurement is none, not a guess


def test_a_queue_drains_no_slower_than_the_rate_the_replica_sustained_backlogged():
    from agent.speed import SpeedProfile
    from agent.throughput import BacklogCapacity

    speed = SpeedProfile(prefill_tokens_per_s=250.0, prefill_overhead_s=0.013,
                         decode_base_s=0.012, decode_per_seq_s=0.003, decode_per_ctx_token_s=0.0,
                         itl_target_s=0.2)
    busy = ReplicaLoad("r", "m", "a:1", 8, 8, 10_000, 100, speed=speed, waiting_seqs=8,
                       queued_prefill_tokens=72)
    model_s = busy.predict_ttft_s(9, speed)        # each queued prompt its own call: a bound
    step_s = speed.decode_step_s(8, 0)
    assert model_s == pytest.approx(step_s + speed.prefill_wait_s(
        9, waiting_seqs=8, queued_prefill_tokens=72, active_seqs=8))
    # measured: 25 requests/s backlogged (prompts sharing calls), so 8 ahead start in 0.32 s
    busy.backlog = BacklogCapacity(rps=25.0, seconds=20.0, batch=8.0, prompt_tokens=9.0,
                                   gen_tokens=1.0)
    measured_s = busy.predict_ttft_s(9, speed)
    assert measured_s == pytest.approx(step_s + 8 / 25.0 + speed.prefill_s(9))
    assert measured_s < model_s
    # a measurement slower than the model's bound never makes the prediction later
    busy.backlog = BacklogCapacity(rps=1.0, seconds=20.0, batch=8.0, prompt_tokens=9.0,
                                   gen_tokens=1.0)
    assert busy.predict_ttft_s(9, speed) == pytest.approx(model_s)
    busy.waiting_seqs = busy.queued_prefill_tokens = 0   # nothing queued: the model alone
    assert busy.predict_ttft_s(9, speed) == pytest.approx(step_s + speed.prefill_s(9))


def test_a_speed_past_the_report_limits_is_routed_on_the_prior_not_raised():
    """A replica reporting 1e308 prompt tokens/s with a 10 s call overhead (a forged or
    broken entry): its budget in tokens is infinite, and predicting a request there raised
    OverflowError on every request of its model.  Read as not measured, it is predicted with
    the model's prior, and the router still chooses among its replicas."""
    meta = {"max_seqs": "4", "active_seqs": "1", "kv_capacity_tokens": "1000",
            "kv_used_tokens": "10", "waiting_seqs": "2", "queued_prefill_tokens": "200",
            "prefill_tokens_per_s": "1e308", "prefill_overhead_s": "10", "decode_base_s": "0.01",
            "decode_per_seq_s": "0", "decode_per_ctx_token_s": "0", "itl_target_s": "0.2"}
    bad = ReplicaLoad.from_meta("bad", "m", "a:1", meta)
    assert bad.speed is None
    r = Router()
    r.upsert(bad)
    r.upsert(load("good"))
    found = r.choose_predicted("m", 10, 100)
    assert found is not None and 0 < found[1] < float("inf")
    assert bad.predict_ttft_s(100, r.prior("m")) > 0


BASE_META = {"max_seqs": "8", "active_seqs": "1", "kv_capacity_tokens": "4096",
             "kv_used_tokens": "96"}


@pytest.mark.parametrize("key", ["max_seqs", "active_seqs", "kv_capacity_tokens",
                                 "kv_used_tokens"])
def test_a_load_key_is_read_up_to_its_limit_and_refused_past_it(key):
    """A replica's slots and KV cache are read up to LOAD_META_LIMITS, at the limit too;
    just past it the entry is refused naming the key, the value and the limit, as a value
    that is not an integer is (max_seqs of 10**9 made the admission planner list a billion
    free slots for every arrival: the front door's memory, then the node's)."""
    from agent.cluster.base import LOAD_META_LIMITS

    limit = LOAD_META_LIMITS[key]
    got = ReplicaLoad.from_meta("r", "m", "a:1", {**BASE_META, key: str(limit)})
    assert getattr(got, key) == limit
    with pytest.raises(ValueError, match=key) as err:
        ReplicaLoad.from_meta("r", "m", "a:1", {**BASE_META, key: str(limit + 1)})
    assert str(limit + 1) in str(err.value) and str(limit) in str(err.value)


@pytest.mark.parametrize("key", ["waiting_seqs", "queued_prefill_tokens", "active_ctx_tokens"])
def test_a_queue_key_past_its_limit_reads_as_the_limit(key):
    """A queue past QUEUE_META_LIMITS is read at the limit (as busy as a replica can say it
    is, never an idle one); 10**300 queued sequences made every prediction there raise
    OverflowError (an integer too large for a float)."""
    from agent.speed import QUEUE_META_LIMITS

    limit = QUEUE_META_LIMITS[key]
    assert getattr(ReplicaLoad.from_meta("r", "m", "a:1", {**BASE_META, key: str(limit)}),
                   key) == limit
    for over in (str(limit + 1), "1e300", str(10 ** 300)):
        got = ReplicaLoad.from_meta("r", "m", "a:1", {**BASE_META, key: over})
        assert getattr(got, key) == limit
        assert 0 < got.predict_ttft_s(100, Router().prior("m")) < float("inf")


def test_a_refused_load_value_is_quoted_cut_to_a_line():
    """A registry entry whose max_seqs is a megabyte of digits (int() refuses it, past 4,300
    digits) is refused naming the key, with the value cut and its length given: the refusal
    is logged on every registry poll, and it used to quote the whole megabyte each time."""
    with pytest.raises(ValueError) as err:
        ReplicaLoad.from_meta("r", "m", "a:1", {**BASE_META, "max_seqs": "9" * 1_000_000})
    text = str(err.value)
    assert "'max_seqs'" in text and "(1000002 characters)" in text and len(text) < 200
