"""Where a zygote restore's time goes, span by span, golden check included.

    bench/golden_profile.py --snapshot DIR [--trials 3] [--threads same,cross] --json PATH

Each trial is a fresh process that does what ``rewarm replica --zygote --warm SNAPSHOT`` and
its ``restore`` op do, in process (no socket): torch's intra-op threads set, the zygote
prepared and warmed for the snapshot (agent/replica/zygote.py ``prepare_zygote``), then the
clock: ``zygote.restore`` into its buffer, and one greedy first token of PROMPT (the request
bench/cold_start.py sends: a B=1 prefill).  After the clock, the check is replayed three more
times on the same engine to give each forward call's steady cost.

``--threads`` chooses which thread runs what: ``same`` (what the worker does: the zygote's
warm-up, the restore and serving all on the one engine thread) or ``cross`` (the warm-up on
the main thread, the restore on the engine thread, as the worker did before; two threads
that each run OpenMP regions make two OpenMP teams in one process).

Spans are taken by wrapping, in the child process only, the functions the restore calls
(``restore_snapshot``, ``verify_golden``, ``Engine.teacher_forced``, ``_lockstep_seqs``,
``_slots``, the forward calls per input shape B,S — ``_prefill_rows`` (the replay's, with the
logits of every position), ``_decode_rows`` and ``Engine._prefill_chunks`` (the logits of the
last position only), each with its few input tensors' set-up —, ``Engine._sample`` and
the replay's ``sample_positions``, and
Python's cyclic garbage collector); ``golden other``
is what golden_s holds beyond them (validation, slicing, comparison).  Each figure is the median
over the trials, in ms, printed as a table and written to ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = "The capital of France is"   # bench/cold_start.py's request


def child(snapshot: Path, threads_mode: str, torch_threads: int) -> dict:
    """One trial in this (fresh) process; returns ``{"spans": {name: ms}, ...}``."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from agent.replica import golden, lockstep, zygote
    from agent.replica.engine import Engine
    from agent.snapshot import reader

    stage = ["warm"]
    spans: dict[str, float] = {}

    def add(name: str, seconds: float) -> None:
        key = f"{stage[0]}: {name}"
        spans[key] = spans.get(key, 0.0) + seconds * 1e3

    def timed(owner, attr: str, name=None):
        original = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                add(name(args) if callable(name) else (name or attr), time.perf_counter() - t)
        setattr(owner, attr, wrapper)

    timed(reader, "restore_snapshot")
    read_stats: list = []
    restore_snapshot = reader.restore_snapshot

    def keep_stats(*args, **kwargs):   # how the weights were read: page cache or O_DIRECT
        restored = restore_snapshot(*args, **kwargs)
        read_stats.append(restored.stats)
        return restored
    reader.restore_snapshot = keep_stats
    timed(golden, "verify_golden")
    timed(lockstep.Lockstep, "teacher_forced")
    timed(lockstep.Lockstep, "_lockstep_seqs", "submit seqs")
    # the forward calls, by input shape (eager or packaged alike), tensor set-up included
    timed(lockstep.Lockstep, "_prefill_rows",
          lambda a: "forward B,S=%d,%d" % (len(a[1]), max(len(r) for r in a[1])))
    timed(lockstep.Lockstep, "_decode_rows", lambda a: "forward B,S=%d,1" % len(a[1]))
    timed(Engine, "_prefill_chunks", lambda a: "forward B,S=1,%d" % len(a[1].prompt))
    timed(Engine, "_sample", "sample")
    timed(lockstep, "sample_positions", "sample")   # the replay's draws, one transfer a group
    slots = lockstep.Lockstep._slots

    @contextlib.contextmanager
    def timed_slots(self, group):
        t = time.perf_counter()
        with slots(self, group) as idx:
            add("slots", time.perf_counter() - t)
            yield idx
    lockstep.Lockstep._slots = timed_slots

    import gc

    def collected(phase, info):   # Python's cyclic collector, per generation, while timed
        if phase == "start":
            collected.t = time.perf_counter()
        elif stage[0] in ("restore", "first token"):
            add(f"gc gen{info['generation']}", time.perf_counter() - collected.t)
    gc.callbacks.append(collected)

    from agent.snapshot.reader import read_manifest
    manifest = read_manifest(snapshot)
    torch.set_num_threads(torch_threads)
    engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
    on_engine = lambda fn: engine_thread.submit(fn).result()   # noqa: E731
    warm_on = on_engine if threads_mode == "same" else (lambda fn: fn())
    buffer = warm_on(lambda: zygote.prepare_zygote(torch_threads, manifest.total_bytes + (1 << 20),
                                                   warm=snapshot))
    if zygote._WARMED.get(buffer) is None:
        raise RuntimeError(f"the zygote could not warm for {snapshot} (see the log)")
    prompt = list(manifest.golden.prompts[0])   # a model without a tokenizer: its first golden prompt
    tok_dir = (manifest.extra or {}).get("tokenizer_dir")
    if tok_dir and (Path(tok_dir) / "tokenizer.json").is_file():
        from agent.replica.tokenizer import load_tokenizer
        prompt = load_tokenizer(tok_dir).encode(PROMPT).ids

    def restore_to_first_token() -> dict:
        stage[0] = "restore"
        t0 = time.perf_counter()
        loaded = zygote.restore(snapshot, buffer=buffer, path="zygote_restore")
        t1 = time.perf_counter()
        stage[0] = "first token"
        engine = loaded.engine
        engine.submit(prompt, 1)
        first = engine.admit()[0].token
        t2 = time.perf_counter()
        stage[0] = "steady"
        engine.submit(prompt, 1)     # the same request again: its steady cost
        engine.admit()
        g = loaded.golden
        for _ in range(3):
            engine.teacher_forced([list(p) for p in g.prompts], [list(r) for r in g.expected], seed=g.seed)
        for key in [k for k in spans if k.startswith("steady: ")]:
            if not key.startswith(f"steady: forward B,S=1,{len(prompt)}"):
                spans[key] /= 3         # three replays of the check
        return {"restore_ms": (t1 - t0) * 1e3, "first_token_ms": (t2 - t1) * 1e3,
                "phases_ms": {k: v * 1e3 for k, v in loaded.phases_s.items()}, "first": first}

    out = on_engine(restore_to_first_token)
    out["spans"] = spans
    stats = read_stats[-1]
    out["weights_read"] = {"bytes": stats.bytes, "direct_chunks": stats.direct_chunks,
                           "chunks": stats.chunks, "gbps": stats.bytes / max(stats.seconds, 1e-9) / 1e9}
    out["total_ms"] = out["restore_ms"] + out["first_token_ms"]
    return out


