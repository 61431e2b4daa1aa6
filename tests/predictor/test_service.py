"""PredictorService: front-door counters into the predictor, gated by the leader; the
stats client against a tiny msgpack server; the ``rewarm predictor`` command."""

import json
import logging
import socket
import threading

import pytest

from agent.clock import ManualClock
from agent.errors import ConfigError
from agent.predictor.cli import parse_model
from agent.predictor.loop import ModelPolicy, Predictor
from agent.predictor.service import PredictorService, frontdoor_stats
from agent.protocol import Decoder, pack


class Scaler:
    def __init__(self):
        self.t = {}

    def set_target(self, model, count, *, reason):
        self.t[model] = count

    def target(self, model):
        return self.t.get(model, 0)


class Leader:
    def __init__(self):
        self.leading = True

    def tick(self):
        return self.leading


def make(fetch, leader=None):
    clock = ManualClock()
    pred = Predictor([ModelPolicy("m"), ModelPolicy("n")], clock=clock, scaler=Scaler(),
                     snapshot_durable=lambda m: True)
    return PredictorService(pred, clock=clock, fetch=fetch, leader=leader), clock


def test_counters_from_two_doors_sum_and_survive_a_restart():
    feed = iter([
        {"a": {"m": 100, "n": 5}, "b": {"m": 50}},
        {"a": {"m": 110, "n": 5}, "b": {"m": 60, "other": 9}},
        {"a": {"m": 4}, "b": {"m": 70}},       # a restarted: its counter went back to 4
        {"b": {"m": 80}},                      # a is gone this second
    ])
    svc, clock = make(lambda: {door: {"arrivals": c}
                               for door, c in next(feed).items()})
    clock.advance(1)
    assert svc.sample() == {}                  # first readings only set the baseline
    clock.advance(1)
    assert svc.sample() == {"m": (20, 1.0), "n": (0, 1.0)}
    clock.advance(1)
    assert svc.sample() == {"m": (14, 1.0)}
    clock.advance(1)
    assert svc.sample() == {"m": (10, 1.0)}


def test_step_acts_only_as_leader_and_survives_a_failing_fetch():
    leader = Leader()
    state = {"v": 0}

    def fetch():
        state["v"] += 20
        if state["v"] == 60:
            raise OSError("front door unreachable")
        return {"a": {"arrivals": {"m": state["v"]}}}

    svc, clock = make(fetch, leader)
    actions = []
    for i in range(6):
        clock.advance(1)
        leader.leading = i < 4
        actions.append(svc.step()[0].action)
    assert actions[:4] == ["hold", "scale_up", "hold", "hold"]
    assert actions[4:] == ["standby", "standby"] and svc.is_leader is False


def _serve_once(answer):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def run():
        conn, _ = srv.accept()
        with conn:
            dec = Decoder()
            while True:
                msgs = dec.feed(conn.recv(4096))
                if msgs:
                    assert msgs[0]["op"] == "stats"
                    if answer is not None:
                        conn.sendall(pack({"v": 1, "id": msgs[0]["id"], **answer}))
                    return

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"127.0.0.1:{srv.getsockname()[1]}", srv, t


@pytest.mark.parametrize("answer,expect", [
    ({"type": "result", "result": {
        "requests": 9, "arrivals": {"m": 7, "x": -1, "y": True},
        "replicas": {"r1": {"model": "m", "kv_capacity_tokens": 72089},
                     "r2": {"model": "m", "kv_capacity_tokens": 36000},
                     "r3": {"model": "n", "kv_capacity_tokens": "lots"}},
        "cold": {"m": {"arrivals": 5, "misses": 2}, "n": {"arrivals": 1, "misses": 2},
                 "o": "many"}}},
     {"arrivals": {"m": 7}, "kv_capacity_tokens": {"m": 36000}, "speed": {}, "lengths": {},
      "cold": {"m": (5, 2)}, "busy": set(), "sustained": {}}),
    ({"type": "result", "result": {"requests": 9}},           # no per-model counters
     {"arrivals": {}, "kv_capacity_tokens": {}, "speed": {}, "lengths": {}, "cold": {},
      "busy": set(), "sustained": {}}),
])
def test_frontdoor_stats(answer, expect):
    addr, srv, t = _serve_once(answer)
    try:
        assert frontdoor_stats(addr) == expect
    finally:
        t.join(5)
        srv.close()


