"""The judge of the serving promise (docs/architecture.md, "Admission"): a live replay of a trace window on the real embedded stack, scaled
to this machine, beside the simulator's replay of the same requests.

    bench/trace_replay.py --trace CSV [--load 0.3[,3]] [--minutes 10] [--start-min 0]
                          [--wall-s 240] [--profile JSON] [--deadline-policy default,client3x]
                          --json PATH

For each ``--load`` and each ``--deadline-policy`` (``default``: no client deadline, so the
front door's default, ``deadline_factor`` :data:`agent.slo.DEADLINE_FACTOR` times the SLO:
the SLO itself; ``client3x``: clients that ask for three times the SLO, :func:`deadline_factors`),
on a fresh ``rewarm up`` stack (real ``rewarm replica`` processes on
SmolLM2-135M, the front door, the node agent and, for the replay, the predictor):

1. the node agent cold-boots a replica (its ``restore`` op with no snapshot yet; the snapshot
   is captured in the background);
2. the replica's speed is measured through the front door (:func:`agent.sim.replay.calibrate`);
   the window is scaled by the profile the replica's own speed meter then reports (the one
   the front door admits and routes with), else by that calibration, or by ``--profile``
   (an engine profile file from bench/engine_profile.py); once its snapshot is ready the replica is drained and restored
   through the node agent's control API: that op's duration is the measured restore time;
3. the window is scaled (:func:`agent.sim.replay_scale.fit_scale`): one time compression
   from the wall budget and one token scale, so the window's mean offered work is ``load`` of
   that replica's capacity (``SpeedProfile.service_rps`` at its sustainable concurrency for
   the warm SLO), the burst shape unchanged;
4. the predictor starts (its production policy; sizing from the measured speed, lead time
   = restore + decision latency + one step), and the requests are sent at their wall times;
5. the same requests go through the simulator (:func:`agent.sim.pathsim.simulate_path`): the
   production front-door request path, predictor service and local scaler on virtual time,
   with simulated replicas that report the profile the live replica reported and serve at
   the speed the calibration measured, slowed by the cores this process (front door, node
   agent, predictor, load generator) took from them per request during the live window
   (:mod:`agent.sim.contention`; ``contention`` in the JSON), and a simulated node agent whose restores take the
   median restore it timed during the live window (the front door starting with the
   probe's restore measured, as live).

``--resim LIVE.json --records REC`` runs step 5 alone again on an earlier run (its JSON and
its ``--records`` file) and prints both columns: the simulator can be changed and re-judged
against one live run without running the stack again.  With ``--sustained`` the simulated
node gets the capacity the live node sustained while saturated (:func:`sustained_rps`):
where the two then agree, what the simulator lacks is the live capacity, not the mechanics.

It prints live and simulated side by side and writes ``--json``: per load the keys of
:func:`agent.sim.replay.summarise` (``requests, served, shed_429, shed_429_within_50ms,
expired_504, lost, sla_attainment, ttft_ms, gpu_seconds, always_on_gpu_seconds, restores``),
``sim`` (the same keys), ``load``, ``speedup``, ``token_scale``, ``trace``, the profile, the
measured restore and the targets' verdicts.  GPU-seconds are replica-seconds here (a CPU
machine): every replica alive (restoring included), sampled every 0.25 s, over the window's
wall span.  Always-on is the pool that serves the window's busiest 10 s without scaling
(:func:`~agent.sim.replay_scale.always_on_replicas`, as the simulator's always-on policy is
sized), over the same span; ``one_replica_gpu_seconds`` is one replica.  At most ``cores // --threads`` replicas (a replica beyond that would share a core and
add no capacity).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent.argtypes import nonneg_float, positive_float, positive_int  # noqa: E402
from agent.errors import ConfigError, InvalidTrace, RewarmError  # noqa: E402

WARM_SLO_MS, RESTORE_SLO_MS = 2000.0, 4000.0   # the default TTFT SLOs (docs/architecture.md)
MODEL_DEADLINE_MS = 60_000.0   # the model's default deadline: a cap that no replay request nears
SATURATE_S = 8.0   # seconds the warm replica is kept backlogged to measure what it sustains
SLA_TARGET = 0.99  # the SLO is a p99
DECISION_LATENCY_S = 1.0
# a sparse window's median gap is kept at least this many times (restore + keep-alive) in
# wall time: long enough that scaling to zero in it pays and shows (agent/sim/replay_scale.py)
GAP_FACTOR = 10.0


def say(text: str) -> None:
    print(text, flush=True)


CLIENT_DEADLINE_FACTOR = 3.0
"""The ``client3x`` policy: every client asks for a deadline of three times its path's SLO
(one that would rather have a late answer than a refusal)."""


def deadline_factors() -> dict[str, float]:
    """``--deadline-policy`` names: ``default`` (no client deadline: the front door's
    default, ``DEADLINE_FACTOR`` x the SLO, agent/slo.py: the SLO itself) and ``client3x``
    (clients' own deadlines of :data:`CLIENT_DEADLINE_FACTOR` x the SLO)."""
    from agent.slo import DEADLINE_FACTOR

    return {"default": DEADLINE_FACTOR, "client3x": CLIENT_DEADLINE_FACTOR}


def policy_list(text: str) -> list[str]:
    """``default``, ``client3x`` or both, comma-separated; ArgumentTypeError naming a name
    not known."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    known = deadline_factors()
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"deadline policy {text!r}: each must be one of "
                                         f"{', '.join(known)}")
    return names


def load_list(text: str) -> list[float]:
    """``0.3`` or ``0.3,3``: offered loads, each a finite number > 0."""
    return [positive_float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=False,
                    help="the trace CSV (required unless --resim)")
    ap.add_argument("--resim", type=Path, default=None, metavar="LIVE_JSON",
                    help="run only the simulator again, on the requests of an earlier run "
                         "(its --json file and, with --records, its records) and print both")
    ap.add_argument("--sustained", action="store_true",
                    help="--resim: simulate at the capacity the live node sustained while "
                         "saturated instead of the contention model's")
    ap.add_argument("--load", type=load_list, default=[0.3],
                    help="offered load(s), fraction of one replica's capacity (0.3; 0.3,3)")
    ap.add_argument("--deadline-policy", type=policy_list, default=["default", "client3x"],
                    help="deadline policies replayed at each load: default (no client "
                         "deadline: the front door's, the SLO), client3x (clients ask for 3x "
                         "the SLO); default both")
    ap.add_argument("--minutes", type=positive_float, default=10.0, help="trace window (min)")
    ap.add_argument("--start-min", type=nonneg_float, default=0.0,
                    help="window start, minutes after the trace's first request")
    ap.add_argument("--wall-s", type=positive_float, default=240.0,
                    help="wall-time budget of one replay (s); sets the time compression")
    ap.add_argument("--profile", type=Path,
                    help="an engine profile (bench/engine_profile.py) instead of measuring")
    ap.add_argument("--threads", type=positive_int, default=1, help="torch threads per replica")
    ap.add_argument("--max-replicas", type=positive_int, default=None,
                    help="replica cap (default: cores // threads)")
    ap.add_argument("--state-dir", type=Path, default=REPO / "var" / "replay")
    ap.add_argument("--no-aot", action="store_true")
    ap.add_argument("--repeat", type=positive_int, default=1,
                    help="runs of each load and deadline policy, each on a fresh stack (their "
                         "SLA attainment's spread is in the JSON's spread table)")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--records", type=Path, default=None,
                    help="also write every request's outcome and every predictor decision "
                         "(JSON lines, one file per load: PATH.<load>.jsonl) for diagnosis")
    return ap.parse_args(argv)


def read_profile(path: Path):
    """The :class:`~agent.speed.SpeedProfile` of an engine profile file (bench/engine_profile.py,
    ``SpeedProfile.from_file``; ConfigError naming the file and the key).  Note that the
    engine profile times the engine alone, without the front door and the replica's socket,
    which a scaled replay's short requests also pay: the default calibration measures them."""
    from agent.speed import SpeedProfile

    return SpeedProfile.from_file(path)


def wait_for(cond, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what} not reached within {timeout_s:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - start


def live_replicas(stack) -> list:
    return [r for r in stack.agent.status()["replicas"] if r["model"] == stack.model]


def predictor_policy(restore_s: float, max_replicas: int) -> dict:
    """The predictor's production policy for a replay: defaults, with the measured restore
    time (keep-alive and lead time: restore + decision latency + one 1 s step) and the cap."""
    from agent.predictor.keepalive import KeepAliveCosts

    return {"restore_p99_s": restore_s, "decision_latency_s": DECISION_LATENCY_S,
            "lead_time_s": restore_s + DECISION_LATENCY_S + 1.0,
            "ttft_slo_s": WARM_SLO_MS / 1000.0, "max_replicas": max_replicas,
            "costs": KeepAliveCosts(restore_s=restore_s)}


def idle_minutes(arrival_s) -> int:
    """Whole minutes of the window's trace time without an arrival (gaps of 60 s or more,
    each counted by its whole minutes): where a pool that scales to zero can save."""
    import numpy as np

    a = np.sort(np.asarray(arrival_s, dtype=np.float64))
    return int(np.sum(np.floor(np.diff(a) / 60.0))) if a.size > 1 else 0


def fluid_bounds(plan, profile, sustained, batch: int, cap: int) -> dict[int, float]:
    """``{replicas: the share of the plan's requests that many always-on replicas can start
    within the warm SLO at best}`` for 1..``cap`` (:func:`agent.sim.replay_scale.fluid_attainment`
    at the rate the replica sustained while backlogged): what any scheduler could do with
    that many replicas, and so the always-on pool the window needs."""
    import numpy as np

    from agent.sim.replay_scale import fluid_attainment, request_seconds

    at = np.array([r.at_s for r in plan])
    seconds = request_seconds(plan, profile, sustained, batch)
    return {n: fluid_attainment(at, seconds, WARM_SLO_MS / 1000.0, n) for n in range(1, cap + 1)}


def beyond_one(sampler, decisions: list[dict]) -> dict:
    """When more than one replica was alive and why: ``replica_s`` (replica-seconds beyond
    the first), ``seconds`` (wall seconds with two or more alive) and ``why``, the predictor's
    scale-ups past one and their reasons (a replica the front door asked for while requests
    waited shows as a second alive without one)."""
    ups = [d for d in decisions if d["action"] == "scale_up" and d["target"] > 1]
    return {"replica_s": round(sampler.beyond_one_s, 2), "seconds": round(sampler.crowded_s, 2),
            "why": [f"t={d['t_s']:.0f} s: {d['reason']} (forecast {d['forecast_rps']} req/s)"
                    for d in ups][:20]}


def gap_floor(arrival_s, window_s: float, restore_s: float, cap: int) -> dict:
    """Whether a window is sparse and the compression that keeps its gaps: the predictor's
    keep-alive for the window's mean rate under the replay's policy (``release_after_s``,
    agent/predictor/loop.py), the wall floor ``GAP_FACTOR x (restore + keep-alive)`` and
    :func:`agent.sim.replay_scale.gap_keeping_speedup` (None for a dense window)."""
    import numpy as np

    from agent.predictor.keepalive import plan_keepalive
    from agent.predictor.loop import ModelPolicy, release_after_s
    from agent.sim.replay_scale import gap_keeping_speedup

    policy = ModelPolicy("replay", **predictor_policy(restore_s, cap))
    rate = len(arrival_s) / window_s
    keepalive_s = release_after_s(plan_keepalive(rate, policy.costs), policy)
    floor = GAP_FACTOR * (restore_s + keepalive_s)
    a = np.asarray(arrival_s, dtype=np.float64)
    median = float(np.median(np.diff(a))) if a.size > 1 else None
    return {"keepalive_s": keepalive_s, "gap_floor_s": floor, "median_gap_s": median,
            "max_speedup": gap_keeping_speedup(a, floor)}


def run_one(args, load: float, policy: str, rows, window_s: float, model_dir, release,
            note) -> dict:
    """One replay at ``load`` under deadline ``policy`` on a fresh stack: live, then
    simulated (module docstring)."""
    from agent.sim import replay
    from agent.sim.demo import Sampler, _fresh_state, _vocabulary, replica_limits, replica_stats
    from agent.replica.config import LlamaConfig
    from agent.sim.replay_scale import fit_scale, replay_requests
    from agent.up import Stack

    cores = os.cpu_count() or 1
    cap = args.max_replicas or max(1, cores // args.threads)
    tok, probe, base = _vocabulary(model_dir, LlamaConfig.from_dir(model_dir).vocab_size)
    state = args.state_dir
    _fresh_state(state)
    factor = deadline_factors()[policy]
    stack = Stack(state, model_dir, release, threads=args.threads, start_predictor=False,
                  restores_per_model=cap, max_replicas=cap, deadline_ms=MODEL_DEADLINE_MS,
                  deadline_factor=factor)
    t_start = time.monotonic()
    stack.start()
    sampler = None
    try:
        address, model = stack.frontdoor_address, stack.model
        from agent.cluster.control import control_call

        t0 = time.monotonic()
        control_call(stack.agent_address, "restore", model=model, timeout_s=900.0)
        say(f"  cold boot (node agent restore op, no snapshot yet): {time.monotonic() - t0:.1f} s")
        # the snapshot capture runs beside the replica: measure only once it is done
        waited = wait_for(lambda: bool(stack.agent.catalog.snapshots(model, status="ready")),
                          600.0, "a ready snapshot")
        say(f"  snapshot ready after {waited:.1f} s")
        max_seqs, max_seq_len = replica_limits(stack)
        from agent.speed import SpeedProfile

        calibrated = asyncio.run(replay.calibrate(address, model, base, max_seq_len=max_seq_len))
        say(f"  calibrated through the front door: {calibrated}")
        meter = SpeedProfile.from_meta(replica_stats(stack))
        say(f"  the replica's own speed meter (after that traffic): {meter}")
        if args.profile:
            profile, source = read_profile(args.profile), str(args.profile)
        elif meter is not None:
            # the front door admits and routes on what the replica reports: scale by the same
            profile, source = meter, "the replica's speed meter (what admission predicts with)"
        else:
            profile, source = calibrated, "measured through the front door (agent.sim.replay.calibrate)"
        say(f"  scaling by {source}")
        say("  draining the replica to measure a restore")
        for r in live_replicas(stack):
            stack.agent.drain(r["replica"], timeout_s=30.0, force=True)
        wait_for(lambda: not live_replicas(stack), 60.0, "scale to zero")
        # restored through the front door (the probe carries its own deadline), so the front
        # door measures the snapshot restore its admission then predicts with
        rows_before = len(stack.agent.catalog.cold_starts(model))
        again = asyncio.run(replay.one_request_at(address, model, probe, 8,
                                                  deadline_ms=replay.CALIBRATION_DEADLINE_MS))
        if again.code != 200:
            raise RuntimeError(f"the probe after scale-to-zero failed: {again.code} {again.reason}")
        new_rows = stack.agent.catalog.cold_starts(model)[rows_before:]
        restore_s = max([float(r["duration_s"]) for r in new_rows if r["outcome"] == "ok"]
                        or [again.ttft_ms / 1000.0])
        say(f"  restore: {restore_s:.2f} s (probe path {again.path}, TTFT {again.ttft_ms:.0f} ms)")
        gaps = gap_floor(rows.arrival_s, window_s, restore_s, cap)
        if gaps["max_speedup"] is not None:
            say(f"  sparse window: median gap {gaps['median_gap_s']:.1f} s; compression held at "
                f"{gaps['max_speedup']:.2f}x so it stays >= {GAP_FACTOR:g} x (restore "
                f"{restore_s:.2f} s + keep-alive {gaps['keepalive_s']:.2f} s) = "
                f"{gaps['gap_floor_s']:.1f} s of wall time (the wall budget is exceeded)")
        fit = dict(window_s=window_s, profile=profile, load=load, wall_s=args.wall_s,
                   ttft_slo_s=WARM_SLO_MS / 1000.0, max_seqs=max_seqs,
                   max_tokens_per_request=max_seq_len, max_speedup=gaps["max_speedup"])
        by_profile = fit_scale(rows.context_tokens, rows.generated_tokens, **fit)
        # what the replica sustains backlogged at the replay's own lengths, end to end (the
        # front door and this process beside it): the load is a fraction of that
        lengths = [(r.prompt_tokens, r.output_tokens) for r in replay_requests(
            rows.arrival_s, rows.context_tokens, rows.generated_tokens, by_profile,
            max_seq_len)]
        sustained = asyncio.run(replay.saturate(address, model, base, lengths,
                                                concurrency=2 * max_seqs,
                                                seconds=SATURATE_S))
        say(f"  sustained backlogged at the replay's lengths: {sustained.rps:.2f} req/s "
            f"(the profile estimated {by_profile.capacity_rps:.2f})")
        scale = fit_scale(rows.context_tokens, rows.generated_tokens, sustained=sustained,
                          **fit)
        plan = replay_requests(rows.arrival_s, rows.context_tokens, rows.generated_tokens,
                               scale, max_seq_len)
        bounds = fluid_bounds(plan, profile, sustained, scale.batch, cap)
        say(f"  at best (fluid bound at the sustained rate): one always-on replica meets the "
            f"SLO for {100 * bounds[1]:.1f} %, {cap} for {100 * bounds[cap]:.1f} %")
        say(f"  scale: speedup {scale.speedup:.3f} (trace s per wall s), token scale "
            f"{scale.token_scale:.5f}, mean prompt {scale.mean_prompt_tokens:.1f} / output "
            f"{scale.mean_output_tokens:.2f} tokens, capacity {scale.capacity_rps:.2f} req/s at "
            f"batch {scale.batch}, offered {scale.offered_rps:.2f} req/s = load {scale.load:.2f}"
            f"{' (' + scale.bound + ' bound)' if scale.bound else ''}; {len(plan)} requests "
            f"over {scale.wall_s:.0f} s")
        stack.predictor_overrides = predictor_policy(restore_s, cap)
        stack.start_predicting()
        stack.predictor.predictor.update_speed(model, profile, max_seqs, sustained=sustained,
                                               mean_prompt_tokens=scale.mean_prompt_tokens,
                                               mean_gen_tokens=scale.mean_output_tokens)
        restores_before = len(stack.agent.catalog.cold_starts(model))
        sampler = Sampler(stack.agent)
        cpu0, busy0 = _own_cpu_s(), _machine_busy_s()
        outcomes = asyncio.run(replay.send_plan(address, model, plan, base,
                                                until_s=scale.wall_s))
        span_s = sampler.stop()
        busy1 = _machine_busy_s()
        contention = contention_of(cpu_s=_own_cpu_s() - cpu0,
                                   machine_busy_s=None if busy0 is None or busy1 is None
                                   else busy1 - busy0, span_s=span_s,
                                   requests=len(plan), cap=cap, threads=args.threads,
                                   actual=calibrated, scale=scale,
                                   cpu_samples=sampler.cpu, outcomes=outcomes)
        # the front door's own counts: replica 429s, requests placed again, late first tokens
        fd_counts = dict(stack.frontdoor.path.counts)
        rows_after = stack.agent.catalog.cold_starts(model)
        restores = len(rows_after) - restores_before
        # each restore of the window, as the node agent timed it (the simulator's restores)
        replay_restores_s = [float(r["duration_s"]) for r in rows_after[restores_before:]
                             if r["outcome"] == "ok"]
        peak = sampler.peak
        decisions = [{"t_s": round(d.at_s - stack.decisions[0].at_s, 2), "action": d.action,
                      "target": d.target, "desired": d.desired, "reason": d.reason[:100],
                      "forecast_rps": round(d.forecast_rps, 3)}
                     for d in stack.decisions if d.action not in ("hold", "standby")]
    finally:
        if sampler is not None and not sampler._stop.is_set():
            sampler.stop()
        stack.close()
    pool = next((n for n in sorted(bounds) if bounds[n] >= SLA_TARGET), cap)
    live = replay.summarise(outcomes, gpu_seconds=sampler.replica_s,
                            always_on_gpu_seconds=pool * span_s, restores=restores)
    live.update(peak_replicas=peak, always_on_replicas=pool,
                one_replica_gpu_seconds=round(span_s, 2),
                fluid_bounds={str(n): round(v, 4) for n, v in bounds.items()},
                beyond_one=beyond_one(sampler, decisions),
                prediction=prediction_error(outcomes), frontdoor_counts=fd_counts,
                requests_log=[request_row(o) for o in outcomes])
    sim = simulate(plan, profile, max_seqs=max_seqs, max_seq_len=max_seq_len,
                   restore_s=restore_s, cap=cap, mean_prompt_tokens=scale.mean_prompt_tokens,
                   mean_gen_tokens=scale.mean_output_tokens, span_s=scale.wall_s,
                   always_on_replicas=pool, actual=calibrated,
                   replay_restores_s=replay_restores_s, deadline_factor=factor,
                   shared_speed=contention["speed"], sustained=sustained, lengths=lengths)
    codes = {}
    for o in outcomes:
        codes[o.code] = codes.get(o.code, 0) + 1
    reasons = sorted({o.reason[:160] for o in outcomes if o.code not in (200,)})[:8]
    out = {**live, "sim": sim, "load": load, "deadline_policy": policy,
           "deadline_factor": factor, "trace": Path(rows.path).name, "speedup": scale.speedup,
           "token_scale": scale.token_scale, "scale": scale.to_json(), "idle_gaps": gaps,
           "profile": profile.to_meta(), "profile_source": source,
           "sustained": sustained.to_meta(),
           "profile_capacity_rps": by_profile.capacity_rps,
           "replica_meter_profile": None if meter is None else meter.to_meta(),
           "calibrated_profile": calibrated.to_meta(),
           "restore_s": restore_s, "replay_restores_s": replay_restores_s,
           "contention": contention,
           "max_replicas": cap, "threads": args.threads,
           "idle_minutes": idle_minutes(rows.arrival_s),
           "max_seqs": max_seqs, "max_seq_len": max_seq_len,
           "forward": note, "codes": {str(k): v for k, v in sorted(codes.items())},
           "refusal_reasons": reasons, "decisions": decisions[:200], "wall_s_total": time.monotonic() - t_start,
           "loadavg": os.getloadavg(), "requests_window": len(plan),
           "mean_rps_wall": float(len(plan) / scale.wall_s) if scale.wall_s else None}
    out["verdict"] = verdict(out)
    if args.records is not None:
        write_records(args.records, load, policy, plan, outcomes, stack.decisions)
    return out


def simulate(plan, profile, *, max_seqs: int, max_seq_len: int, restore_s: float, cap: int,
             mean_prompt_tokens: float, mean_gen_tokens: float, span_s: float,
             always_on_replicas: int, actual=None,
             replay_restores_s: list[float] | None = None,
             deadline_factor: float | None = None, shared_speed: float = 1.0,
             sustained=None, lengths: list[tuple[int, int]] | None = None) -> dict:
    """The simulator's side (step 5): the same requests through the production request path
    and predictor, with simulated replicas, node agent and clock
    (:func:`agent.sim.pathsim.simulate_path`), configured as this replay's stack.  The
    simulated replicas report ``profile`` (what the live replica's meter reported, which
    admission predicts with) and serve at ``actual`` (the speed measured through the front
    door, :func:`agent.sim.replay.calibrate`: what its clients saw; default ``profile``).  The
    front door starts with ``restore_s`` measured (the probe's restore, as live); each
    simulated restore takes the median of ``replay_restores_s`` (the restores the node agent
    timed during the live window; default ``restore_s``), plus the time to start a zygote
    when none is ready, estimated from the slow ones (:func:`zygote_estimate_s`).
    ``deadline_factor``: the live run's (default: the front door's default).
    ``sustained``: what the live replica sustained backlogged at the request mix ``lengths``
    (:func:`agent.sim.replay.saturate`); ``actual`` is first scaled so a simulated replica
    sustains the same (:func:`agent.sim.calibrate.matched_speed`: the live stack's work around
    the engine, which no profile holds), the factor in the result's ``speed_factor``.
    ``shared_speed``: the fraction of that the replicas serve at when all ``cap`` of them
    share the cores with the stack's process (:func:`agent.sim.contention.shared_core_speed`,
    from the CPU the live stack spent per request; 1: none)."""
    from agent.sim.calibrate import matched_speed
    from agent.sim.contention import slowed

    from agent.sim.pathsim import PathSimConfig, simulate_path

    restores = list(replay_restores_s or [])
    factor = deadline_factors()["default"] if deadline_factor is None else deadline_factor
    config = PathSimConfig(deadline_ms=MODEL_DEADLINE_MS, deadline_factor=factor,
                           registry_poll_s=0.2, agent_tick_s=0.5,
                           restores_per_model=cap, max_replicas=cap, warm_slo_ms=WARM_SLO_MS,
                           restore_slo_ms=RESTORE_SLO_MS, zygote_s=zygote_estimate_s(restores))
    speed, speed_factor = actual or profile, 1.0
    if sustained is not None and lengths:
        speed, speed_factor = matched_speed(speed, sustained, lengths, max_seqs=max_seqs,
                                            max_seq_len=max_seq_len, reported=profile)
    out = simulate_path(plan, profile, max_seqs=max_seqs, max_seq_len=max_seq_len,
                        restore_s=_median(restores) or restore_s, measured_restore_s=restore_s,
                        policy=predictor_policy(restore_s, cap),
                        mean_prompt_tokens=mean_prompt_tokens, mean_gen_tokens=mean_gen_tokens,
                        config=config, initial_replicas=1, span_s=span_s,
                        always_on_replicas=always_on_replicas,
                        actual=slowed(speed, shared_speed), sustained=sustained)
    out["speed_factor"] = round(speed_factor, 4)
    return out


def _own_cpu_s() -> float:
    """CPU seconds of this process, every thread: the front door, node agent, predictor and
    load generator of the replay (the replicas are processes of their own)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _machine_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (``/proc/stat``'s ``cpu`` line: all but
    idle and iowait, in USER_HZ ticks); None where it cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(x) for x in fields[:8]]
    except (OSError, ValueError, IndexError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


QUIET_MARGIN_S = 1.0
"""Seconds after a request's answer still counted as its work (the release, the router's
and the predictor's bookkeeping) when telling the background CPU from the requests'."""


def contention_of(*, cpu_s: float, machine_busy_s: float | None, span_s: float,
                  requests: int, cap: int, threads: int, actual, scale,
                  cpu_samples: list[tuple[float, float]] | None = None,
                  outcomes: list | None = None) -> dict:
    """What the replay's own process took of the node during the window, and the speed it
    leaves the replicas (:func:`agent.sim.contention.shared_core_speed`): ``cpu_s`` (this
    process), ``background_cores`` (its CPU rate while no request was in flight, from
    ``cpu_samples`` and the ``outcomes``' spans: :func:`agent.sim.contention.background_cores`;
    0 without them), ``cpu_s_per_request`` (the rest, per request), ``machine_busy_cores``
    (every process, mean over the window; other users' work included), ``service_rps`` (one
    replica at the replay's batch at the calibrated speed) and ``speed``."""
    from agent.node.capacity import usable_cores
    from agent.sim.contention import background_cores, shared_core_speed

    background = 0.0
    if cpu_samples and outcomes:
        spans = [(o.sent_s, o.sent_s + (o.answered_ms or 0.0) / 1000.0 + QUIET_MARGIN_S)
                 for o in outcomes]
        background = background_cores(cpu_samples, spans)
    per_request = max(0.0, cpu_s - background * span_s) / max(1, requests)
    mu = actual.service_rps(scale.mean_prompt_tokens, scale.mean_output_tokens, scale.batch)
    speed = shared_core_speed(usable_cores(), cap, threads, mu, per_request, background)
    busy = None if machine_busy_s is None or span_s <= 0 else machine_busy_s / span_s
    return {"cpu_s": round(cpu_s, 2), "background_cores": round(background, 4),
            "cpu_s_per_request": round(per_request, 5),
            "machine_busy_cores": None if busy is None else round(busy, 2),
            "cores": usable_cores(), "service_rps": round(mu, 2), "speed": round(speed, 4)}


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


def zygote_estimate_s(restores_s: list[float]) -> float:
    """How long a restore that found no zygote ready waited for one, from a window's restore
    durations: the median excess over the median restore of those that took more than twice
    it (the node agent then starts a zygote first); 0 when none did."""
    typical = _median(restores_s)
    if typical is None:
        return 0.0
    slow = [d - typical for d in restores_s if d > 2.0 * typical]
    return _median(slow) or 0.0


def sustained_rps(rows: list[dict]) -> tuple[float | None, int]:
    """What the live node served while it was saturated: the mean first tokens per wall
    second over the seconds in which it refused requests (429) and refused in the seconds
    either side too (so the capacity, not a passing restore, was the limit), and how many
    such seconds there were; None when there were none.  ``rows``: a run's records."""
    reqs = [r for r in rows if r.get("kind") == "request"]
    refused = {int(r["sent_s"]) for r in reqs if r["code"] == 429}
    firsts: dict[int, int] = {}
    for r in reqs:
        if r["code"] == 200 and r.get("ttft_ms") is not None:
            t = int(r["sent_s"] + r["ttft_ms"] / 1000.0)
            firsts[t] = firsts.get(t, 0) + 1
    sat = [t for t in refused if t - 1 in refused and t + 1 in refused]
    if not sat:
        return None, 0
    return sum(firsts.get(t, 0) for t in sat) / len(sat), len(sat)


def resimulate(live_json: Path, records: Path, sustained: bool = False) -> list[dict]:
    """``--resim``: the simulator's side again for each run of an earlier ``--json`` file,
    its requests read from that run's ``--records`` file (``RECORDS.<load>.jsonl``); the
    live numbers are kept as they were measured.  ``sustained``: the simulated replicas
    serve at the speed that makes the node's capacity (``max_replicas`` x one replica's
    ``service_rps``) what the live node served while saturated (:func:`sustained_rps`),
    instead of the contention model's: whether the simulator's mechanics match the live
    run once its capacity is the one measured (``sim_capacity_from``)."""
    from agent.replica import DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_SEQS
    from agent.sim.replay_scale import ReplayRequest
    from agent.speed import SpeedProfile
    from agent.throughput import BacklogCapacity

    try:
        doc = json.loads(live_json.read_text())
        runs = doc.get("runs") or [doc]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--resim {live_json}: cannot read it as JSON ({exc})",
                          name="resim", value=str(live_json), limit="a --json file") from None
    out = []
    for run in runs:
        rec = records_path(records, run["load"], run.get("deadline_policy"))
        try:
            rows = [json.loads(line) for line in rec.read_text().splitlines() if line.strip()]
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--resim: records {rec}: cannot read them ({exc})",
                              name="records", value=str(rec), limit="a --records file") from None
        plan = [ReplayRequest(r["at_s"], r["prompt_tokens"], r["output_tokens"])
                for r in rows if r.get("kind") == "request"]
        profile = SpeedProfile.from_meta(run["profile"])
        if profile is None:
            raise ConfigError(f"--resim {live_json}: run at load {run['load']:g} has no profile",
                              name="profile", value=run.get("profile"), limit=SpeedProfile)
        scale = run["scale"]
        run = dict(run)
        cont = run.get("contention") or {}
        speed = cont.get("speed", 1.0)
        run["sim_capacity_from"] = "contention model (agent/sim/contention.py)"
        if sustained:
            live_rps, seconds = sustained_rps(rows)
            mu = cont.get("service_rps")
            if live_rps is not None and mu:
                speed = max(1e-3, min(1.0, live_rps / (run["max_replicas"] * mu)))
                run["sim_capacity_from"] = (f"the live node's saturated seconds ({seconds}): "
                                            f"{live_rps:.1f} first tokens/s")
        run["sim_replica_speed"] = speed
        run["sim"] = simulate(plan, profile, max_seqs=run.get("max_seqs") or DEFAULT_MAX_SEQS,
                              max_seq_len=run.get("max_seq_len") or DEFAULT_MAX_SEQ_LEN,
                              restore_s=run["restore_s"], cap=run["max_replicas"],
                              mean_prompt_tokens=scale["mean_prompt_tokens"],
                              mean_gen_tokens=scale["mean_output_tokens"],
                              span_s=scale["wall_s"], always_on_replicas=run["always_on_replicas"],
                              actual=SpeedProfile.from_meta(run.get("calibrated_profile") or {}),
                              replay_restores_s=run.get("replay_restores_s"),
                              deadline_factor=run.get("deadline_factor"),
                              shared_speed=speed,
                              sustained=BacklogCapacity.from_meta(run.get("sustained") or {}),
                              lengths=[(r.prompt_tokens, r.output_tokens) for r in plan])
        run["verdict"] = verdict(run)
        out.append(run)
    return out


def records_path(path: Path, load: float, policy: str | None) -> Path:
    """One run's ``--records`` file: ``PATH.<load>[.<policy>].jsonl``."""
    return path.with_name(f"{path.name}.{load:g}{'.' + policy if policy else ''}.jsonl")


def write_records(path: Path, load: float, policy: str, plan, outcomes, decisions) -> None:
    """``--records``: one line per request (plan and outcome) and per predictor decision."""
    target = records_path(path, load, policy)
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = decisions[0].at_s if decisions else 0.0
    with target.open("w") as f:
        for r, o in zip(plan, outcomes, strict=True):
            f.write(_json_line({"kind": "request", "at_s": r.at_s, "sent_s": o.sent_s,
                                "prompt_tokens": r.prompt_tokens,
                                "output_tokens": r.output_tokens, "code": o.code,
                                "path": o.path, "ttft_ms": o.ttft_ms,
                                "answered_ms": o.answered_ms, "reason": o.reason}))
        for d in decisions:
            f.write(_json_line({"kind": "decision", "t_s": d.at_s - t0, "action": d.action,
                                "target": d.target, "desired": d.desired, "reason": d.reason,
                                "forecast_rps": d.forecast_rps, "idle_s": d.idle_s,
                                "keepalive_s": d.keepalive_s, "cold_miss": d.cold_miss}))


def _json_line(row: dict) -> str:
    """One strict JSON line (RFC 8259 has no Infinity or NaN): a non-finite number, such as
    the idle time of a model that has seen no request yet, is written null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
             for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def verdict(r: dict) -> dict:
    """The replay's targets for one run (True/False per target; module docstring)."""
    n = max(1, r["requests"])
    t = r["ttft_ms"]
    p99 = lambda path: t.get(path, {}).get("p99")  # noqa: E731
    ok_p99 = lambda path, slo: p99(path) is None or p99(path) <= slo  # noqa: E731
    gpu = r["gpu_seconds"] <= r["always_on_gpu_seconds"]
    out = {"lost_0": r["lost"] == 0, "gpu_never_above_always_on": gpu}
    if r["load"] <= 1.0:
        out.update(sla_099=r["sla_attainment"] >= 0.99,
                   warm_p99_2000ms=ok_p99("warm_hit", WARM_SLO_MS),
                   restore_p99_4000ms=ok_p99("snapshot_restore", RESTORE_SLO_MS),
                   expired_under_0_5pct=r["expired_504"] <= 0.005 * n)
        if r.get("idle_minutes", 1):     # where the window has idle minutes to save
            out["gpu_under_0_8"] = r["gpu_seconds"] <= 0.8 * r["always_on_gpu_seconds"]
    else:
        unserved = r["requests"] - r["served"]
        out.update(served_p99_within_slo=ok_p99("warm_hit", WARM_SLO_MS)
                   and ok_p99("snapshot_restore", RESTORE_SLO_MS),
                   fast_429_95pct=unserved == 0 or r["shed_429_within_50ms"] >= 0.95 * unserved,
                   expired_under_1pct=r["expired_504"] <= 0.01 * n)
    s = r["sim"]
    within = lambda a, b, rel: (a is None and b is None) or (  # noqa: E731
        a is not None and b is not None and abs(a - b) <= rel * max(abs(a), 1e-9))
    out["sim_sla_within_1pp"] = abs(r["sla_attainment"] - s["sla_attainment"]) <= 0.01
    out["sim_gpu_within_10pct"] = within(r["gpu_seconds"], s["gpu_seconds"], 0.10)
    for path in ("warm_hit", "snapshot_restore"):
        for q in ("p50", "p99"):
            out[f"sim_{path}_{q}_within_25pct"] = within(
                t.get(path, {}).get(q), s["ttft_ms"].get(path, {}).get(q), 0.25)
    return out


def request_row(o) -> list:
    """One request of the replay, compact: ``[sent_s, code, answered_ms, ttft_ms,
    predicted_ttft_ms, path, replica, queue_wait_ms, reason]`` (ms at the client from its
    send; the prediction at the front door from its arrival)."""
    r = lambda x: None if x is None else round(x, 1)  # noqa: E731
    return [round(o.sent_s, 3), o.code, r(o.answered_ms), r(o.ttft_ms), r(o.predicted_ttft_ms),
            o.path, o.replica, r(o.queue_wait_ms), o.reason[:120]]


def prediction_error(outcomes) -> dict:
    """How the front door's predictions met what the clients saw, over the served requests
    that carried one: ``count``, and ``actual - predicted`` TTFT (ms) at p50, p99 and max
    (positive: optimistic)."""
    from agent.sim.replay import percentile

    errors = [o.ttft_ms - o.predicted_ttft_ms for o in outcomes
              if o.code == 200 and o.ttft_ms is not None and o.predicted_ttft_ms is not None]
    return {"count": len(errors), "p50_ms": percentile(errors, 50),
            "p99_ms": percentile(errors, 99), "max_ms": max(errors, default=None)}


def _ms(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def table(r: dict) -> str:
    s = r["sim"]
    lines = [f"load {r['load']:g}, deadline policy {r.get('deadline_policy', '-')} "
             f"(deadline_factor {r.get('deadline_factor', '-')}): {r['requests']} requests over {r['scale']['wall_s']:.0f} s "
             f"(speedup {r['speedup']:.2f}"
             f"{', held to keep idle gaps' if r['scale'].get('bound') == 'idle_gaps' else ''}, "
             f"token scale {r['token_scale']:.4f}); load average "
             f"{', '.join(f'{x:.1f}' for x in r['loadavg'])}",
             f"{'':<28}{'live':>12}{'simulated':>12}"]
    for key in ("served", "shed_429", "shed_429_within_50ms", "expired_504", "lost",
                "restores", "peak_replicas"):
        lines.append(f"{key:<28}{r.get(key, '-'):>12}{s.get(key, '-'):>12}")
    lines.append(f"{'sla_attainment':<28}{r['sla_attainment']:>12.4f}{s['sla_attainment']:>12.4f}")
    for path in ("warm_hit", "snapshot_restore", "cold_boot"):
        lt, st = r["ttft_ms"].get(path, {}), s["ttft_ms"].get(path, {})
        for q in ("p50", "p99"):
            lines.append(f"{'ttft ' + path + ' ' + q + ' ms':<28}{_ms(lt.get(q)):>12}"
                         f"{_ms(st.get(q)):>12}")
    lines.append(f"{'gpu_seconds':<28}{r['gpu_seconds']:>12.1f}{s['gpu_seconds']:>12.1f}")
    lines.append(f"{'always_on_gpu_seconds':<28}{r['always_on_gpu_seconds']:>12.1f}"
                 f"{s['always_on_gpu_seconds']:>12.1f}")
    lines.append(f"{'  (replicas; one replica)':<28}{r['always_on_replicas']:>5} "
                 f"{r['one_replica_gpu_seconds']:>6.1f}")
    cont = r.get("contention") or {}
    if cont:
        lines.append(f"{'stack CPU ms / request':<28}{cont['cpu_s_per_request'] * 1000:>12.2f}"
                     f"{'':>12}")
        lines.append(f"{'replica speed (shared)':<28}{'':>12}{cont['speed']:>12.3f}")
    pe = r.get("prediction") or {}
    if pe.get("count"):
        lines.append(f"{'ttft - predicted p50/p99 ms':<28}{_ms(pe['p50_ms']):>12}"
                     f"{_ms(pe['p99_ms']):>12}")
    failed = [k for k, v in r["verdict"].items() if not v]
    lines.append("targets: " + ("all met" if not failed else "NOT met: " + ", ".join(failed)))
    return "\n".join(lines)


def policy_table(results: list[dict]) -> str:
    """The deadline policies side by side, per load: live (and simulated) attainment, the
    fast refusals, the expired, the late-served and warm TTFT p99."""
    rows = [("sla_attainment", lambda r: f"{r['sla_attainment']:.3f}"),
            ("sim sla_attainment", lambda r: f"{r['sim']['sla_attainment']:.3f}"),
            ("served", lambda r: str(r["served"])),
            ("shed_429 (within 50 ms %)", lambda r: f"{r['shed_429']} ("
             f"{100.0 * r['shed_429_within_50ms'] / max(1, r['shed_429']):.1f})"),
            ("expired_504", lambda r: str(r["expired_504"])),
            ("lost", lambda r: str(r["lost"])),
            ("served past the SLO", lambda r: str(late_served(r))),
            ("warm TTFT p99 ms", lambda r: _ms(r["ttft_ms"].get("warm_hit", {}).get("p99"))),
            ("gpu_s / always-on", lambda r: f"{r['gpu_seconds'] / max(1e-9, r['always_on_gpu_seconds']):.2f}"),
            ("load average (1 min)", lambda r: f"{r['loadavg'][0]:.1f}")]
    out = []
    for load in sorted({r["load"] for r in results}):
        runs = [r for r in results if r["load"] == load]
        out.append(f"load {load:g}" + "".join(f"{r.get('deadline_policy', '-'):>14}"
                                              for r in runs))
        out.extend(f"  {name:<28}" + "".join(f"{cell(r):>14}" for r in runs)
                   for name, cell in rows)
    return "\n".join(out)


def result_tables(results: list[dict]) -> list[dict]:
    """bench/render_docs.py's ``tables``: per run, live beside simulated."""
    keys = ("requests", "served", "shed_429", "shed_429_within_50ms", "expired_504", "lost",
            "restores", "peak_replicas", "sla_attainment", "gpu_seconds",
            "always_on_gpu_seconds")
    out = []
    for r in results:
        rows = [[k, r.get(k), r["sim"].get(k)] for k in keys]
        for path in ("warm_hit", "snapshot_restore"):
            for q in ("p50", "p99"):
                rows.append([f"TTFT {path} {q} ms", r["ttft_ms"].get(path, {}).get(q),
                             r["sim"]["ttft_ms"].get(path, {}).get(q)])
        rows.append(["served past the SLO", late_served(r), late_served(r["sim"])])
        cont = r.get("contention") or {}
        failed = [k for k, v in r["verdict"].items() if not v]
        out.append({"title": f"load {r['load']:g}, deadline policy "
                             f"{r.get('deadline_policy', '-')} (deadline_factor "
                             f"{r.get('deadline_factor', '-')}), load average "
                             f"{' '.join(f'{x:.2f}' for x in r['loadavg'])}",
                    "columns": ["figure", "live", "simulated"], "rows": rows,
                    "notes": f"speedup {r['speedup']:.2f}, token scale {r['token_scale']:.5f}; "
                             f"stack CPU {cont.get('cpu_s_per_request', 0) * 1000:.2f} ms a "
                             f"request, simulated replica speed "
                             f"{r.get('sim_replica_speed', cont.get('speed', 1.0)):.3f} (from "
                             f"{r.get('sim_capacity_from', 'the contention model')}); targets "
                             + ("all met" if not failed else "not met: " + ", ".join(failed))})
    return out


def spread_table(results: list[dict]) -> dict | None:
    """The spread of SLA attainment over repeated runs of one load and deadline policy (live
    and simulated: max - min, percentage points), or None without a repeat."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["load"], r.get("deadline_policy")), []).append(r)
    rows = []
    for (load, policy), runs in groups.items():
        if len(runs) < 2:
            continue
        live = [r["sla_attainment"] for r in runs]
        sim = [r["sim"]["sla_attainment"] for r in runs]
        rows.append([f"{load:g}", policy, len(runs), " / ".join(f"{x:.4f}" for x in live),
                     round(100 * (max(live) - min(live)), 2),
                     round(100 * (max(sim) - min(sim)), 2)])
    if not rows:
        return None
    return {"title": "SLA attainment over repeated runs (each on a fresh stack)",
            "columns": ["load", "deadline policy", "runs", "SLA live per run",
                        "spread live (pp)", "spread sim (pp)"], "rows": rows}


def late_served(r: dict) -> int:
    """Requests served (200) with a first token past their path's SLO, live."""
    return sum(p.get("count", 0) - p.get("within_slo", p.get("count", 0))
               for p in r["ttft_ms"].values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.resim is not None:
        if args.records is None:
            print("error: --resim needs --records (the earlier run's records)", file=sys.stderr)
            return 2
        try:
            results = resimulate(args.resim, args.records, args.sustained)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        for r in results:
            say(table(r))
        args.trace = Path(results[0].get("trace", "trace")) if results else Path("trace")
        write_json(args, results)
        say(f"written to {args.json}")
        return 0
    if args.trace is None:
        print("error: --trace is required (or --resim)", file=sys.stderr)
        return 2
    from agent.sim.trace import read_trace
    from agent.up import prepare_model

    try:
        rows = read_trace(args.trace)
        window_s = args.minutes * 60.0
        win = rows.window(args.start_min * 60.0, window_s)
        if not len(win):
            raise ConfigError(f"trace {args.trace}: no request in minutes {args.start_min:g}"
                              f"-{args.start_min + args.minutes:g}", name="window", value=0,
                              limit=1)
        if args.profile:
            read_profile(args.profile)
        ns = argparse.Namespace(model_dir=None, no_aot=args.no_aot,
                                releases_dir=str(REPO / "var" / "releases"))
        model_dir, release, note = prepare_model(ns)
        results = []
        for load in args.load:
            for policy in args.deadline_policy:
                for repeat in range(args.repeat):
                    say(f"replay of {args.trace.name}, minutes {args.start_min:g}-"
                        f"{args.start_min + args.minutes:g} ({len(win)} requests) at load "
                        f"{load:g}, deadline policy {policy}, run {repeat + 1} of {args.repeat}")
                    results.append(run_one(args, load, policy, win, window_s, model_dir,
                                           release, note))
                    say(table(results[-1]))
                    write_json(args, results)   # after each run: a later failure keeps it
        say(policy_table(results))
    except (InvalidTrace, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except (RewarmError, RuntimeError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted (every replica was stopped)", file=sys.stderr)
        return 130
    say(f"written to {args.json}")
    return 0


def write_json(args, results: list[dict]) -> None:
    """``--json``: every run under ``runs`` (and the one run's keys at the top level)."""
    doc = {"trace": args.trace.name, "minutes": args.minutes, "start_min": args.start_min,
           "wall_s": args.wall_s, "runs": results}
    if len(results) == 1:
        doc.update(results[0])
    doc["title"] = (f"Live trace replay of {args.trace.name}, minutes {args.start_min:g}-"
                    f"{args.start_min + args.minutes:g}, beside the simulator, per load and "
                    "deadline policy")
    doc["tables"] = result_tables(results)
    spread = spread_table(results)
    if spread is not None:
        doc["tables"].insert(0, spread)
    doc["headline"] = [
        [f"SLA attainment at load {r['load']:g}, deadline {r.get('deadline_policy', '-')} "
         f"(sim {r['sim']['sla_attainment']:.3f}; load average {r['loadavg'][0]:.1f})",
         round(r["sla_attainment"], 3)] for r in results][:3]
    from bench.run_meta import run_meta   # command, machine, load average, date, commit

    doc["meta"] = run_meta()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1, default=float) + "\n")


if __name__ == "__main__":
    sys.exit(main())
