"""The node agent publishes a replica's measured speed and queue (agent/speed.py's keys) in the
``rewarm-replica`` registry meta as decimal strings, beside its load, and keeps them current."""

from agent.node.state import load_meta, load_report
from agent.speed import QUEUE_META_KEYS, SPEED_META_KEYS, SpeedProfile


def test_replica_meta_carries_speed_and_queue_and_follows_the_replica(make_agent):
    agent = make_agent()
    info = agent.restore("tiny")
    (inst,) = agent.registrar.registry.healthy("rewarm-replica", "model=tiny")
    for key in QUEUE_META_KEYS:
        assert inst.meta[key] == "0"
    handle = agent.replicas[info["replica"]].handle
    assert SpeedProfile.from_meta(inst.meta) == handle.loaded.engine.profile()  # with its ITL target
    handle.loaded.engine.submit([1, 2, 3], 4)         # one request waits at the replica
    agent.tick()
    agent.registrar.sync(force=True)
    (inst,) = agent.registrar.registry.healthy("rewarm-replica", "model=tiny")
    assert (inst.meta["waiting_seqs"], inst.meta["queued_prefill_tokens"]) == ("1", "3")
    agent.captures[agent.models["tiny"].key].result(timeout=120)


def test_load_report_leaves_out_a_partial_or_missing_speed():
    stats = {"max_seqs": 4, "active_seqs": 1, "kv_capacity_tokens": 100, "kv_used_tokens": 9,
             "waiting_seqs": 2, "prefill_tokens_per_s": 10.0}
    assert load_report(stats) == {"max_seqs": 4, "active_seqs": 1, "kv_capacity_tokens": 100,
                                   "kv_used_tokens": 9, "waiting_seqs": 2}
    full = {**stats, **{k: 0.5 for k in SPEED_META_KEYS}}
    meta = load_meta(full)
    assert meta["decode_base_s"] == "0.5" and meta["max_seqs"] == "4"
    assert SpeedProfile.from_meta(meta) == SpeedProfile(**{k: 0.5 for k in SPEED_META_KEYS})