@pytest.mark.parametrize("answer,exc", [
    ({"type": "error", "code": 401, "reason": "token"}, ValueError),
    ({"type": "result", "result": {"arrivals": [1, 2]}}, ValueError),
    ({"type": "result", "result": {"replicas": "r1"}}, ValueError),
    (None, ConnectionError),                                # closed without an answer
])
def test_frontdoor_stats_failures(answer, exc):
    addr, srv, t = _serve_once(answer)
    try:
        with pytest.raises(exc):
            frontdoor_stats(addr)
    finally:
        t.join(5)
        srv.close()


def test_reported_kv_capacity_resizes_the_pool():
    svc, clock = make(lambda: {"a": {"arrivals": {"m": 20 * int(clock.now())},
                                     "kv_capacity_tokens": {"m": 36000}},
                               "b": {"kv_capacity_tokens": {"m": 72089, "zz": 5}}})
    for _ in range(40):
        clock.advance(1)
        d = svc.step()[0]
    # 36,000 / 900 = 40 sequences per replica: 140 in flight / 30 = 4.67 -> 5
    assert d.model == "m" and d.target == 5


def test_parse_model():
    assert parse_model("m") == ("m", 0, 24)
    assert parse_model("m:1:4") == ("m", 1, 4)
    for bad in ("m:1", "m:a:b"):
        with pytest.raises(ConfigError):
            parse_model(bad)


def test_cli_ticks_against_the_nomad_standin(nomad_standin, monkeypatch, capsys):
    import argparse

    from agent.predictor.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    addr, srv, t = _serve_once({"type": "result", "result": {"arrivals": {"m": 3}}})
    monkeypatch.setenv("NOMAD_ADDR", nomad_standin.url)
    try:
        args = parser.parse_args([
            "predictor", "--model", "m:1:4", "--scaler", "nomad", "--frontdoor", addr,
            "--ticks", "1", "--tick-s", "0.01", "--lead-time-s", "5", "--restore-p99-s", "1",
            "--decision-latency-s", "0.5"])
        assert args.func(args) == 0
    finally:
        t.join(5)
        srv.close()
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["model"] == "m" and line["action"] == "scale_up" and line["target"] == 1
    assert nomad_standin.job("rewarm-replica-m")["TaskGroups"][0]["Count"] == 1


def test_metrics_and_parked_expiry_follow_the_decisions():
    from prometheus_client import generate_latest

    expired = []

    class Parking(Scaler):
        def expire_parked(self, model, park_s):
            expired.append((model, park_s))

    clock = ManualClock()
    scaler = Parking()
    pred = Predictor([ModelPolicy("m")], clock=clock, scaler=scaler,
                     snapshot_durable=lambda m: True)
    count = {"v": 0}

    def fetch():
        count["v"] += 20
        return {"a": {"arrivals": {"m": count["v"]}}}

    leader = Leader()
    svc = PredictorService(pred, clock=clock, fetch=fetch, leader=leader, scaler=scaler)
    for _ in range(3):
        clock.advance(1)
        svc.step()
    text = generate_latest(svc.registry).decode()
    assert 'rewarm_predictor_actual_requests_per_second{model="m"} 20.0' in text
    assert 'rewarm_predictor_leader 1.0' in text
    assert len(expired) == 3 and expired[0][0] == "m"
    leader.leading = False
    clock.advance(1)
    svc.step()
    assert len(expired) == 3                  # a standby never stops anything
    assert 'rewarm_predictor_leader 0.0' in generate_latest(svc.registry).decode()


