"""Simulated replicas at a measured speed: the same step semantics as the real engine, the
fleet and simulation around them, profile loading, and the CLI."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from agent.clock import ManualClock
from agent.errors import ConfigError
from agent.frontdoor.admission import AdmissionQueue
from agent.frontdoor.router import Router
from agent.sim.events import SERVED, Simulation
from agent.sim.fleet import Fleet, FleetConfig, StartupTimes
from agent.sim.policies import FixedPool
from agent.sim.profile import ReplicaProfile
from agent.sim.replica import SimReplica, fit_tokens
from agent.sim.trace import Workload
from agent.speed import DEFAULT_ITL_SLO_S, PROFILE_SCHEMA, SpeedProfile

SP = SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.01, decode_base_s=0.02,
                  decode_per_seq_s=0.005, decode_per_ctx_token_s=1e-5)


def run_replica(rep: SimReplica, requests):
    """Submit ``requests`` [(id, prompt, output)] at t=0 and step until idle: first-token and
    done times by id (the live worker's loop: steps back to back while busy)."""
    for r in requests:
        rep.submit(*r)
    t, first, done = 0.0, {}, {}
    while rep.busy:
        firsts, t = rep.start_step(t)
        first.update(dict(firsts))
        done.update({r: t for r in rep.end_step()})
    return first, done


def test_one_request_prefills_then_decodes_step_by_step():
    first, done = run_replica(SimReplica(SP, max_seqs=4), [(7, 100, 4)])
    assert first[7] == pytest.approx(SP.prefill_s(100))
    # 3 more tokens: decode steps over contexts 100, 101, 102 (the first rides the prefill step)
    steps = sum(SP.decode_step_s(1, c) for c in (100, 101, 102))
    assert done[7] == pytest.approx(SP.prefill_s(100) + steps)


@pytest.mark.parametrize("bad", [0, -4, 2.0])
def test_a_prefill_chunk_below_one_token_is_refused(bad):
    with pytest.raises(ConfigError) as err:
        SimReplica(SP, max_seqs=4, itl_target_s=0, prefill_chunk=bad)
    assert err.value.name == "prefill_chunk"

def test_slots_bound_the_batch_and_a_waiting_request_gets_the_freed_slot():
    """Without a budget (itl_target_s 0): each prompt whole, alone, one after another."""
    rep = SimReplica(SP, max_seqs=2, itl_target_s=0.0)
    first, done = run_replica(rep, [(0, 50, 2), (1, 50, 6), (2, 10, 2)])
    # step 1: both prefilled (each first token as its own prefill ends), one decode at B=2
    # ends request 0; step 2 admits request 2
    t1 = 2 * SP.prefill_s(50) + SP.decode_step_s(2, 100)
    assert first[0] == pytest.approx(SP.prefill_s(50))
    assert first[1] == pytest.approx(2 * SP.prefill_s(50))
    assert done[0] == pytest.approx(t1)
    assert first[2] == pytest.approx(t1 + SP.prefill_s(10))
    assert done[2] == pytest.approx(first[2] + SP.decode_step_s(2, 51 + 10))


def test_chunked_steps_share_calls_and_cut_a_long_prompt_at_the_budget():
    """With the default ITL target (0.2 s): equal prompts share one call; a prompt longer
    than the step's budget is cut where it runs out and finishes in the next step, while
    the running sequence decodes once per step."""
    rep = SimReplica(SP, max_seqs=3)
    first, done = run_replica(rep, [(0, 50, 2), (1, 50, 6)])
    assert first[0] == first[1] == pytest.approx(SP.prefill_s(100))     # one [2, 50] call
    assert rep.calls == 1
    rep = SimReplica(SP, max_seqs=3)
    budget = SP.__class__(**{**SP.to_dict(), "itl_target_s": 0.2}).prefill_budget_tokens(0)
    assert budget == 190                      # (0.2 - 0.01) * 1000
    first, done = run_replica(rep, [(0, 300, 3)])
    step_1 = SP.prefill_s(190)                # nothing runs yet: no decode
    b2 = int((0.2 - 0.01) * 1000)             # still no running sequence: 190 again
    assert b2 >= 110 and first[0] == pytest.approx(step_1 + SP.prefill_s(110))
    assert done[0] == pytest.approx(first[0] + SP.decode_step_s(1, 300)
                                    + SP.decode_step_s(1, 301))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from agent.replica.synthetic import make_synthetic

    return make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=0)


