"""The serving path on a GPU node, step by step (bench/device_check.py's ``stack`` and
``stack_8b`` steps).

The embedded stack (agent/up.py ``Stack``: node agent with its GPU inventory, process-backed
zygotes per device, control API, front door, OpenAI-compatible HTTP entrance) serves one model;
requests go through the HTTP entrance (SSE, greedy, ``ignore_eos``: always ``max_tokens``
tokens), and the warm pool is moved the way the predictor moves it, through its scaler
(agent/cluster/local_scaler.py ``LocalScaler.set_target`` with the predictor's reason words:
``release=suspend`` parks, anything else stops).  The predictor's loop itself is not started,
so its own decisions cannot move the pool between the steps measured::

    cold boot -> capture -> a zygote warmed for the snapshot -> scale to zero
    -> restore (CUDA zygote, kvikio; the snapshot in the page cache) -> first token
    -> park (CUDA checkpoint) -> a request straight to the parked process: no tokens
    -> resume -> first token
    [-> scale to zero -> the snapshot's pages dropped -> restore (cold) -> first token]

The cold restore runs when the targets have a cold limit and the step's deadline leaves room;
its limit is ``cold_base_s`` plus the snapshot's bytes over the storage's cold read rate,
measured here (O_DIRECT reads of up to :data:`COLD_SAMPLE_BYTES` of the snapshot's own data
files, bench/restore_throughput.py ``raw_odirect``, page cache dropped).

The prompt is text (tokenized by the model's tokenizer) or token ids, for a model without a
tokenizer (the seeded Llama-3-8B shape): OpenAI's completions take a list of ids as
``prompt``.  A streamed answer to ids carries no text, so the tokens compared before and after
each step are the ``token_ids`` of a second, whole answer to the same prompt (the replica is
warm by then: a few decode steps).

After each restore the replica's own record is kept: its phases (``weights_s``, ``golden_s``
and the check's prefill, decode and sampling parts, agent/replica/zygote.py ``restore``) and
its ``warm`` record (whether the zygote's warmed engine served it and why not,
agent/replica/warmup.py), and the agent's own restore time (its cold-start log).

First-token times are from the request's send to the first SSE chunk, seconds on
``time.perf_counter``.  Targets: :data:`SMOLLM2` and :data:`LLAMA3_8B`.
"""

from __future__ import annotations

import functools
import http.client
import json
import shutil
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COLD_SAMPLE_BYTES = 4 << 30
"""How much of the snapshot the cold-rate measurement reads (sequential O_DIRECT, 16 MiB
requests, 8 threads: bench/restore_throughput.py's raw read)."""
COLD_NEEDS_S = 45.0     # the cold restore's share of a step: a zygote to warm, the rate, the restore
PARK_NEEDS_S = 20.0     # park and resume of a 16 GB replica (CUDA checkpoint both ways)


@dataclass(frozen=True)
class Targets:
    """Limits of one model's serving path: zygote restore to first token with the snapshot
    in the page cache (``restore_s``), resume to first token (``resume_s``), and for a cold
    restore ``cold_base_s`` + bytes / the measured cold read rate (None: no cold restore)."""

    restore_s: float
    resume_s: float
    cold_base_s: float | None = None


SMOLLM2 = Targets(restore_s=0.3, resume_s=0.5)
LLAMA3_8B = Targets(restore_s=1.0, resume_s=1.0, cold_base_s=0.5)


