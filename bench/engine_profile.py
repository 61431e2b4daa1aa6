"""Measure the real engine on this machine and write the profile the simulator runs replicas at.

    bench/engine_profile.py [--model DIR] [--no-aot] [--trials 2] --json PATH

The model (default SmolLM2-135M, imported if missing) comes up through the path ``rewarm up``
uses: its AOT release for this CPU (``var/releases``, built once, shared with ``rewarm up``),
then ``rewarm replica --model-dir M --release R`` (cold boot), a capture, and restores of that
snapshot into a fresh process, into a waiting zygote and after staging from the remote tier.
The speed sweep runs in this process on the same ``zygote.boot`` (same forward, same torch
threads as a replica): prefill of one prompt across prompt lengths, and decode steps across
batch sizes and contexts, each timed with ``time.perf_counter`` (median of a few).  Least
squares over those points gives agent/speed.py's coefficients.  A run takes one to three
minutes on two loaded cores once the AOT package exists (building it takes a few more, once).

Output schema ``rewarm.engine_profile/1`` (:data:`agent.speed.PROFILE_SCHEMA`), one JSON object:

    schema              "rewarm.engine_profile/1"
    model, model_version, forward ("aot" | "eager"), threads
    engine              {max_seqs, max_seq_len, prefill_chunk, kv_capacity_tokens}
    speed               {prefill_tokens_per_s, prefill_overhead_s, decode_base_s,
                         decode_per_seq_s, decode_per_ctx_token_s}  (SpeedProfile.from_file)
    meter_speed         the replica's own online estimate after the sweep (same keys)
    fit                 {prefill_max_rel_err, decode_max_rel_err}: worst point off the fit
    check               a burst of mixed requests through the real engine (the worker's
                        admit/decode loop) against agent/sim/replica.py at the fitted speed:
                        {requests, ttft_rel_err_median, ttft_rel_err_max, done_rel_err_median,
                        done_rel_err_max}
    prefill             [{prompt_tokens, s}]                 medians measured
    decode              [{batch, context_tokens, step_s}]    context = cached tokens, all seqs
    kernels             [{n, k, m, int4_us, int8_us, bf16_us, fp32_us}]  each matmul kernel's
                        minimum time at M rows for SmolLM2's shapes (:func:`kernel_table`)
    startup             {naive_s, restore_s, zygote_restore_s, staged_restore_s}: [low, high]
                        seconds from request to ready (StartupTimes.from_json reads it)
    startup_trials_s    the same, every trial
    machine             {cpus, load_avg_1m, torch}
    wall_s              the run's own duration
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from agent.speed import PROFILE_SCHEMA, SPEED_META_KEYS, SpeedProfile  # noqa: E402

PROMPT_LENS = (8, 32, 128, 256, 448)
BATCHES = (1, 2, 4, 8)
CONTEXTS = (32, 192, 448)          # tokens cached per sequence when the step runs
DECODE_STEPS = 6
REPEATS = 5


def _median_time(fn, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def sweep(engine) -> tuple[list[dict], list[dict]]:
    """Prefill points ``[{prompt_tokens, s}]`` and decode points ``[{batch, context_tokens,
    step_s}]`` on an idle ``engine`` (left idle)."""
    vocab, room = engine.config.vocab_size, engine.kv.max_seq_len - DECODE_STEPS - 2
    prompt = lambda n, salt: [(13 * i + salt) % vocab for i in range(n)]  # noqa: E731
    prefill = []
    for n in PROMPT_LENS:
        n = min(n, room)

        def one(n=n):
            sid = engine.submit(prompt(n, n), 1)
            engine.admit()               # prefill + first token; max_tokens 1 ends it
            engine.cancel(sid)
        one()                            # untimed: first call at this shape
        prefill.append({"prompt_tokens": n, "s": _median_time(one)})
    decode = []
    for b in (x for x in BATCHES if x <= engine.kv.max_seqs):
        for c in CONTEXTS:
            c = min(c, room)
            ids = [engine.submit(prompt(c, 100 + i), DECODE_STEPS + 2) for i in range(b)]
            engine.admit()
            engine.decode()              # untimed
            ctx = engine.load.active_ctx_tokens
            steps = []
            for _ in range(DECODE_STEPS):
                t = time.perf_counter()
                engine.decode()
                steps.append(time.perf_counter() - t)
            for sid in ids:
                engine.cancel(sid)
            decode.append({"batch": b, "context_tokens": ctx + b * (DECODE_STEPS // 2),
                           "step_s": statistics.median(steps)})
    return prefill, decode


KERNEL_ROWS = (1, 8, 64)
KERNEL_SHAPES = ((576, 576), (960, 576), (576, 1536), (3072, 576), (49152, 576))
"""(N, K) of SmolLM2-135M's matrices: o_proj, fused q/k/v, down, fused gate/up, the tied LM head."""