@pytest.mark.parametrize("itl_target_s", [0.0, 0.2, 0.05])
def test_sim_replica_matches_the_real_engine_step_for_step(tiny_dir, itl_target_s):
    """The same burst through the real Engine (fake forward moving a fake clock by SP's cost,
    its meter holding SP) and through SimReplica gives the same first-token and completion
    times: whole prompts, a budget that cuts the long ones, and one at its floor."""
    from agent.replica.config import LlamaConfig
    from agent.replica.engine import Engine
    from agent.replica.speedmeter import SpeedMeter
    from tests.replica.test_speedmeter import FakeForward

    config = LlamaConfig.from_dir(tiny_dir)
    fwd = FakeForward(SP, config.vocab_size)
    engine = fwd.attach(Engine(config, None, max_seqs=3, max_seq_len=128, forward=fwd,
                               clock=fwd.clock, meter=SpeedMeter(SP, measured_prior=True),
                               itl_target_s=itl_target_s))
    engine.meter.observe_prefill = lambda *a: None   # plan with SP, as the sim's ``reported``
    engine.meter.observe_decode = lambda *a: None
    reqs = [(i, 5 + 17 * i, 2 + (5 * i) % 7) for i in range(7)]
    ids = {engine.submit([1] * p, o): i for i, p, o in reqs}
    first, done = {}, {}
    while engine.busy:                 # the worker's tick: each call, send, ..., decode, send
        engine.begin_step()
        while engine.can_prefill:
            for ev in engine.prefill():
                first.setdefault(ids[ev.seq_id], fwd.now_s)
                if ev.done:
                    done[ids[ev.seq_id]] = fwd.now_s
        for ev in engine.decode():
            if ev.done:
                done[ids[ev.seq_id]] = fwd.now_s
    sim = SimReplica(SP, max_seqs=3, itl_target_s=itl_target_s, max_seq_len=128)
    sim_first, sim_done = run_replica(sim, reqs)
    assert sim_first == pytest.approx(first) and sim_done == pytest.approx(done)
    assert sim.calls == fwd.calls["prefill"]


def test_prediction_is_exact_when_idle_and_an_upper_bound_when_busy():
    rep = SimReplica(SP, max_seqs=2, itl_target_s=0.0)
    assert rep.predict_ttft_s(80) == pytest.approx(SP.prefill_s(80))
    rep.submit(0, 50, 5)
    rep.submit(1, 60, 9)
    _, t = rep.start_step(0.0)
    rep.end_step()                          # at a step boundary, both slots taken
    predicted = rep.predict_ttft_s(30)      # waits for request 0's last 3 steps, then prefill
    rep.submit(9, 30, 2)
    first_9 = None
    while rep.busy:
        firsts, t_end = rep.start_step(t)
        first_9 = first_9 or dict(firsts).get(9)
        rep.end_step()
        t = t_end if first_9 is None else t
    actual = first_9 - (SP.prefill_s(50) + SP.prefill_s(60) + SP.decode_step_s(2, 110))
    # an upper bound by at most the one step it charges whole for the step in progress
    assert actual <= predicted + 1e-12
    assert actual >= predicted - SP.decode_step_s(2, 130)
    assert predicted > 3 * SP.decode_step_s(2, 110)


def test_fit_tokens_scales_and_shrinks_to_a_slot():
    p, o, shrunk = fit_tokens(np.array([100, 4000, 3]), np.array([10, 1000, 0]), 512, 0.5)
    assert list(p[[0, 2]]) == [50, 2] and list(o[[0, 2]]) == [5, 1]
    assert p[1] + o[1] <= 512 and p[1] / o[1] == pytest.approx(4.0, rel=0.05) and shrunk == 1
    with pytest.raises(ConfigError):
        fit_tokens(np.array([1]), np.array([1]), 512, 0.0)


def profile_file(tmp_path, **engine):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({
        "schema": PROFILE_SCHEMA, "speed": SP.to_dict(),
        "engine": {"max_seqs": 4, "max_seq_len": 256, "kv_capacity_tokens": 1024, **engine},
        "startup": {"naive_s": [9.0, 11.0], "zygote_restore_s": [0.9, 1.2]}}))
    return path


def test_profile_loads_speed_sizes_and_startup_and_refuses_bad_sizes(tmp_path):
    prof = ReplicaProfile.from_file(profile_file(tmp_path))
    assert prof.speed == SP and (prof.max_seqs, prof.max_seq_len) == (4, 256)
    assert prof.startup.restore_s == (0.9, 1.2) and prof.startup.naive_s == (9.0, 11.0)
    assert StartupTimes.from_json(profile_file(tmp_path)).restore_s == (0.9, 1.2)
    with pytest.raises(ConfigError) as err:
        ReplicaProfile.from_file(profile_file(tmp_path, max_seqs=0))
    assert err.value.name == "max_seqs"


def token_workload(rows):
    """rows: (arrival_s, prompt, output)"""
    a = np.array(rows, dtype=np.float64)
    p, o = a[:, 1].astype(np.int64), a[:, 2].astype(np.int64)
    return Workload(a[:, 0].copy(), np.ones(len(rows)), SP.prefill_overhead_s + p / 1000.0, p + o,
                    np.zeros(len(rows), dtype=np.int16), p, o)


