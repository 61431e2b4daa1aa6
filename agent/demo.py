"""``rewarm up --demo``: what a client sees from a scale-to-zero model, end to end, over TCP.

Phases (against the :class:`agent.up.Stack` started here):

1. the first request: no snapshot exists, so the node agent cold-boots a replica, it answers,
   and its snapshot is captured, verified and marked ready (in the background);
2. idle: the predictor (started after phase 1) scales the model to zero once the keep-alive
   allows — the demo shortens the keep-alive's inputs (:data:`DEMO_POLICY`) so this takes
   seconds instead of minutes, and says so;
3. the same probe request again (answered by a snapshot restore; its tokens must equal phase
   1's), then a replay of the Azure LLM code trace, time-compressed by ``--speedup``, with
   prompt and output lengths divided to fit a small model on two CPU cores
   (:func:`scale_lengths`);
4. the table (:func:`format_table`) and, with ``--json PATH``, the numbers (:func:`summarise`).

Outcome classes per request: 200 → served (counted by the ``path`` the front door reports),
429 → ``shed``, 504 → ``expired``, anything else (503, a broken connection, no answer) →
``lost``, which must stay 0.  GPU-seconds are replica-seconds here (replicas alive, sampled
every ``SAMPLE_S``), against one always-on replica over the same wall-clock span.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.errors import ConfigError, RewarmError

PATHS = ("cold_boot", "snapshot_restore", "suspended_resume", "warm_hit")
PROBE_TEXT = "The capital of France is"
PROBE_MAX_TOKENS = 12
PROMPT_DIV, OUTPUT_DIV = 64, 4          # trace tokens per demo token
MAX_PROMPT, MAX_OUTPUT = 64, 16
MAX_REPLAY_REQUESTS = 5000
SAMPLE_S = 0.25
# Keep-alive inputs shortened for the demo (the production defaults are the design document's
# $2.80/GPU-hour, a 600 s rate window and a 30 s cooldown, which keep an idle replica minutes).
DEMO_POLICY_TEXT = ("demo keep-alive: GPU cost 0.05/s, wait cost 0.01/s, restore 2 s, "
                    "rate window 20 s, cooldown 10 s (production: 2.80/h, 600 s, 30 s); "
                    "at most 1 replica on this machine")


def demo_policy() -> dict[str, Any]:
    """:class:`~agent.predictor.loop.ModelPolicy` overrides that shorten the keep-alive."""
    from agent.predictor.keepalive import KeepAliveCosts

    return {"scale_down_cooldown_s": 10.0, "rate_window_s": 20.0, "max_replicas": 1,
            "costs": KeepAliveCosts(gpu_cost_per_s=0.05, suspended_cost_per_s=0.0025,
                                    wait_cost_per_s=0.01, restore_s=2.0)}


@dataclass(frozen=True)
class ReplayRequest:
    """One request to send ``at_s`` wall seconds after the replay starts."""

    at_s: float
    prompt_tokens: int
    output_tokens: int


def scale_lengths(context_tokens: int, generated_tokens: int) -> tuple[int, int]:
    """Trace lengths → demo lengths: ``clamp(round(ctx / 64), 4, 64)`` prompt tokens and
    ``clamp(round(gen / 4), 1, 16)`` output tokens (the code trace's median 1469/13 becomes
    23/3)."""
    prompt = min(MAX_PROMPT, max(4, round(context_tokens / PROMPT_DIV)))
    output = min(MAX_OUTPUT, max(1, round(generated_tokens / OUTPUT_DIV)))
    return prompt, output


def replay_plan(trace: Path, *, replay_s: float, speedup: float,
                max_requests: int = MAX_REPLAY_REQUESTS) -> list[ReplayRequest]:
    """The first ``replay_s * speedup`` trace seconds, compressed ``speedup`` times.

    Reads the trace with :func:`agent.sim.trace.load_trace` (which validates every field and
    raises InvalidTrace).  Raises ConfigError for ``replay_s``/``speedup`` not > 0 or a window
    of more than ``max_requests`` requests."""
    from agent.errors import InvalidTrace
    from agent.sim.trace import TokenTiming, load_trace

    if not Path(trace).is_file():
        raise InvalidTrace(f"trace {trace} not found (pass --trace PATH)", path=trace, line=None,
                           field="path", value=str(trace), limit="an existing file")
    for name, value in (("replay_s", replay_s), ("speedup", speedup)):
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name}={value}; limit is > 0", name=name, value=value, limit="> 0")
    # prefill at 1 token/s makes prefill_s the prompt length; need_tokens - prompt the output.
    w = load_trace(trace, timing=TokenTiming(prefill_tokens_per_s=1.0))
    end_s = replay_s * speedup
    out = []
    for i in range(len(w)):
        if w.arrival_s[i] >= end_s:
            break
        if len(out) >= max_requests:
            raise ConfigError(f"replay window {end_s} trace s holds more than max_requests "
                              f"({max_requests}); lower --replay-s or --speedup",
                              name="max_requests", value=len(out) + 1, limit=max_requests)
        ctx = int(round(w.prefill_s[i]))
        prompt, output = scale_lengths(ctx, int(w.need_tokens[i]) - ctx)
        out.append(ReplayRequest(float(w.arrival_s[i]) / speedup, prompt, output))
    return out


@dataclass
class Outcome:
    """One request as the client saw it: ``code`` 200 on success; ``ttft_ms`` measured at
    the client (None unless served); ``path`` from the front door's ``done``."""

    code: int
    path: str | None = None
    ttft_ms: float | None = None
    tokens: list[int] = field(default_factory=list)
    reason: str = ""


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[k]