def derived(trial: dict) -> dict[str, float]:
    """The table's rows for one trial (ms)."""
    s, ph = trial["spans"], trial["phases_ms"]
    rows = {"zygote_restore (restore + first token)": trial["total_ms"],
            "weights_s (restore_snapshot)": ph.get("weights_s", 0.0),
            "package_s": ph.get("package_s", 0.0), "golden_s": ph.get("golden_s", 0.0),
            "first token (B=1 prefill + sample)": trial["first_token_ms"]}
    for key in sorted(s):
        stage, _, name = key.partition(": ")
        if stage == "restore" and name.startswith("gc "):
            rows[f"restore: {name} (any phase)"] = s[key]
        elif stage == "restore" and name not in ("restore_snapshot", "verify_golden", "teacher_forced"):
            rows[f"  golden: {name}"] = s[key]
        elif stage == "first token" or (stage in ("warm", "steady") and name.startswith("forward")):
            rows[key] = s[key]
    known = sum(v for k, v in rows.items() if k.startswith("  golden: "))
    rows["  golden: other (validation, slicing, compare)"] = ph.get("golden_s", 0.0) - known
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--snapshot", required=True, help="a captured replica snapshot")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", default="same,cross", help="same and/or cross (see above)")
    parser.add_argument("--torch-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", required=True)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.snapshot), args.child, args.torch_threads)))
        return 0
    modes = args.threads.split(",")
    if set(modes) - {"same", "cross"}:
        parser.error(f"--threads takes same and/or cross, not {args.threads!r}")
    out: dict = {"snapshot": args.snapshot, "trials": args.trials,
                 "load_average_start": round(os.getloadavg()[0], 2), "modes": {}}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for mode in modes:
        trials = []
        for i in range(args.trials):
            proc = subprocess.run([sys.executable, __file__, "--snapshot", args.snapshot,
                                   "--json", "-", "--child", mode, "--torch-threads",
                                   str(args.torch_threads)], cwd=REPO, env=env,
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            trials.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"{mode} trial {i}: {trials[-1]['total_ms']:.0f} ms", file=sys.stderr, flush=True)
        rows = [derived(t) for t in trials]
        keys = list(dict.fromkeys(k for r in rows for k in r))
        out["modes"][mode] = {k: round(statistics.median(r.get(k, 0.0) for r in rows), 1) for k in keys}
        out["modes"][mode]["first_tokens"] = sorted({t["first"] for t in trials})
        out["modes"][mode]["weights_read"] = [t["weights_read"] for t in trials]
    out["load_average_end"] = round(os.getloadavg()[0], 2)
    if args.json != "-":
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average (1 min) {out['load_average_start']:.2f} at the start, "
          f"{out['load_average_end']:.2f} at the end; median of {args.trials} fresh processes, ms")
    keys = list(dict.fromkeys(k for m in modes for k in out["modes"][m]
                              if k not in ("first_tokens", "weights_read")))
    print(f"{'span':<48}" + "".join(f"{m:>10}" for m in modes))
    for k in keys:
        print(f"{k:<48}" + "".join(f"{out['modes'][m].get(k, 0.0):>10.1f}" for m in modes))
    for m in modes:
        reads = out["modes"][m]["weights_read"]
        print(f"{m}: weights read at " + ", ".join(f"{r['gbps']:.1f}" for r in reads) + " GB/s, "
              + ", ".join(f"{r['direct_chunks']}/{r['chunks']}" for r in reads) + " chunks O_DIRECT")
    return 0


if __name__ == "__main__":
    sys.exit(main())