def complete(url: str, model: str, prompt: str | list[int], max_tokens: int,
             timeout_s: float = 150.0, stream: bool = True) -> tuple[Any, float, float]:
    """``(answer, first_token_s, first_token_at)`` of one /v1/completions request: streamed,
    the text (``first_token_*`` from the first chunk); whole, the text or, for a model without
    a tokenizer, the ``token_ids`` (``first_token_*`` then the whole answer's)."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": stream, "ignore_eos": True})
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        if not stream:
            choice = json.loads(resp.read())["choices"][0]
            done = time.perf_counter()
            return choice.get("token_ids") or choice.get("text"), round(done - sent, 3), done
        first, text = None, []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("error"):
                raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter()
                text.append(chunk["choices"][0].get("text") or "")
    finally:
        conn.close()
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return "".join(text), round(first - sent, 3), first


def _first_token(url: str, model: str, prompt: str | list[int],
                 max_tokens: int) -> tuple[Any, float, float]:
    """The streamed request (its first token's time), and what it generated: its text, or
    for a token-id prompt the ids of a whole answer to the same request."""
    text, ttft, first_at = complete(url, model, prompt, max_tokens)
    if isinstance(prompt, list):
        text = complete(url, model, prompt, max_tokens, stream=False)[0]
    return text, ttft, first_at


def _wait(what: str, ok: Callable[[], Any], timeout_s: float, poll_s: float = 0.1) -> float:
    """Seconds until ``ok()`` is truthy; RuntimeError naming ``what`` past ``timeout_s``."""
    t = time.perf_counter()
    while not ok():
        if time.perf_counter() - t > timeout_s:
            raise RuntimeError(f"{what}: not within {timeout_s} s")
        time.sleep(poll_s)
    return round(time.perf_counter() - t, 3)


def _live(agent, state: str):
    recs = [r for r in agent.replicas.values() if r.lifecycle.state.value == state]
    return recs[-1] if recs else None


def _probe_parked(address: str, model: str) -> str:
    """What a generate sent straight to a parked replica's socket gets within 1.5 s."""
    from agent.protocol import PROTOCOL_VERSION
    from agent.replica.worker import call

    try:
        answers = call(address, {"v": PROTOCOL_VERSION, "op": "generate", "id": 1, "model": model,
                                 "tokens": [1, 2, 3], "max_tokens": 1}, timeout_s=1.5)
    except (TimeoutError, OSError) as exc:
        return f"no answer ({type(exc).__name__})"
    tokens = [t for a in answers if a.get("type") == "tokens" for t in a.get("tokens", [])]
    return f"answered {len(tokens)} tokens" if tokens else f"no tokens ({answers[-1].get('type')})"


def record_restore(figs, agent, model: str, prefix: str) -> dict:
    """The warm replica's restore record as figures (``<prefix>_*``): the replica's phases in
    ms, whether the zygote's warmed engine served it (met when reused) and the agent's own
    restore time; the ``warm`` record whole as a note.  Returns the replica's stats."""
    rec = _live(agent, "warm")
    if rec is None:
        figs.note(f"{prefix}: no warm replica to ask")
        return {}
    try:
        stats = rec.handle.stats()
    except Exception as exc:   # noqa: BLE001 - a note only
        figs.note(f"{prefix}: replica stats unavailable: {type(exc).__name__}: {exc}")
        return {}
    phases = stats.get("phases_s") or {}
    io = stats.get("restore_io") or "?"
    for key in ("weights_s", "package_s", "golden_s", "golden_prefill_s", "golden_decode_s",
                "golden_sample_s", "profile_s"):
        if key in phases:
            figs.fig(f"{prefix}_{key[:-2]}_ms", round(phases[key] * 1e3, 1), "ms",
                     path=io if key == "weights_s" else "-")
    warm = stats.get("warm") or {}
    figs.fig(f"{prefix}_warm_engine", warm.get("engine"), "", target="reused",
             met=warm.get("engine") == "reused")
    figs.note(f"{prefix}: warm record {warm}; fallback {stats.get('fallback')}; "
              f"package {stats.get('package_digest') or 'none (eager)'}")
    starts = agent.catalog.cold_starts(model)
    if starts:
        figs.fig(f"{prefix}_agent_restore_s", round(starts[-1]["duration_s"], 3), "s",
                 path=starts[-1]["path"])
    return stats


def cold_rate(snapshot: Path, sample_bytes: int = COLD_SAMPLE_BYTES) -> tuple[float, int]:
    """``(GB/s, bytes read)``: the storage's cold sequential rate over up to ``sample_bytes``
    of ``snapshot``'s data files (page cache dropped first; O_DIRECT, so the read leaves the
    cache as it found it)."""
    from restore_throughput import raw_odirect

    from agent.snapshot.reader import HostBuffer

    files = sorted(snapshot.glob("data-*.bin"))
    want = min(sample_bytes, sum(f.stat().st_size for f in files))
    buf = HostBuffer.allocate(want, prefault=True)
    seconds, done = 0.0, 0
    for f in files:
        n = min(f.stat().st_size, want - done) // 4096 * 4096
        if n <= 0:
            break
        seconds += raw_odirect(f, n, buf, 16 << 20, 8)
        done += n
    del buf
    return round(done / seconds / 1e9, 3) if seconds > 0 else 0.0, done


def drop_snapshot_cache(snapshot: Path) -> float:
    """Drop ``snapshot``'s data files from the page cache (bench/restore_peers.py
    ``drop_cache``); returns the largest share still resident (mincore)."""
    from restore_peers import drop_cache

    return max((drop_cache(f) for f in sorted(snapshot.glob("data-*.bin"))), default=0.0)


def run_stack(figs, model_dir: Path, release: Path | None, state: Path,
              prompt: str | list[int], max_tokens: int, *, targets: Targets = SMOLLM2,
              deadline: float | None = None, capture_timeout_s: float = 90.0,
              warm_timeout_s: float = 60.0) -> None:
    """The module docstring's sequence, each figure written as it is measured.  ``deadline``
    (``time.perf_counter`` seconds): the optional parts (park and resume, the cold restore)
    start only while it leaves them room, and what is skipped says so.  Raises RuntimeError
    when a step of the path fails (the stack is closed either way)."""
    from agent.cluster.control import control_call
    from agent.cluster.local_scaler import LocalScaler
    from agent.up import Stack

    def left() -> float:
        return float("inf") if deadline is None else deadline - time.perf_counter()

    shutil.rmtree(state, ignore_errors=True)
    stack = Stack(state, model_dir, release, http_port=0, start_predictor=False, max_replicas=1,
                  restores_per_model=1, max_wait_s=150.0, deadline_ms=150_000.0)
    t = time.perf_counter()
    stack.start(timeout_s=90.0)
    figs.fig("stack_start_s", round(time.perf_counter() - t, 2), "s")
    agent, model = stack.agent, stack.model
    device = agent.inventory.devices[0]
    figs.note(f"model {model} ({model_dir.name}); devices {agent.inventory.devices}; "
              f"suspender {'yes' if agent.suspender else 'none'}; "
              f"release {release or 'none: eager'}; prompt "
              f"{'token ids' if isinstance(prompt, list) else 'text'}")
    scaler = LocalScaler({"up": functools.partial(control_call, stack.agent_address, timeout_s=150.0)})
    url = stack.http_url
    try:
        text0, ttft, _ = _first_token(url, model, prompt, max_tokens)
        rec = _live(agent, "warm")
        figs.fig("cold_boot_first_token_s", ttft, "s", path=rec.path if rec else "?")
        spec = agent.spec(model)
        figs.fig("capture_s", _wait("capture", lambda: agent.catalog.newest_ready(
            spec.name, spec.version), capture_timeout_s), "s")
        row = agent.catalog.newest_ready(spec.name, spec.version)
        snapshot = agent.store.path(row.snapshot_id)
        figs.fig("snapshot_bytes", row.size_bytes, "B")
        warmed = lambda: any(z.warm == snapshot for z in agent.pool.get(device, []))  # noqa: E731
        try:
            figs.fig("zygote_warmed_s", _wait("a zygote warmed for the snapshot", warmed,
                                              warm_timeout_s), "s", path=device)
        except RuntimeError as exc:
            figs.note(f"{exc}: the restore takes one that is not")
        scaler.set_target(model, 0, reason="device check: scale to zero (release=stop)")
        figs.fig("scaled_to_zero", _live(agent, "warm") is None, "", met=_live(agent, "warm") is None)

        text1, ttft, _ = _first_token(url, model, prompt, max_tokens)
        rec = _live(agent, "warm")
        figs.fig("restore_path", rec.path if rec else None, "", met=rec is not None
                 and rec.path == "restore")
        if rec is not None and rec.attempts:
            figs.note(f"failed rungs before it: {rec.attempts}")
        io = getattr(rec.handle, "restore_io", None) if rec else None
        figs.fig("zygote_restore_first_token_s", ttft, "s", path=io or "?",
                 limit={"target_s": targets.restore_s}, target=f"<= {targets.restore_s} s",
                 met=ttft <= targets.restore_s)
        figs.fig("tokens_match_after_restore", text1 == text0, "", met=text1 == text0)
        fallback = getattr(rec.handle, "fallback", None) if rec else None
        if fallback:
            figs.note(f"the device restore read through host memory: {fallback}")
        record_restore(figs, agent, model, "restore")

        if agent.suspender is None:
            figs.note("park/resume skipped: this node's driver has no CUDA checkpoint API")
        elif left() < PARK_NEEDS_S:
            figs.note(f"park/resume skipped: {left():.0f} s left of the step, it needs "
                      f"{PARK_NEEDS_S:.0f} s")
        else:
            # the pool's next zygote (started after the restore) warms on the same GPU: let it
            # finish first, so its kernels do not run inside the resume's first token
            try:
                figs.fig("pool_refilled_s", _wait("the pool's next zygote", warmed,
                                                  warm_timeout_s), "s", path=device)
            except RuntimeError as exc:
                figs.note(f"{exc}: parking with it still warming")
            _park_and_resume(figs, agent, scaler, url, model, prompt, max_tokens, text0, targets)

        if targets.cold_base_s is None:
            return
        if left() < COLD_NEEDS_S:
            figs.note(f"cold restore skipped: {left():.0f} s left of the step, it needs "
                      f"{COLD_NEEDS_S:.0f} s")
            return
        _cold_restore(figs, agent, scaler, url, model, prompt, max_tokens, text0, targets,
                      snapshot, row.size_bytes, device, warm_timeout_s)
    finally:
        stack.close()


def _park_and_resume(figs, agent, scaler, url: str, model: str, prompt, max_tokens: int,
                     text0, targets: Targets) -> None:
    t = time.perf_counter()
    scaler.set_target(model, 0, reason="device check: park (release=suspend)")
    parked = _live(agent, "suspended")
    figs.fig("suspend_s", round(time.perf_counter() - t, 3), "s", path="suspended",
             met=parked is not None)
    if parked is None:
        raise RuntimeError("the scaler's park left no suspended replica")
    routed = [i for i in agent.registrar.registry.healthy("rewarm-replica")
              if i.tag("model") == model]
    figs.fig("suspended_in_registry_as_replica", len(routed), "", met=not routed)
    figs.note(f"agent meta while parked: {dict(agent.agent_instance.meta)}")
    answer = _probe_parked(parked.handle.address, model)
    figs.fig("parked_replica_answer", answer, "", met=not answer.startswith("answered"))

    t0 = time.perf_counter()
    scaler.set_target(model, 1, reason="device check: demand")
    text2, _, first_at = complete(url, model, prompt, max_tokens)
    took = round(first_at - t0, 3)
    figs.fig("resume_to_first_token_s", took, "s", path="suspended",
             limit={"target_s": targets.resume_s}, target=f"<= {targets.resume_s} s",
             met=took <= targets.resume_s)
    if isinstance(prompt, list):
        text2 = complete(url, model, prompt, max_tokens, stream=False)[0]
    figs.fig("tokens_match_after_resume", text2 == text0, "", met=text2 == text0)


def _cold_restore(figs, agent, scaler, url: str, model: str, prompt, max_tokens: int, text0,
                  targets: Targets, snapshot: Path, size_bytes: int, device: str,
                  warm_timeout_s: float) -> None:
    assert targets.cold_base_s is not None, "called only with a cold limit"
    scaler.set_target(model, 0, reason="device check: scale to zero again (release=stop)")
    if _live(agent, "warm") is not None or _live(agent, "suspended") is not None:
        raise RuntimeError("the scaler's stop left a replica up before the cold restore")
    try:
        _wait("a zygote warmed for the snapshot (cold restore)",
              lambda: any(z.warm == snapshot for z in agent.pool.get(device, [])), warm_timeout_s)
    except RuntimeError as exc:
        figs.note(f"{exc}: the cold restore takes one that is not")
    rate, sampled = cold_rate(snapshot)
    figs.fig("cold_read_rate", rate, "GB/s", path="host",
             limit={"sample_bytes": sampled})
    resident = drop_snapshot_cache(snapshot)
    figs.note(f"cold restore: page-cache share of the snapshot's files {resident:.2f}")
    limit_s = round(targets.cold_base_s + size_bytes / (rate * 1e9), 3) if rate > 0 else None
    text3, ttft, _ = _first_token(url, model, prompt, max_tokens)
    rec = _live(agent, "warm")
    io = getattr(rec.handle, "restore_io", None) if rec else None
    figs.fig("cold_restore_first_token_s", ttft, "s", path=io or "?",
             limit={"cold_base_s": targets.cold_base_s, "bytes": size_bytes,
                    "cold_read_rate_gbps": rate},
             target=f"<= {limit_s} s" if limit_s else None,
             met=None if limit_s is None else ttft <= limit_s)
    figs.fig("tokens_match_after_cold_restore", text3 == text0, "", met=text3 == text0)
    record_restore(figs, agent, model, "cold_restore")