def summarise(outcomes: list[Outcome], *, restores: list[dict], golden: dict[str, int],
              gpu_seconds: float, always_on_gpu_seconds: float, example_completion: str,
              extra: dict | None = None) -> dict[str, Any]:
    """The demo's numbers (the ``--json`` document).

    ``restores``: the catalog's cold-start rows (path, outcome, duration_s) plus optional
    ``phases_s``; ``golden``: ``{"passed": n, "failed": n}``.  Keys: requests_by_path,
    ttft_ms {path: {p50, p99}}, golden_checks_passed/failed, shed, expired, lost, gpu_seconds,
    always_on_gpu_seconds, example_completion, restores, requests."""
    by_path = {p: 0 for p in PATHS}
    ttft: dict[str, list[float]] = {p: [] for p in PATHS}
    shed = expired = lost = 0
    for o in outcomes:
        if o.code == 200:
            path = o.path if o.path in by_path else "warm_hit"
            by_path[path] += 1
            if o.ttft_ms is not None:
                ttft[path].append(o.ttft_ms)
        elif o.code == 429:
            shed += 1
        elif o.code == 504:
            expired += 1
        else:
            lost += 1
    return {
        "requests": len(outcomes),
        "requests_by_path": by_path,
        "ttft_ms": {p: {"p50": percentile(v, 50), "p99": percentile(v, 99)}
                    for p, v in ttft.items()},
        "golden_checks_passed": int(golden.get("passed", 0)),
        "golden_checks_failed": int(golden.get("failed", 0)),
        "shed": shed, "expired": expired, "lost": lost,
        "gpu_seconds": round(gpu_seconds, 2),
        "always_on_gpu_seconds": round(always_on_gpu_seconds, 2),
        "example_completion": example_completion,
        "restores": restores,
        **(extra or {}),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def format_table(s: dict[str, Any]) -> str:
    """The human table for a :func:`summarise` document."""
    lines = ["", "rewarm demo: requests as a client saw them", "",
             f"{'path':<18}{'requests':>9}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}"]
    for p in PATHS:
        t = s["ttft_ms"][p]
        lines.append(f"{p:<18}{s['requests_by_path'][p]:>9}{_ms(t['p50']):>13}{_ms(t['p99']):>13}")
    lines.append("")
    restores = [r for r in s["restores"] if r.get("outcome") == "ok"]
    for r in restores:
        phases = " ".join(f"{k.removesuffix('_s')} {v:.2f}s"
                          for k, v in (r.get("phases_s") or {}).items())
        lines.append(f"{r['path']:<18} {r['duration_s']:.2f} s" + (f"  ({phases})" if phases else ""))
    failed = [r for r in s["restores"] if r.get("outcome") != "ok"]
    for r in failed:
        lines.append(f"{r['path']:<18} {r['outcome']}")
    saved = s["always_on_gpu_seconds"] - s["gpu_seconds"]
    lines += [
        "",
        f"golden checks       {s['golden_checks_passed']} passed, {s['golden_checks_failed']} failed",
        f"probe tokens        {'identical after restore' if s.get('probe_match') else 'DIFFER or not checked'}",
        f"shed (429)          {s['shed']}",
        f"expired (504)       {s['expired']}",
        f"lost                {s['lost']}",
        f"GPU-seconds         {s['gpu_seconds']:.1f} used vs {s['always_on_gpu_seconds']:.1f} "
        f"always-on ({saved:.1f} saved; replica-seconds on this CPU machine)",
        f"forward             {s.get('forward', '?')}",
        "",
        f"example completion  {s['example_completion']!r}",
        "",
    ]
    return "\n".join(lines)


class Sampler:
    """Replica-seconds: every ``SAMPLE_S``, replicas of the agent not dead (cold-booting,
    restoring, warm, suspended, draining) times the interval; also each restored replica's
    load phases (``phases_s`` from its ``stats``)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.replica_s = 0.0
        self.peak = 0
        self.phases: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-sampler", daemon=True)
        self.started_s = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(SAMPLE_S):
            now = time.monotonic()
            with self.agent._lock:
                recs = list(self.agent.replicas.values())
            alive = [r for r in recs if r.lifecycle.state.value != "dead"]
            self.replica_s += len(alive) * (now - last)
            self.peak = max(self.peak, len(alive))
            last = now
            for r in alive:
                rid = r.lifecycle.replica_id
                if r.lifecycle.state.value == "warm" and rid not in self.phases and r.handle:
                    try:
                        self.phases[rid] = {"path": r.path, **(r.handle.stats().get("phases_s") or {})}
                    except (OSError, RewarmError, RuntimeError):
                        pass

    def stop(self) -> float:
        """Stop sampling; returns the wall seconds sampled."""
        self._stop.set()
        self._thread.join()
        return time.monotonic() - self.started_s


def golden_counts(agent) -> dict[str, int]:
    """Golden checks the replicas ran: each snapshot restore that served passed one; each
    restore attempt that failed with GoldenMismatch failed one."""
    passed = failed = 0
    with agent._lock:
        recs = list(agent.replicas.values())
    for r in recs:
        if r.path in ("restore", "staged_restore") and r.handle is not None:
            passed += 1
        failed += sum(1 for a in r.attempts if a.get("error") == "GoldenMismatch")
    return {"passed": passed, "failed": failed}


async def _one(client, model: str, tokens: list[int], max_tokens: int) -> Outcome:
    start = time.perf_counter()
    out = Outcome(code=0)
    try:
        async for msg in client.stream(model, tokens=tokens, max_tokens=max_tokens):
            if msg["type"] == "tokens":
                if out.ttft_ms is None:
                    out.ttft_ms = (time.perf_counter() - start) * 1000.0
                out.tokens.extend(msg["tokens"])
            else:
                out.code, out.path = 200, msg.get("path")
    except RewarmError as err:
        out.code, out.reason = int(getattr(err, "code", 500) or 500), str(err)
    except (OSError, asyncio.TimeoutError) as err:
        out.code, out.reason = 599, f"{type(err).__name__}: {err}"
    if out.code == 0:
        out.code, out.reason = 598, "no done message"
    return out


async def _replay(address: str, model: str, plan: list[ReplayRequest], base: list[int],
                  probe: list[int]) -> tuple[Outcome, list[Outcome]]:
    from agent.client import AsyncClient

    host, _, port = address.rpartition(":")
    client = await AsyncClient.connect(host, int(port), max_retries=0)
    try:
        probe_out = await _one(client, model, probe, PROBE_MAX_TOKENS)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = []
        for i, r in enumerate(plan):
            delay = t0 + r.at_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = [base[(7 * i + j) % len(base)] for j in range(r.prompt_tokens)]
            tasks.append(loop.create_task(_one(client, model, prompt, r.output_tokens)))
        return probe_out, list(await asyncio.gather(*tasks))
    finally:
        await client.close()


async def _single(address: str, model: str, tokens: list[int], max_tokens: int) -> Outcome:
    from agent.client import AsyncClient

    host, _, port = address.rpartition(":")
    client = await AsyncClient.connect(host, int(port), max_retries=0)
    try:
        return await _one(client, model, tokens, max_tokens)
    finally:
        await client.close()


# --- the scenario ----------------------------------------------------------------------------

def default_trace() -> Path:
    """``<repo>/../shared/traces/azure_llm_2023_code.csv``."""
    return Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_code.csv"


def trace_path(args: argparse.Namespace) -> Path:
    """``--trace`` or :func:`default_trace`."""
    return Path(args.trace) if args.trace else default_trace()


def _vocabulary(model_dir: Path, vocab_size: int):
    """(tokenizer or None, probe token ids, token ids to build replay prompts from)."""
    if (Path(model_dir) / "tokenizer.json").is_file():
        from agent.replica.tokenizer import load_tokenizer

        tok = load_tokenizer(model_dir)
        base = tok.encode("def add(a, b):\n    return a + b\n\n# Sum a list of numbers in "
                          "Python, then print the result for the user.").ids
        return tok, tok.encode(PROBE_TEXT).ids, base
    return None, [1, 2, 3, 4, 5], list(range(3, min(vocab_size, 200)))


def wait_scaled_to_zero(stack, timeout_s: float, say) -> float:
    """Block until the model has no replica left and a ready snapshot; returns seconds waited.
    Raises TimeoutError after ``timeout_s``."""
    start = time.monotonic()
    agent, model = stack.agent, stack.model
    said_ready = False
    while True:
        waited = time.monotonic() - start
        ready = bool(agent.catalog.snapshots(model, status="ready"))
        if ready and not said_ready:
            said_ready = True
            say(f"  snapshot captured, verified and marked ready after {waited:.1f} s idle; "
                "predictor started")
            # Started only now: LocalScaler counts restoring and warm replicas, not one still
            # cold-booting, so an earlier tick would cold-boot a second replica.
            stack.start_predicting()
        live = [r for r in agent.status()["replicas"] if r["model"] == model]
        if ready and not live:
            return waited
        if waited > timeout_s:
            raise TimeoutError(f"model {model} not scaled to zero within {timeout_s} s "
                               f"(ready snapshot: {ready}; replicas: "
                               f"{[r['state'] for r in live]})")
        time.sleep(0.25)


def run_demo(args: argparse.Namespace, model_dir: Path, release: Path | None,
             forward_note: str) -> int:
    """The four phases (module docstring); prints the table; writes ``--json``.  Returns 0 when
    at least one cold boot and one snapshot restore served, every golden check passed and no
    request was lost, else 1."""
    from agent.replica.config import LlamaConfig
    from agent.up import Stack

    def say(text: str) -> None:
        print(text, flush=True)

    import logging   # one line per predictor tick would bury the demo's own lines
    if logging.getLogger().getEffectiveLevel() >= logging.INFO:
        logging.getLogger("agent.predictor.loop").setLevel(logging.WARNING)

    trace = trace_path(args)
    plan = replay_plan(trace, replay_s=args.replay_s, speedup=args.speedup)
    tok, probe, base = _vocabulary(model_dir, LlamaConfig.from_dir(model_dir).vocab_size)
    state = Path(args.state_dir)
    _fresh_state(state)
    stack = Stack(state, model_dir, release, host=args.host, port=args.port,
                  threads=args.threads, predictor_overrides=demo_policy(),
                  start_predictor=False, restores_per_model=1, max_replicas=1)
    stack.start()
    sampler = Sampler(stack.agent)
    try:
        say(f"rewarm up --demo: model {stack.model}, forward {forward_note}; front door "
            f"{stack.frontdoor_address}, node agent {stack.agent_address}")
        say("1. first request: no snapshot yet, so a cold boot")
        first = asyncio.run(_single(stack.frontdoor_address, stack.model, probe, PROBE_MAX_TOKENS))
        say(f"  answered: code {first.code}, path {first.path}, TTFT {_ms(first.ttft_ms)} ms")
        if first.code != 200:
            raise RuntimeError(f"the first request failed: {first.code} {first.reason}")
        say(f"2. idle until the keep-alive scales the model to zero ({DEMO_POLICY_TEXT})")
        waited = wait_scaled_to_zero(stack, args.idle_timeout_s, say)
        say(f"  scaled to zero after {waited:.1f} s idle")
        say(f"3. the probe again, then {len(plan)} requests of {trace.name} "
            f"({args.replay_s * args.speedup:.0f} trace s at {args.speedup:g}x, lengths "
            f"/{PROMPT_DIV} prompt, /{OUTPUT_DIV} output)")
        probe_again, outcomes = asyncio.run(
            _replay(stack.frontdoor_address, stack.model, plan, base, probe))
        say(f"  probe after scale-to-zero: path {probe_again.path}, TTFT "
            f"{_ms(probe_again.ttft_ms)} ms, tokens "
            f"{'identical' if probe_again.tokens == first.tokens else 'DIFFERENT'}")
    finally:
        span_s = sampler.stop()
        rows = stack.agent.catalog.cold_starts(stack.model) if stack.agent else []
        golden = golden_counts(stack.agent) if stack.agent else {}
        stack.close()
    restores = []
    phases = list(sampler.phases.values())
    for row in rows:
        entry = {"path": row["path"], "outcome": row["outcome"],
                 "duration_s": round(float(row["duration_s"]), 3)}
        match = next((p for p in phases if p.get("path") == row["path"]), None)
        if match is not None and row["outcome"] == "ok":
            phases.remove(match)
            entry["phases_s"] = {k: round(v, 3) for k, v in match.items() if k != "path"}
        restores.append(entry)
    example = tok.decode(probe_again.tokens) if tok is not None else str(probe_again.tokens)
    summary = summarise([first, probe_again, *outcomes], restores=restores, golden=golden,
                        gpu_seconds=sampler.replica_s,
                        always_on_gpu_seconds=span_s,
                        example_completion=(PROBE_TEXT + example) if tok is not None else example,
                        extra={"probe_match": probe_again.tokens == first.tokens,
                               "forward": forward_note, "trace": trace.name,
                               "speedup": args.speedup, "replay_s": args.replay_s})
    say(format_table(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
        say(f"numbers written to {args.json}")
    ok = (summary["requests_by_path"]["cold_boot"] >= 1
          and summary["requests_by_path"]["snapshot_restore"] >= 1
          and summary["golden_checks_failed"] == 0 and summary["lost"] == 0
          and summary["probe_match"])
    return 0 if ok else 1


def _fresh_state(state: Path) -> None:
    """The demo starts without snapshots (so its first request is a cold boot): the catalog,
    local tier and replica sockets of an earlier demo are removed; the release is kept."""
    import shutil

    state.mkdir(parents=True, exist_ok=True)
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (state / name).unlink(missing_ok=True)
    for name in ("snapshots", "run"):
        shutil.rmtree(state / name, ignore_errors=True)
