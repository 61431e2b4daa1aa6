"""``rewarm up --demo``: what a client sees from a scale-to-zero model, end to end, over TCP,
beside one always-on replica serving the same requests.

Phases (against the :class:`agent.up.Stack` started here):

1. the first request: no snapshot exists, so the node agent cold-boots a replica, it answers,
   and its snapshot is captured, verified and marked ready (in the background);
2. the warm replica is measured through the front door: its speed profile
   (:func:`agent.sim.replay.calibrate`) and what it sustains while backlogged at the
   replay's own lengths (:func:`agent.sim.replay.saturate`); the first ``--minutes`` of the
   Azure LLM code trace are scaled to it as bench/trace_replay.py scales a window
   (:mod:`agent.sim.replay_scale`: one time compression from ``--replay-s``, one token
   scale, the burst shape kept; a window too busy for the replica within ``--replay-s`` even
   at 1-token lengths is thinned to an evenly spaced subset of its requests), at ``--load``
   of that sustained capacity or less: the largest load at which one always-on replica can
   meet the SLO, bursts included (:func:`agent.sim.replay_scale.fit_for_always_on`), so the
   comparison is one the always-on replica can win;
3. one always-on replica: the replica is kept warm (no predictor yet) and the scaled window
   is replayed against it;
4. idle: the predictor (started now) scales the model to zero once the keep-alive allows —
   the demo shortens the keep-alive's inputs (:data:`DEMO_POLICY`) so this takes seconds
   instead of minutes, and says so;
5. rewarm: the same probe request again (answered by a snapshot restore; its tokens must
   equal phase 1's), then the same requests as phase 3, the predictor and the front door
   bringing capacity up from zero;
6. the table (:func:`format_table`: rewarm's paths and restores, then its SLA attainment and
   GPU-seconds beside the always-on replica's) and, with ``--json PATH``, the numbers
   (:func:`summarise`).

Outcome classes per request (agent/sim/replay.py): 200 → served (counted by the ``path`` the
front door reports), 429 → ``shed``, 504 → ``expired``, anything else (503, a broken
connection, no answer) → ``lost``, which must stay 0.  The SLA attainment is the share of the
replay's requests answered within their path's TTFT SLO (warm hit 2 s, restore path 4 s).
GPU-seconds are replica-seconds here (replicas alive, sampled every ``SAMPLE_S``) over each
replay, rewarm's from its probe on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import threading
import time
from pathlib import Path
from typing import Any

from agent.errors import ConfigError, RewarmError
from agent.sim.replay import PATH_SLO_MS, Outcome, percentile
from agent.sim.replay import summarise as replay_summary

PATHS = ("cold_boot", "snapshot_restore", "suspended_resume", "warm_hit")
PROBE_TEXT = "The capital of France is"
PROBE_MAX_TOKENS = 12
MAX_REPLAY_REQUESTS = 5000
COLD_BOOT_DEADLINE_MS = 300_000.0   # the demo's first request waits for the cold boot
SAMPLE_S = 0.25
SATURATE_S = 5.0   # seconds the warm replica is kept backlogged to measure what it sustains
# Keep-alive inputs shortened for the demo (the production defaults are the cost model's
# $2.80/GPU-hour and a 600 s rate window, which keep an idle replica minutes).
DEMO_POLICY_TEXT = ("demo keep-alive: GPU cost 0.05/s, wait cost 0.01/s, restore 2 s, "
                    "rate window 20 s, cooldown 10 s (production: 2.80/h, 600 s, one lead time); "
                    "at most 1 replica on this machine")


def demo_policy() -> dict[str, Any]:
    """:class:`~agent.predictor.policy.ModelPolicy` overrides that shorten the keep-alive."""
    from agent.predictor.keepalive import KeepAliveCosts

    return {"scale_down_cooldown_s": 10.0, "rate_window_s": 20.0, "max_replicas": 1,
            "costs": KeepAliveCosts(gpu_cost_per_s=0.05, suspended_cost_per_s=0.0025,
                                    wait_cost_per_s=0.01, restore_s=2.0)}


def replay_window(trace: Path, *, minutes: float, max_requests: int = MAX_REPLAY_REQUESTS):
    """The trace's first ``minutes`` (:class:`agent.sim.trace.TraceRows`).

    Reads the trace with :func:`agent.sim.trace.read_trace` (which validates every field and
    raises InvalidTrace naming the row).  Raises ConfigError for ``minutes`` not > 0 or a
    window that holds no request or more than ``max_requests``."""
    from agent.errors import TraceNotFound
    from agent.sim.trace import read_trace

    if not Path(trace).is_file():
        raise TraceNotFound(f"trace {trace} not found (pass --trace PATH)", path=trace, line=None,
                           field="path", value=str(trace), limit="an existing file")
    if not (minutes > 0 and math.isfinite(minutes)):
        raise ConfigError(f"minutes={minutes}; limit is > 0", name="minutes", value=minutes,
                          limit="> 0")
    rows = read_trace(trace).window(0.0, minutes * 60.0)
    if not 1 <= len(rows) <= max_requests:
        raise ConfigError(f"replay window of {minutes:g} trace minutes holds {len(rows)} "
                          f"requests; limit is 1..{max_requests} (change --minutes)",
                          name="max_requests", value=len(rows), limit=max_requests)
    return rows


def summarise(outcomes: list[Outcome], *, restores: list[dict], golden: dict[str, int],
              gpu_seconds: float, always_on_gpu_seconds: float, example_completion: str,
              extra: dict | None = None,
              sla_of: list[Outcome] | None = None) -> dict[str, Any]:
    """The demo's numbers (the ``--json`` document).

    ``restores``: the catalog's cold-start rows (path, outcome, duration_s) plus optional
    ``phases_s``; ``golden``: ``{"passed": n, "failed": n}``.  Keys: requests_by_path,
    ttft_ms {path: {p50, p99}}, golden_checks_passed/failed, shed, expired, lost, gpu_seconds,
    always_on_gpu_seconds, example_completion, restores, requests, and ``sla_attainment``
    with ``sla_requests``: the share of ``sla_of`` (default: all outcomes; the demo passes
    the replay's) answered 200 within their path's TTFT SLO (agent/sim/replay.py)."""
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
    judged = outcomes if sla_of is None else sla_of
    sla = replay_summary(judged, gpu_seconds=0.0, always_on_gpu_seconds=0.0, restores=0)
    return {
        "requests": len(outcomes),
        "requests_by_path": by_path,
        "sla_attainment": sla["sla_attainment"], "sla_requests": len(judged),
        "shed_429_within_50ms": sla["shed_429_within_50ms"],
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
    lines += ["", sla_line(s)]
    lines += comparison_lines(s)
    lines += [
        f"golden checks       {s['golden_checks_passed']} passed, {s['golden_checks_failed']} failed",
        f"probe tokens        {'identical after restore' if s.get('probe_match') else 'DIFFER or not checked'}",
        f"shed (429)          {s['shed']}",
        f"expired (504)       {s['expired']}",
        f"lost                {s['lost']}",
        gpu_line(s),
        f"forward             {s.get('forward', '?')}",
        "",
        f"example completion  {s['example_completion']!r}",
        "",
    ]
    return "\n".join(lines)


def comparison_lines(s: dict[str, Any]) -> list[str]:
    """Rewarm beside one always-on replica on the same requests (when the document has the
    always-on replay): SLA attainment, answers, warm TTFT p99 and GPU-seconds."""
    on = s.get("always_on")
    if not on:
        return []
    replayed = s["sla_requests"] - 1     # the judged requests less the probe
    warm = lambda d: _ms(d["ttft_ms"].get("warm_hit", {}).get("p99"))  # noqa: E731
    rows = [("SLA attainment", f"{100 * s['sla_attainment']:.1f} %",
             f"{100 * on['sla_attainment']:.1f} %"),
            ("requests (429 / 504 / lost)",
             f"{replayed} ({s['shed']} / {s['expired']} / {s['lost']})",
             f"{on['requests']} ({on['shed_429']} / {on['expired_504']} / {on['lost']})"),
            ("warm TTFT p99 ms", warm(s), warm(on)),
            ("GPU-seconds", f"{s['gpu_seconds']:.1f}", f"{on['gpu_seconds']:.1f}")]
    out = ["", f"the same requests, load {s.get('load', 0):.2f}; one always-on replica can "
               f"meet the SLO for {100 * s.get('always_on_bound', 0):.1f} % of them at best:",
           f"{'':<28}{'rewarm':>20}{'always-on':>20}"]
    out += [f"{name:<28}{a:>20}{b:>20}" for name, a, b in rows]
    return out


def sla_line(s: dict[str, Any]) -> str:
    """``SLA attainment ...``: the share of the judged requests within their path's SLO."""
    if "sla_attainment" not in s:
        return "SLA attainment      -"
    return (f"SLA attainment      {100 * s['sla_attainment']:.1f} % of {s['sla_requests']} "
            f"requests (the probe after scale-to-zero and the replay's) answered within "
            f"their path's TTFT SLO (warm hit "
            f"{PATH_SLO_MS['warm_hit'] / 1000:g} s, restore {PATH_SLO_MS['snapshot_restore'] / 1000:g} s;"
            f" 429/504 count as misses)")


def gpu_line(s: dict[str, Any]) -> str:
    """GPU-seconds against one always-on replica serving the same requests, saying plainly
    when scaling to zero cost more than not scaling."""
    used, always = s["gpu_seconds"], s["always_on_gpu_seconds"]
    head = f"GPU-seconds         {used:.1f} used vs {always:.1f} for one always-on replica"
    if always <= 0:
        return head + " (nothing to compare)"
    diff = always - used
    verdict = (f"{diff:.1f} saved, {100 * diff / always:.0f} %" if diff >= 0 else
               f"{-diff:.1f} MORE than always-on")
    return head + f" ({verdict}; replica-seconds on this CPU machine)"


class Sampler:
    """Replica-seconds: every ``SAMPLE_S``, replicas of the agent not dead (cold-booting,
    restoring, warm, suspended, draining) times the interval (``replica_s``; those beyond
    the first, ``beyond_one_s``, and the wall seconds with two or more, ``crowded_s``); also
    each restored replica's load phases (``phases_s`` from its ``stats``); and ``cpu``,
    ``(seconds since start, this process's CPU seconds)`` at every sample (what the
    replay's contention model reads its background CPU from)."""

    def __init__(self, agent) -> None:
        self.agent = agent
        self.replica_s = 0.0
        self.beyond_one_s = 0.0
        self.crowded_s = 0.0
        self.peak = 0
        self.phases: dict[str, dict] = {}
        self.cpu: list[tuple[float, float]] = [(0.0, time.process_time())]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-sampler", daemon=True)
        self.started_s = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(SAMPLE_S):
            now = time.monotonic()
            with self.agent.lock:
                recs = list(self.agent.replicas.values())
            alive = [r for r in recs if r.lifecycle.state.value != "dead"]
            self.replica_s += len(alive) * (now - last)
            if len(alive) > 1:
                self.beyond_one_s += (len(alive) - 1) * (now - last)
                self.crowded_s += now - last
            self.peak = max(self.peak, len(alive))
            self.cpu.append((now - self.started_s, time.process_time()))
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


def replica_stats(stack) -> dict:
    """The ``stats`` answer of a warm replica of ``stack`` (RuntimeError when none is)."""
    with stack.agent.lock:
        recs = list(stack.agent.replicas.values())
    for r in recs:
        if r.lifecycle.state.value == "warm" and r.handle is not None:
            return r.handle.stats()
    raise RuntimeError(f"model {stack.model}: no warm replica to read its stats from")


def replica_limits(stack) -> tuple[int, int]:
    """``(max_seqs, max_seq_len)`` from the ``stats`` of a warm replica of ``stack``.
    Raises RuntimeError when none is warm."""
    stats = replica_stats(stack)
    return int(stats["max_seqs"]), int(stats["max_seq_len"])


def golden_counts(agent) -> dict[str, int]:
    """Golden checks the replicas ran: each snapshot restore that served passed one; each
    restore attempt that failed with GoldenMismatch failed one."""
    passed = failed = 0
    with agent.lock:
        recs = list(agent.replicas.values())
    for r in recs:
        if r.path in ("restore", "staged_restore") and r.handle is not None:
            passed += 1
        failed += sum(1 for a in r.attempts if a.get("error") == "GoldenMismatch")
    return {"passed": passed, "failed": failed}


async def _replay(address: str, model: str, plan: list, base: list[int],
                  probe: list[int], until_s: float = 0.0) -> tuple[Outcome, list[Outcome]]:
    """The probe (answered by a restore after scale-to-zero), then the plan at its times
    (lasting at least ``until_s``)."""
    from agent.sim.replay import one_request_at, send_plan

    # the probe waits for the restore (its own deadline), so the front door measures the
    # snapshot restore before the replay's requests are admitted against its p99
    probe_out = await one_request_at(address, model, probe, PROBE_MAX_TOKENS,
                                     deadline_ms=COLD_BOOT_DEADLINE_MS)
    return probe_out, await send_plan(address, model, plan, base, until_s=until_s)


def demo_stack_options() -> dict[str, Any]:
    """The demo's :class:`~agent.up.Stack` options: the demo policy, one replica, and a front
    door that holds a request as long as :data:`COLD_BOOT_DEADLINE_MS` (its default
    ``max_wait_s``, 60 s, would refuse the first request with a 429 on a machine where the
    cold boot takes longer than that)."""
    return {"predictor_overrides": demo_policy(), "start_predictor": False,
            "restores_per_model": 1, "max_replicas": 1,
            "max_wait_s": COLD_BOOT_DEADLINE_MS / 1000.0}


# --- the scenario ----------------------------------------------------------------------------

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "azure_llm_2023_code.csv"
"""The Azure LLM code trace kept in the repository (bench/traces/README.md: source, licence)."""


def default_trace() -> Path:
    """:data:`DEFAULT_TRACE` (``bench/traces/azure_llm_2023_code.csv``)."""
    return DEFAULT_TRACE


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


def wait_scaled_to_zero(stack, timeout_s: float, say, on_ready=None) -> float:
    """Block until the model has no replica left and a ready snapshot; returns seconds waited
    since the predictor started.  ``on_ready()`` runs once the snapshot is ready, before the
    predictor starts (the demo measures the warm replica then).  Raises TimeoutError when the
    snapshot is not ready within ``timeout_s``, or when the model still has a replica
    ``timeout_s`` after the predictor started (the time ``on_ready`` takes is not counted)."""
    start = time.monotonic()
    agent, model = stack.agent, stack.model
    predicting_since: float | None = None
    while True:
        ready = bool(agent.catalog.snapshots(model, status="ready"))
        if ready and predicting_since is None:
            say(f"  snapshot captured, verified and marked ready after "
                f"{time.monotonic() - start:.1f} s idle")
            if on_ready is not None:
                on_ready()
            say("  predictor started")
            # Started only now: LocalScaler counts restoring and warm replicas, not one still
            # cold-booting, so an earlier tick would cold-boot a second replica.
            stack.start_predicting()
            predicting_since = time.monotonic()
        live = [r for r in agent.status()["replicas"] if r["model"] == model]
        if predicting_since is not None and not live:
            return time.monotonic() - predicting_since
        waited = time.monotonic() - (start if predicting_since is None else predicting_since)
        if waited > timeout_s:
            since = ("of the predictor starting" if predicting_since is not None
                     else "(no ready snapshot yet)")
            raise TimeoutError(f"model {model} not scaled to zero within {timeout_s} s {since} "
                               f"(ready snapshot: {ready}; replicas: "
                               f"{[r['state'] for r in live]}); a busy machine may need a "
                               "larger --idle-timeout-s")
        time.sleep(0.25)


def measure_replica(stack, window, args, base: list[int], say) -> dict[str, Any]:
    """The warm replica, before the predictor may release it: its speed profile (measured
    through the front door, or what its meter reports), then what it sustains while
    backlogged at the replay's own lengths (:func:`agent.sim.replay.saturate`), and the
    scale that makes the window fit one always-on replica at that capacity
    (:func:`agent.sim.replay_scale.fit_for_always_on`: ``--load`` or less, so the comparison
    is one the always-on replica can win).  Returns the ``measured`` dict of
    :func:`run_demo`."""
    from agent.sim import replay
    from agent.sim.replay_scale import fit_for_always_on, fit_within_wall, replay_requests
    from agent.speed import SpeedProfile

    address, model = stack.frontdoor_address, stack.model
    max_seqs, max_seq_len = replica_limits(stack)
    calibrated = asyncio.run(replay.calibrate(address, model, base, max_seq_len=max_seq_len))
    # scale by what the replica reports (the front door admits by it), else by that
    profile = SpeedProfile.from_meta(replica_stats(stack)) or calibrated
    fit = dict(window_s=args.minutes * 60.0, profile=profile, wall_s=args.replay_s,
               ttft_slo_s=PATH_SLO_MS["warm_hit"] / 1000.0, max_seqs=max_seqs,
               max_tokens_per_request=max_seq_len)
    first, kept = fit_within_wall(window.context_tokens, window.generated_tokens,
                                  load=args.load, **fit)
    lengths = [(r.prompt_tokens, r.output_tokens) for r in replay_requests(
        window.arrival_s[kept], window.context_tokens[kept], window.generated_tokens[kept],
        first, max_seq_len)]
    sustained = asyncio.run(replay.saturate(address, model, base, lengths,
                                            concurrency=2 * max_seqs, seconds=SATURATE_S))
    scale, kept, fluid = fit_for_always_on(
        window.context_tokens, window.generated_tokens, window.arrival_s, load=args.load,
        wait_slo_s=PATH_SLO_MS["warm_hit"] / 1000.0, sustained=sustained, **fit)
    plan = replay_requests(window.arrival_s[kept], window.context_tokens[kept],
                           window.generated_tokens[kept], scale, max_seq_len)
    say(f"  measured the replica: {profile.prefill_tokens_per_s:.0f} prompt tokens/s, "
        f"decode step {1000 * profile.decode_base_s:.0f} ms; sustained "
        f"{sustained.rps:.1f} req/s backlogged at the replay's lengths (the profile "
        f"estimated {first.capacity_rps:.1f})")
    say(f"  scaled to load {scale.load:.2f} of that (asked: at most {args.load:g}): one "
        f"always-on replica can meet the SLO for {100 * fluid:.1f} % of the window's requests "
        "at best, bursts included")
    if kept.size < len(window):
        say(f"  the window's {len(window)} requests take longer than --replay-s "
            f"{args.replay_s:g} s on this replica even at 1-token lengths: replaying "
            f"{kept.size} of them, evenly spaced in arrival order (the same burst shape at a "
            "lower rate)")
    return {"profile": profile, "scale": scale, "max_seqs": max_seqs,
            "window_requests": len(window), "plan": plan, "sustained": sustained,
            "always_on_bound": fluid, "profile_capacity_rps": first.capacity_rps}


def run_demo(args: argparse.Namespace, model_dir: Path, release: Path | None,
             forward_note: str) -> int:
    """The phases (module docstring); prints the table; writes ``--json``.  Returns 0 when
    at least one cold boot and one snapshot restore served, every golden check passed and no
    request was lost, else 1."""
    from agent.replica.config import LlamaConfig
    from agent.up import Stack

    def say(text: str) -> None:
        print(text, flush=True)

    import logging   # one line per predictor tick would bury the demo's own lines
    if logging.getLogger().getEffectiveLevel() >= logging.INFO:
        logging.getLogger("agent.predictor.loop").setLevel(logging.WARNING)

    from agent.sim import replay

    trace = trace_path(args)
    window = replay_window(trace, minutes=args.minutes)
    tok, probe, base = _vocabulary(model_dir, LlamaConfig.from_dir(model_dir).vocab_size)
    state = Path(args.state_dir)
    _fresh_state(state)
    stack = Stack(state, model_dir, release, host=args.host, port=args.port,
                  threads=args.threads, **demo_stack_options())
    stack.start()
    sampler = Sampler(stack.agent)
    measured: dict[str, Any] = {}
    always_on: dict[str, Any] = {}
    try:
        address, model = stack.frontdoor_address, stack.model
        say(f"rewarm up --demo: model {model}, forward {forward_note}; front door "
            f"{address}, node agent {stack.agent_address}")
        say("1. first request: no snapshot yet, so a cold boot")
        # A cold boot meets no TTFT SLO (it is what snapshots avoid): the first request
        # carries its own deadline, so admission waits for the boot instead of refusing it.
        first = asyncio.run(replay.one_request_at(address, model, probe, PROBE_MAX_TOKENS,
                                                  deadline_ms=COLD_BOOT_DEADLINE_MS))
        say(f"  answered: code {first.code}, path {first.path}, TTFT {_ms(first.ttft_ms)} ms")
        if first.code != 200:
            raise RuntimeError(f"the first request failed: {first.code} {first.reason}")
        say("2. measuring the warm replica")
        measured.update(measure_replica(stack, window, args, base, say))
        scale, plan = measured["scale"], measured["plan"]
        say(f"3. one always-on replica: {len(plan)} requests of {trace.name} (its first "
            f"{args.minutes:g} minutes at {scale.speedup:.2f}x, token lengths x"
            f"{scale.token_scale:.4f}, {scale.wall_s:.0f} s), the replica kept warm")
        on_sampler = Sampler(stack.agent)
        on_outcomes = asyncio.run(replay.send_plan(address, model, plan, base,
                                                   until_s=scale.wall_s))
        on_span_s = on_sampler.stop()
        always_on = replay.summarise(on_outcomes, gpu_seconds=on_sampler.replica_s,
                                     always_on_gpu_seconds=on_span_s, restores=0)
        say(f"  SLA attainment {100 * always_on['sla_attainment']:.1f} %, "
            f"{on_sampler.replica_s:.0f} replica-seconds")
        say(f"4. idle until the keep-alive scales the model to zero ({DEMO_POLICY_TEXT})")
        waited = wait_scaled_to_zero(stack, args.idle_timeout_s, say)
        assert stack.predictor is not None, "started by start_predicting() above"
        stack.predictor.predictor.update_speed(
            model, measured["profile"], measured["max_seqs"],
            mean_prompt_tokens=scale.mean_prompt_tokens,
            mean_gen_tokens=scale.mean_output_tokens, sustained=measured["sustained"])
        say(f"  scaled to zero after {waited:.1f} s with the predictor running")
        say(f"5. rewarm: the probe again, then the same {len(plan)} requests, the predictor "
            "scaling the replica from zero")
        rewarm_sampler = Sampler(stack.agent)
        probe_again, outcomes = asyncio.run(_replay(address, model, plan, base, probe,
                                                    until_s=scale.wall_s))
        rewarm_span_s = rewarm_sampler.stop()
        say(f"  probe after scale-to-zero: path {probe_again.path}, TTFT "
            f"{_ms(probe_again.ttft_ms)} ms, tokens "
            f"{'identical' if probe_again.tokens == first.tokens else 'DIFFERENT'}")
    finally:
        sampler.stop()
        rows = stack.agent.catalog.cold_starts(stack.model) if stack.agent else []
        golden = golden_counts(stack.agent) if stack.agent else {}
        stack.close()
    restores = []
    phases = list(sampler.phases.values())
    for row in rows:
        entry = {"path": row["path"], "outcome": row["outcome"],
                 "duration_s": round(float(row["duration_s"]), 3)}
        match = next((p for p in phases if p.get("path") == row["path"]), None)  # noqa: B023
        if match is not None and row["outcome"] == "ok":
            phases.remove(match)
            entry["phases_s"] = {k: round(v, 3) for k, v in match.items() if k != "path"}
        restores.append(entry)
    example = tok.decode(probe_again.tokens) if tok is not None else str(probe_again.tokens)
    sustained = measured["sustained"]
    summary = summarise([first, probe_again, *outcomes], restores=restores, golden=golden,
                        gpu_seconds=rewarm_sampler.replica_s,
                        always_on_gpu_seconds=on_sampler.replica_s,
                        example_completion=(PROBE_TEXT + example) if tok is not None else example,
                        sla_of=[probe_again, *outcomes],
                        extra={"probe_match": probe_again.tokens == first.tokens,
                               "forward": forward_note, "trace": trace.name,
                               "minutes": args.minutes, "load": scale.load,
                               "load_asked": args.load,
                               "speedup": scale.speedup, "token_scale": scale.token_scale,
                               "scale": scale.to_json(),
                               "profile": measured["profile"].to_meta(),
                               "sustained": sustained.to_meta(),
                               "profile_capacity_rps": measured["profile_capacity_rps"],
                               "always_on_bound": measured["always_on_bound"],
                               "always_on": {k: always_on[k] for k in (
                                   "requests", "served", "shed_429", "expired_504", "lost",
                                   "sla_attainment", "ttft_ms")}
                               | {"gpu_seconds": round(on_sampler.replica_s, 2),
                                  "span_s": round(on_span_s, 2)},
                               "rewarm_span_s": round(rewarm_span_s, 2),
                               "replay_s": args.replay_s,
                               "window_requests": measured["window_requests"],
                               "replayed_requests": len(measured["plan"])})
    say(format_table(summary))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
        say(f"numbers written to {args.json}")
    failed = [why for why, bad in (
        ("no request came up by a cold boot", summary["requests_by_path"]["cold_boot"] < 1),
        ("no request came up by a snapshot restore",
         summary["requests_by_path"]["snapshot_restore"] < 1),
        (f"{summary['golden_checks_failed']} golden check(s) failed",
         summary["golden_checks_failed"] > 0),
        (f"{summary['lost']} request(s) lost (answered 503 or not at all)", summary["lost"] > 0),
        (f"{always_on['lost']} request(s) of the always-on replay lost", always_on["lost"] > 0),
        ("the probe's tokens differed after the restore", not summary["probe_match"]))
        if bad]
    for why in failed:
        say(f"demo check failed: {why}")
    return 1 if failed else 0


def _fresh_state(state: Path) -> None:
    """The demo starts without snapshots (so its first request is a cold boot): the catalog,
    local tier and replica sockets of an earlier demo are removed; the release is kept."""
    import shutil

    state.mkdir(parents=True, exist_ok=True)
    for name in ("catalog.db", "catalog.db-wal", "catalog.db-shm"):
        (state / name).unlink(missing_ok=True)
    for name in ("snapshots", "run"):
        shutil.rmtree(state / name, ignore_errors=True)