def test_reads_the_real_front_doors_stats():
    """Against agent/frontdoor's server: its per-model ``arrivals`` counter counts requests
    for configured models only (model names of 404s are client input and are not kept)."""
    import asyncio

    from agent.cluster.local import LocalRegistry
    from agent.frontdoor.server import FrontDoor, FrontDoorConfig

    async def main():
        fd = FrontDoor(FrontDoorConfig(registry_poll_s=0.05, models={"m": 50.0}),
                       registry=LocalRegistry())
        host, port = await fd.start()
        try:
            before = await asyncio.to_thread(frontdoor_stats, f"{host}:{port}")
            reader, writer = await asyncio.open_connection(host, port)
            for i in range(6):
                writer.write(pack({"v": 1, "op": "generate", "id": i,
                                   "model": "nope" if i < 3 else "m",
                                   "tokens": [1], "max_tokens": 1}))
            await writer.drain()
            dec, answers = Decoder(), []
            while len(answers) < 6:
                answers += dec.feed(await reader.read(4096))
            writer.close()
            after = await asyncio.to_thread(frontdoor_stats, f"{host}:{port}")
        finally:
            await fd.stop()
        return before, after, answers

    before, after, answers = asyncio.run(main())
    # the known model counted from 0 before its first request (the first reading is a baseline)
    assert before == {"arrivals": {"m": 0}, "kv_capacity_tokens": {}, "speed": {}, "lengths": {},
                      "cold": {"m": (0, 0)}, "busy": set(), "sustained": {}}
    codes = {a["id"]: a["code"] for a in answers}
    assert [codes[i] for i in range(3)] == [404, 404, 404]
    assert all(codes[i] in (503, 504) for i in range(3, 6))  # no replica can come for "m"
    assert after["arrivals"] == {"m": 3}
    assert after["cold"] == {"m": (3, 3)}   # no warm replica for any of them; none served
    # the lengths the front door saw reach the predictor, which sizes the pool for them
    assert after["lengths"] == {"m": {"mean_prompt_tokens": 1.0, "mean_gen_tokens": 1.0}}


def test_a_front_door_outage_is_logged_when_it_starts_each_minute_and_when_it_ends(caplog):
    state = {"down": True}

    def fetch():
        if state["down"]:
            raise ConnectionRefusedError("front door gone")
        return {"a": {"arrivals": {"m": 1}}}

    svc, clock = make(fetch)
    with caplog.at_level("WARNING", logger="agent.predictor.service"):
        for _ in range(90):                # 90 ticks of 1 s: at 0 s and 60 s, not 90 times
            svc.sample()
            clock.advance(1)
        state["down"] = False
        svc.sample()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3
    assert "unavailable: front door gone" in said[0] and "for 60 s" in said[1]
    assert said[2] == "predictor: front-door stats back after 90 s"


def test_ready_says_why_not_while_the_stats_cannot_be_fetched():
    up = {"ok": True}

    def fetch():
        if not up["ok"]:
            raise OSError("front door unreachable")
        return {"a": {"arrivals": {"m": 1}}}

    svc, clock = make(fetch, Leader())
    svc.step()
    assert svc.ready() == (True, "ready")              # Leader() leads by default
    up["ok"] = False
    svc.step()
    clock.advance(12)
    assert svc.ready() == (False, "front-door stats unreachable for 12 s")
    up["ok"] = True
    svc.step()
    assert svc.ready()[0] is True


def test_frontdoor_stats_reads_the_slowest_measured_speed_and_lengths():
    from agent.speed import SpeedProfile

    fast = SpeedProfile(2000.0, 0.01, 0.01, 0.001, 0.0)
    slow = SpeedProfile(500.0, 0.02, 0.04, 0.004, 0.0)
    answer = {"type": "result", "result": {
        "arrivals": {"m": 1},
        "lengths": {"m": {"mean_prompt_tokens": 40, "mean_gen_tokens": 3.5, "x": 1},
                    "n": {"mean_prompt_tokens": float("nan")}},
        "replicas": {"r1": {"model": "m", "max_seqs": 8, **fast.to_meta()},
                     "r2": {"model": "m", "max_seqs": 4, **slow.to_meta()},
                     "r3": {"model": "m", "max_seqs": 8, "prefill_tokens_per_s": "fast"}}}}
    addr, srv, t = _serve_once(answer)
    try:
        got = frontdoor_stats(addr)
    finally:
        t.join(5)
        srv.close()
    assert got["speed"] == {"m": (slow, 4)}
    assert got["lengths"] == {"m": {"mean_prompt_tokens": 40.0, "mean_gen_tokens": 3.5}}