def kernel_table(rounds_small: int = 40, rounds_large: int = 8) -> list[dict]:
    """Each weight-only kernel beside dense matmuls at M rows (``KERNEL_ROWS``) for every shape
    of ``KERNEL_SHAPES``: ``_weight_int4pack_mm_for_cpu`` (groups of 32), ``_weight_int8pack_mm``,
    and ``F.linear`` in bfloat16 and float32 (bfloat16 activations for the first three).  The
    four run in turn, round after round, and each keeps its minimum (us): on a shared machine
    the least disturbed call is the kernel's own cost.  Random codes: the kernels' time does
    not depend on the values."""
    import torch
    import torch.nn.functional as F

    out = []
    g = torch.Generator().manual_seed(0)
    for n, k in KERNEL_SHAPES:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g), 1)
        sz = torch.randn(k // 32, n, 2, generator=g).to(torch.bfloat16)
        w8 = torch.randint(-127, 127, (n, k), dtype=torch.int8, generator=g)
        s8 = torch.rand(n, generator=g).to(torch.bfloat16)
        wb = torch.randn(n, k, generator=g).to(torch.bfloat16)
        wf = wb.float()
        for m in KERNEL_ROWS:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            xf = x.float()
            calls = {"int4_us": (torch.ops.aten._weight_int4pack_mm_for_cpu, (x, packed, 32, sz)),
                     "int8_us": (torch._weight_int8pack_mm, (x, w8, s8)),
                     "bf16_us": (F.linear, (x, wb)), "fp32_us": (F.linear, (xf, wf))}
            best = dict.fromkeys(calls, float("inf"))
            with torch.inference_mode():
                for _ in range(rounds_large if n * k * m > 8_000_000 else rounds_small):
                    for name, (fn, fn_args) in calls.items():
                        t = time.perf_counter()
                        fn(*fn_args)
                        best[name] = min(best[name], time.perf_counter() - t)
            out.append({"n": n, "k": k, "m": m, **{kk: round(v * 1e6, 1) for kk, v in best.items()}})
    return out


def check(engine, profile: SpeedProfile, n: int = 12) -> dict:
    """The simulator's replica against the real engine: ``n`` requests of mixed prompt and
    output lengths submitted at once, run by the worker's loop (admit, send, decode, send)
    on the real forward and clock, and by :class:`agent.sim.replica.SimReplica` at
    ``profile``; relative errors of each request's first-token and completion times."""
    from agent.sim.replica import SimReplica

    vocab, room = engine.config.vocab_size, engine.kv.max_seq_len - 1
    reqs = [(i, min(room - 40, 16 + (97 * i) % 300), 4 + (13 * i) % 36) for i in range(n)]
    ids = {engine.submit([(7 * j + i) % vocab for j in range(p)], o): i for i, p, o in reqs}
    first, done, t0 = {}, {}, time.perf_counter()
    while engine.busy:
        for ev in engine.admit():
            first.setdefault(ids[ev.seq_id], time.perf_counter() - t0)
            if ev.done:
                done[ids[ev.seq_id]] = time.perf_counter() - t0
        for ev in engine.decode():
            if ev.done:
                done[ids[ev.seq_id]] = time.perf_counter() - t0
    sim = SimReplica(profile, engine.kv.max_seqs)
    for r in reqs:
        sim.submit(*r)
    t, sim_first, sim_done = 0.0, {}, {}
    while sim.busy:
        firsts, t = sim.start_step(t)
        sim_first.update(dict(firsts))
        sim_done.update({r: t for r in sim.end_step()})
    e_first = sorted(abs(sim_first[i] - first[i]) / first[i] for i in first)
    e_done = sorted(abs(sim_done[i] - done[i]) / done[i] for i in done)
    return {"requests": n, "ttft_rel_err_median": round(statistics.median(e_first), 4),
            "ttft_rel_err_max": round(e_first[-1], 4),
            "done_rel_err_median": round(statistics.median(e_done), 4),
            "done_rel_err_max": round(e_done[-1], 4)}


def nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``theta >= 0`` minimising the squared *relative* error ``sum(((x theta - y) / y)^2)``
    (timing noise is multiplicative): least squares on every subset of free coefficients,
    the others held at 0, keeping the best feasible one (exact for the 2-3 coefficients
    here; Lawson & Hanson, "Solving Least Squares Problems", 1974, ch. 23)."""
    from itertools import combinations

    xw, yw = x / y[:, None], np.ones_like(y)
    n = x.shape[1]
    best, best_r = np.zeros(n), float(np.sum(yw ** 2))
    for k in range(1, n + 1):
        for free in combinations(range(n), k):
            theta = np.zeros(n)
            theta[list(free)] = np.linalg.lstsq(xw[:, free], yw, rcond=None)[0]
            if (theta < 0).any():
                continue
            r = float(np.sum((xw @ theta - yw) ** 2))
            if r < best_r:
                best, best_r = theta, r
    return best


def fit(prefill: list[dict], decode: list[dict]) -> tuple[SpeedProfile, dict]:
    """agent/speed.py's two linear models fitted to the measured points (non-negative, by
    relative error: :func:`nnls_relative`); returns the profile and the worst relative error
    of the fit at any point."""
    xp = np.array([[1.0, p["prompt_tokens"]] for p in prefill])
    yp = np.array([p["s"] for p in prefill])
    overhead, per_token = nnls_relative(xp, yp)
    xd = np.array([[1.0, d["batch"] - 1, d["context_tokens"]] for d in decode])
    yd = np.array([d["step_s"] for d in decode])
    base, per_seq, per_ctx = nnls_relative(xd, yd)
    profile = SpeedProfile(prefill_tokens_per_s=1.0 / max(float(per_token), 1e-9),
                           prefill_overhead_s=max(0.0, float(overhead)),
                           decode_base_s=max(1e-6, float(base)),
                           decode_per_seq_s=max(0.0, float(per_seq)),
                           decode_per_ctx_token_s=max(0.0, float(per_ctx)))
    err_p = max(abs(profile.prefill_s(p["prompt_tokens"]) - p["s"]) / p["s"] for p in prefill)
    err_d = max(abs(profile.decode_step_s(d["batch"], d["context_tokens"]) - d["step_s"])
                / d["step_s"] for d in decode)
    return profile, {"prefill_max_rel_err": round(err_p, 4), "decode_max_rel_err": round(err_d, 4)}


def startup_times(model: Path, release: Path | None, work: Path, trials: int) -> dict:
    """Seconds from request to ready per tier: cold boot (``naive_s``), snapshot restore into a
    fresh process (``restore_s``), into a waiting zygote (``zygote_restore_s``), and staging
    from the remote tier then a zygote restore (``staged_restore_s``)."""
    import subprocess

    import bench.cold_start as cs
    from agent.replica.worker import call
    from agent.snapshot.remote import push, stage

    cs.PROMPT_IDS[:] = cs.prompt_tokens(model)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    boot = ["--model-dir", str(model)] + (["--release", str(release)] if release else [])
    out: dict[str, list[float]] = {"naive_s": [], "restore_s": [], "zygote_restore_s": [],
                                   "staged_restore_s": []}
    for _ in range(trials):
        r = cs.trial_process(work, boot, env)
        out["naive_s"].append(r["total_s"] - r["phases"]["first_token_s"])
    snapshot, sock = work / "snapshot", work / "capture.sock"
    proc = subprocess.Popen(cs.replica_cmd(f"unix:{sock}", *boot), cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        json.loads(proc.stdout.readline())
        captured = call(f"unix:{sock}", {"op": "capture", "id": "c", "dest": str(snapshot)},
                        timeout_s=600)[-1]
    finally:
        cs.stop(proc, f"unix:{sock}")
    buffer_mib = -(-captured["result"]["total_bytes"] // (1 << 20)) + 1
    remote = push(snapshot, work / "remote")
    for i in range(trials):
        r = cs.trial_process(work, ["--snapshot", str(snapshot)], env)
        out["restore_s"].append(r["total_s"] - r["phases"]["first_token_s"])
        r = cs.trial_zygote(work, snapshot, buffer_mib, env)
        zyg = r["total_s"] - r["phases"]["first_token_s"]
        out["zygote_restore_s"].append(zyg)
        t = time.perf_counter()
        stage(remote, work / f"staged-{i}")
        out["staged_restore_s"].append(time.perf_counter() - t + zyg)
    return {k: [round(x, 3) for x in v] for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None,
                        help="HF-layout model dir (default: SmolLM2-135M, imported if missing)")
    parser.add_argument("--no-aot", action="store_true", help="eager forward (no AOT package)")
    parser.add_argument("--releases-dir", type=Path, default=REPO / "var" / "releases")
    parser.add_argument("--trials", type=int, default=2, help="start-up trials per tier")
    parser.add_argument("--skip-startup", action="store_true", help="speed only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (all cores)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=REPO / "var" / "bench" / "engine_profile")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials {args.trials} must be >= 1")
    wall0 = time.perf_counter()
    import torch

    from agent.node.backend import ModelSpec
    from agent.replica import zygote
    from agent.up import prepare_release

    if args.model is None:
        from agent.replica.smollm2 import ensure_smollm2
        model = ensure_smollm2()
    else:
        model = args.model
    spec = ModelSpec(model)
    release = None
    if not args.no_aot:
        release, note = prepare_release(model, args.releases_dir / f"{spec.name}-{spec.version}",
                                        cache_dir=args.releases_dir / "build-cache")
        print(f"forward: {note}", file=sys.stderr)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    loaded = zygote.boot(model, release=release)
    engine = loaded.engine
    prefill, decode = sweep(engine)
    profile, quality = fit(prefill, decode)
    out = {"schema": PROFILE_SCHEMA, "model": spec.name, "model_version": spec.version,
           "forward": loaded.path, "threads": torch.get_num_threads(),
           "engine": {"max_seqs": engine.kv.max_seqs, "max_seq_len": engine.kv.max_seq_len,
                      "prefill_chunk": engine.prefill_chunk,
                      "kv_capacity_tokens": engine.kv.capacity_tokens},
           "speed": profile.to_dict(), "meter_speed": engine.meter.profile().to_dict(),
           "fit": quality, "check": check(engine, profile), "prefill": prefill,
           "decode": decode, "kernels": kernel_table()}
    del loaded, engine
    if not args.skip_startup:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
        work = Path(tempfile.mkdtemp(dir=args.work))
        trials = startup_times(model, release, work, args.trials)
        out["startup"] = {k: [min(v), max(v)] for k, v in trials.items()}
        out["startup_trials_s"] = trials
    out["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                      "torch": torch.__version__}
    out["wall_s"] = round(time.perf_counter() - wall0, 1)
    from bench.run_meta import run_meta

    out["meta"] = run_meta([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    out["tables"] = tables(out)
    out["headline"] = headline(out)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print_table(out)
    return 0


def headline(out: dict) -> list[list]:
    """The decode step at one and at the largest batch (shortest context, median ms) and the
    fitted prefill rate."""
    steps = {}
    for d in out["decode"]:
        steps.setdefault(d["batch"], d)       # the first (shortest) context of each batch
    rows = [[f"decode step ms, batch {b}, {steps[b]['context_tokens']} tokens cached",
             round(steps[b]["step_s"] * 1e3, 2)] for b in sorted({min(steps), max(steps)})]
    return rows + [["prefill tokens/s (fit)", round(out["speed"]["prefill_tokens_per_s"], 1)]]


def tables(out: dict) -> list[dict]:
    """The measured points beside the fit, for bench/render_docs.py."""
    sp = SpeedProfile(**out["speed"])
    return [{"title": f"Prefill, one prompt ({out['forward']}, {out['threads']} threads)",
             "columns": ["prompt tokens", "prefill ms (median)", "fit ms"],
             "rows": [[p["prompt_tokens"], round(p["s"] * 1e3, 2),
                       round(sp.prefill_s(p["prompt_tokens"]) * 1e3, 2)] for p in out["prefill"]]},
            {"title": "Decode step, every active sequence together",
             "columns": ["batch", "context tokens (all sequences)", "step ms (median)", "fit ms"],
             "rows": [[d["batch"], d["context_tokens"], round(d["step_s"] * 1e3, 2),
                       round(sp.decode_step_s(d["batch"], d["context_tokens"]) * 1e3, 2)]
                      for d in out["decode"]]},
            {"title": "Fitted speed (agent/speed.py's SpeedProfile)", "columns": ["key", "value"],
             "rows": [[k, round(v, 6)] for k, v in out["speed"].items()]},
            {"title": "Matmul kernels at M rows, minimum of interleaved rounds (us)",
             "columns": ["N x K", "M", "int4", "int8", "bf16 dense", "fp32 dense"],
             "rows": [[f"{r['n']} x {r['k']}", r["m"], r["int4_us"], r["int8_us"], r["bf16_us"],
                       r["fp32_us"]] for r in out.get("kernels", [])]}]


def print_table(out: dict) -> None:
    sp = SpeedProfile(**out["speed"])
    print(f"{out['model']} ({out['forward']}, {out['threads']} threads, load avg "
          f"{out['machine']['load_avg_1m']}), engine {out['engine']}")
    print(f"{'prompt tokens':>14} {'prefill ms':>11} {'fit ms':>8}")
    for p in out["prefill"]:
        print(f"{p['prompt_tokens']:>14} {p['s'] * 1e3:>11.2f} {sp.prefill_s(p['prompt_tokens']) * 1e3:>8.2f}")
    print(f"{'batch':>6} {'context':>8} {'step ms':>8} {'fit ms':>8}")
    for d in out["decode"]:
        print(f"{d['batch']:>6} {d['context_tokens']:>8} {d['step_s'] * 1e3:>8.2f} "
              f"{sp.decode_step_s(d['batch'], d['context_tokens']) * 1e3:>8.2f}")
    print("speed (fit):  " + ", ".join(f"{k}={out['speed'][k]:.4g}" for k in SPEED_META_KEYS))
    print("speed (meter): " + ", ".join(f"{k}={out['meter_speed'][k]:.4g}" for k in SPEED_META_KEYS))
    print(f"fit: {out['fit']}")
    print(f"real engine vs simulated replica, one burst: {out['check']}")
    for tier, (lo, hi) in out.get("startup", {}).items():
        print(f"{tier:<18} {lo:>7.2f} .. {hi:.2f} s")
    print(f"wall_s {out['wall_s']}")


if __name__ == "__main__":
    sys.exit(main())