def run(workload, replicas=1, max_seqs=2):
    clock = ManualClock()
    prof = ReplicaProfile(SP, max_seqs=max_seqs, max_seq_len=256, kv_capacity_tokens=512)
    cfg = FleetConfig(seqs_per_replica=max_seqs, kv_capacity_tokens=512, replica=prof)
    router = Router()
    fleet = Fleet(cfg, router=router, clock=clock, schedule=None, rng=np.random.default_rng(0))
    queue = AdmissionQueue("m", clock=clock, max_depth=100, max_wait_s=30.0)
    sim = Simulation(workload, clock=clock, queue=queue, router=router, fleet=fleet,
                     controller=FixedPool("m", replicas), model="m", max_wait_s=30.0,
                     end_s=60.0)
    fleet._schedule = sim.schedule
    fleet.start_warm(replicas)
    return sim.run(), fleet


def test_simulation_serves_through_the_router_at_the_replicas_speed():
    rec, fleet = run(token_workload([(0.0, 100, 3), (0.001, 40, 2), (0.002, 20, 2), (5.0, 10, 1)]))
    assert (rec.status == SERVED).all()
    # the first starts a step at once; the second arrives during it and is prefilled by the
    # next; the third finds both slots dispatched and waits in the front door's queue
    step_1 = SP.prefill_s(100) + SP.decode_step_s(1, 100)
    assert rec.ttft_s[0] == pytest.approx(SP.prefill_s(100))
    assert rec.ttft_s[1] == pytest.approx(step_1 + SP.prefill_s(40) - 0.001)
    assert rec.path[2] == 1 and rec.ttft_s[2] > rec.ttft_s[1]
    assert rec.ttft_s[3] == pytest.approx(SP.prefill_s(10))      # idle again at 5 s
    assert fleet.engines[0].steps > 3 and not fleet.engines[0].busy
    assert rec.busy_slot_s > 0


def test_simulation_needs_tokens_for_profiled_replicas(workload_factory):
    with pytest.raises(ConfigError, match="tokens"):
        run(workload_factory([(0.0, 1.0, 0.1, 10)]))


def test_cli_runs_a_trace_at_a_profile_and_refuses_it_for_scenarios(tmp_path):
    trace = tmp_path / "t.csv"
    rows = [f"2023-11-16 18:17:{s:02d}.0000000,{200 + 37 * s},{5 + s % 9}" for s in range(40)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "agent.cli", "simulate", "--trace", str(trace),
           "--replica-profile", str(profile_file(tmp_path)), "--token-scale", "0.5",
           "--policy", "always_on", "--no-progress", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    rp = result["replica_profile"]
    assert rp["max_seqs"] == 4 and 1 <= rp["sustainable_batch"] <= 4
    assert result["startup"]["restore_s"] == [0.9, 1.2]
    (policy,) = result["policies"]
    assert policy["served"] == 40 and policy["ttft_ms"]["warm"]["p50"] >= SP.prefill_s(100) * 1e3
    bad = subprocess.run([sys.executable, "-m", "agent.cli", "simulate", "--scenario", "cost",
                          "--replica-profile", str(profile_file(tmp_path))],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--replica-profile" in bad.stderr


def test_router_sees_speed_and_queue_and_routes_by_predicted_ttft():
    # A (long output) takes r0, B (long prompt) r1; C goes where it starts soonest: r0, busy
    # decoding but with little to prefill, not r1 with more KV headroom but 150 tokens queued
    rec, fleet = run(token_workload([(0.0, 10, 200), (0.001, 150, 2), (0.002, 5, 2)]),
                     replicas=2, max_seqs=4)
    step_a = SP.prefill_s(10) + SP.decode_step_s(1, 10)
    assert rec.ttft_s[2] == pytest.approx(step_a + SP.prefill_s(5) - 0.002)
    assert rec.ttft_s[1] == pytest.approx(SP.prefill_s(150))
    load = fleet.router.get("r0")
    assert load.speed == dataclasses.replace(SP, itl_target_s=DEFAULT_ITL_SLO_S)
    assert load.active_seqs == 0
    assert (load.waiting_seqs, load.queued_prefill_tokens) == (0, 0)


def test_the_step_target_comes_from_the_report_else_the_engines_default():
    """A profile taken from a live replica's report plans by the step target it reported;
    one measured by bench/engine_profile.py (no target) by the engine's default; 0 given
    explicitly is whole prompts."""
    live = dataclasses.replace(SP, itl_target_s=0.17)
    assert SimReplica(SP, 4, live).reported.itl_target_s == 0.17
    assert SimReplica(SP, 4).reported.itl_target_s == DEFAULT_ITL_SLO_S
    assert SimReplica(SP, 4, live, itl_target_s=0.0).reported.prefill_budget_tokens(0) is None
    assert SimReplica(SP, 4).report()["itl_target_s"] == DEFAULT_ITL_SLO_S