def test_service_sizes_from_the_reported_speed():
    from agent.speed import SpeedProfile

    slow = SpeedProfile(500.0, 0.02, 0.04, 0.004, 0.0)
    clock = ManualClock()
    pred = Predictor([ModelPolicy("m")], clock=clock, scaler=Scaler(),
                     snapshot_durable=lambda m: True)
    stats = {"d": {"arrivals": {"m": 0}, "kv_capacity_tokens": {},
                   "speed": {"m": (slow, 4)},
                   "lengths": {"m": {"mean_prompt_tokens": 40.0, "mean_gen_tokens": 3.0}}}}
    svc = PredictorService(pred, clock=clock, fetch=lambda: stats)
    svc.sample()
    st = pred._models["m"]
    assert st.speed == slow and st.max_seqs == 4
    assert st.policy.mean_prompt_tokens == 40.0 and st.policy.mean_gen_tokens == 3.0
    assert st.sustained is None


def test_the_capacity_replicas_sustained_while_backlogged_reaches_the_predictor():
    from agent.frontdoor.path_info import replica_entry
    from agent.frontdoor.router import ReplicaLoad
    from agent.predictor.service import _parse_stats
    from agent.speed import SpeedProfile
    from agent.throughput import BacklogCapacity

    speed = SpeedProfile(500.0, 0.02, 0.04, 0.004, 0.0)
    fast = BacklogCapacity(rps=9.0, seconds=30.0, batch=6.0, prompt_tokens=40.0, gen_tokens=3.0)
    slow = BacklogCapacity(rps=4.0, seconds=30.0, batch=6.0, prompt_tokens=40.0, gen_tokens=3.0)
    loads = [ReplicaLoad(rid, "m", "a:1", 8, 1, 1000, 10, speed=speed, backlog=c)
             for rid, c in (("r1", fast), ("r2", slow), ("r3", None))]
    # the front door's own stats entry for each warm replica, parsed as the predictor does
    stats = {"d": _parse_stats("d", {"arrivals": {"m": 0},
                                     "replicas": {x.replica_id: replica_entry(x) for x in loads}})}
    assert stats["d"]["speed"] == {"m": (speed, 8)}
    assert stats["d"]["sustained"] == {"m": slow}      # the replica that sustained the least
    clock = ManualClock()
    pred = Predictor([ModelPolicy("m")], clock=clock, scaler=Scaler(),
                     snapshot_durable=lambda m: True)
    PredictorService(pred, clock=clock, fetch=lambda: stats).sample()
    assert pred._models["m"].sustained == slow


def test_cold_counters_feed_the_predictor_as_differences_per_door():
    feed = iter([
        {"a": {"m": (10, 1)}, "b": {"m": (3, 0)}},
        {"a": {"m": (14, 3)}, "b": {"m": (3, 0)}, "c": {"x": (9, 9)}},   # x: not a model here
        {"a": {"m": (2, 0)}, "b": {"m": (5, 0)}},      # a restarted: a new baseline, no sample
        {"a": {"m": (2, 1)}, "b": {"m": (5, 0)}},      # a miss counted after its arrival
    ])
    svc, clock = make(lambda: {door: {"arrivals": {}, "cold": c} for door, c in next(feed).items()})
    svc.sample()                                       # baselines only
    assert svc.predictor.cold_miss_fraction("m") is None
    svc.sample()
    assert svc.predictor.cold_miss_fraction("m") == pytest.approx(2 / 4)
    svc.sample()
    assert svc.predictor.cold_miss_fraction("m") == pytest.approx(2 / 6)
    svc.sample()
    assert svc.predictor.cold_miss_fraction("m") == pytest.approx(3 / 6)


def test_cold_counters_a_front_door_cannot_have_are_ignored_and_logged(caplog):
    """Cold arrivals are some of the model's arrivals and misses some of those: a reading
    outside that (a door that lies, a garbled answer) never reaches the predictor."""
    from agent.predictor.service import _parse_stats

    good = {"arrivals": 5, "misses": 2}
    for value in ({"arrivals": 6, "misses": 0}, {"arrivals": 2, "misses": 3},
                  {"arrivals": -1, "misses": 0}, {"arrivals": True, "misses": 0},
                  {"arrivals": 1.5, "misses": 0}, {"arrivals": "1", "misses": 0},
                  {"arrivals": float("nan"), "misses": 0}, [1, 0], None):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="agent.predictor.service"):
            got = _parse_stats("door:1", {"arrivals": {"m": 5}, "cold": {"m": value}})
        assert got["cold"] == {}, value
        assert "door:1" in caplog.text and repr(value) in caplog.text
    assert _parse_stats("door:1", {"arrivals": {"m": 5},
                                   "cold": {"m": good}})["cold"] == {"m": (5, 2)}   # at the limit


def test_requests_queued_or_running_make_a_model_busy():
    from agent.predictor.service import _parse_stats

    got = _parse_stats("door:1", {
        "arrivals": {"m": 5, "n": 1, "q": 2}, "queued": {"n": 3, "q": 0, 7: 1, "bad": "x"},
        "replicas": {"r1": {"model": "m", "active_seqs": 2},
                     "r2": {"model": "q", "active_seqs": 0},
                     "r3": {"model": "z", "active_seqs": True}, "r4": "junk"}})
    assert got["busy"] == {"m", "n"}
    assert _parse_stats("door:1", {"arrivals": {}, "queued": [1]})["busy"] == set()


def test_a_busy_reading_keeps_the_model_from_idling():
    clock = ManualClock()
    pred = Predictor([ModelPolicy("m")], clock=clock, scaler=Scaler(),
                     snapshot_durable=lambda m: True)
    stats = {"d": {"arrivals": {"m": 0}, "busy": {"m", "elsewhere"}}}
    svc = PredictorService(pred, clock=clock, fetch=lambda: stats)
    clock.advance(5.0)
    svc.sample()
    assert pred._models["m"].last_busy_s == clock.now()
    stats["d"]["busy"] = set()
    clock.advance(5.0)
    svc.sample()
    assert pred._models["m"].last_busy_s == clock.now() - 5.0


def test_queued_counts_a_front_door_cannot_have_are_ignored_and_logged(caplog):
    """A garbled ``queued`` reading (not a count, not a map) does not make a model busy, and
    is said with the door, the value and the limit, as the cold counters are."""
    from agent.predictor.service import _parse_stats

    for queued in ({"m": -1}, {"m": True}, {"m": 2.5}, {"m": "3"}, {"m": None}, [["m", 3]],
                   "m"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="agent.predictor.service"):
            got = _parse_stats("door:1", {"arrivals": {"m": 5}, "queued": queued})
        assert got["busy"] == set(), queued
        assert "door:1" in caplog.text and "queued" in caplog.text, queued
        assert "non-negative integer" in caplog.text, queued
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agent.predictor.service"):
        got = _parse_stats("door:1", {"arrivals": {"m": 5}, "queued": {"m": 0, "n": 2}})
    assert got["busy"] == {"n"} and caplog.text == ""


@pytest.mark.parametrize("backlog", [
    {"backlog_rps": 5e-324},                        # 1 / rate is inf: no occupancy
    {"backlog_rps": 1.7e308},                       # converted to the mean shape: inf
    {"backlog_prompt_tokens": 1e308},               # its shape's context: inf tokens
    {"backlog_batch": 1e300},
], ids=["rps-tiny", "rps-huge", "prompt-huge", "batch-huge"])
def test_a_measured_capacity_past_its_limits_neither_stops_the_ticks_nor_sizes(backlog):
    """One replica's absurd backlog figures (a broken meter, a forged registry entry) reach
    the predictor through a front door's stats: they are refused as not measured, and every
    model's tick goes on, sized from the speed profile."""
    from agent.predictor.service import _parse_stats
    from agent.speed import SpeedProfile

    speed = SpeedProfile(500.0, 0.02, 0.04, 0.004, 0.0)
    rep = {"model": "m", "max_seqs": 8, "active_seqs": 1, **speed.to_dict(),
           "backlog_rps": 4.0, "backlog_s": 30.0, "backlog_batch": 6.0,
           "backlog_prompt_tokens": 400.0, "backlog_gen_tokens": 30.0, **backlog}
    stats = {"d": _parse_stats("d", {"arrivals": {"m": 5, "n": 5}, "replicas": {"r": rep}})}
    assert stats["d"]["sustained"] == {}
    svc, clock = make(lambda: stats)
    svc.step()
    clock.advance(5.0)
    decisions = svc.step()
    assert sorted(d.model for d in decisions) == ["m", "n"]
    assert svc.predictor._models["m"].sustained is None


def test_a_front_doors_figures_past_their_limits_are_ignored_and_the_ticks_go_on():
    """The stats a front door answers are read within the load report's limits: a replica's
    max_seqs or KV capacity past agent/cluster/base.py's LOAD_META_LIMITS, and a mean length
    past agent/throughput.py's MAX_MEAN_TOKENS, are dropped (a length of 1e308 tokens made
    every tick raise OverflowError sizing the pool; a KV capacity of 10**400 tokens too)."""
    from agent.cluster.base import LOAD_META_LIMITS
    from agent.predictor.service import _parse_stats
    from agent.speed import SpeedProfile
    from agent.throughput import MAX_MEAN_TOKENS

    speed = SpeedProfile(500.0, 0.02, 0.04, 0.004, 0.0).to_dict()
    ok = {"model": "m", "max_seqs": LOAD_META_LIMITS["max_seqs"], "active_seqs": 0,
          "kv_capacity_tokens": LOAD_META_LIMITS["kv_capacity_tokens"], **speed}
    got = _parse_stats("d", {"arrivals": {"m": 5}, "replicas": {"r": ok},
                             "lengths": {"m": {"mean_prompt_tokens": MAX_MEAN_TOKENS,
                                               "mean_gen_tokens": 3.0}}})
    assert got["speed"]["m"][1] == LOAD_META_LIMITS["max_seqs"]
    assert got["kv_capacity_tokens"] == {"m": LOAD_META_LIMITS["kv_capacity_tokens"]}
    assert got["lengths"]["m"]["mean_prompt_tokens"] == MAX_MEAN_TOKENS
    bad = {**ok, "max_seqs": LOAD_META_LIMITS["max_seqs"] + 1,
           "kv_capacity_tokens": 10 ** 400}
    stats = {"d": _parse_stats("d", {
        "arrivals": {"m": 5, "n": 5}, "replicas": {"r": bad},
        "lengths": {"m": {"mean_prompt_tokens": 1e308, "mean_gen_tokens": MAX_MEAN_TOKENS * 2},
                    "n": {"mean_prompt_tokens": 40.0}}})}
    assert stats["d"]["speed"] == {} and stats["d"]["kv_capacity_tokens"] == {}
    assert stats["d"]["lengths"] == {"n": {"mean_prompt_tokens": 40.0}}
    # and a reading that did reach the predictor with such a length still sizes
    stats["d"]["speed"] = {"m": (SpeedProfile(500.0, 0.02, 0.04, 0.004, 0.0), 8)}
    stats["d"]["lengths"] = {"m": {"mean_prompt_tokens": 1e308}}
    svc, clock = make(lambda: stats)
    svc.step()
    clock.advance(5.0)
    assert sorted(d.model for d in svc.step()) == ["m", "n"]
