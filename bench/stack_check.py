"""The serving path on a GPU node, step by step (bench/device_check.py's ``stack`` step).

The embedded stack (agent/up.py ``Stack``: node agent with its GPU inventory, process-backed
zygotes per device, control API, front door, OpenAI-compatible HTTP entrance) serves one model;
requests go through the HTTP entrance (SSE, greedy, ``ignore_eos``: always ``max_tokens``
tokens), and the warm pool is moved the way the predictor moves it, through its scaler
(agent/cluster/local_scaler.py ``LocalScaler.set_target`` with the predictor's reason words:
``release=suspend`` parks, anything else stops).  The predictor's loop itself is not started,
so its own decisions cannot move the pool between the steps measured.

    cold boot -> capture -> scale to zero -> restore (CUDA zygote, kvikio) -> first token
    -> park (CUDA checkpoint) -> a request straight to the parked process: no tokens
    -> resume -> first token

First-token times are from the request's send to the first SSE chunk, seconds on
``time.perf_counter``.  Targets (SmolLM2-135M): restore to first token <= 0.3 s, resume to
first token <= 0.5 s, tokens identical before and after.
"""

from __future__ import annotations

import functools
import http.client
import json
import shutil
import time
import urllib.parse
from pathlib import Path
from typing import Any
from collections.abc import Callable

RESTORE_TARGET_S = 0.3
RESUME_TARGET_S = 0.5


def complete(url: str, model: str, prompt: str, max_tokens: int,
             timeout_s: float = 150.0) -> tuple[str, float, float]:
    """``(text, first_token_s, first_token_at)``: one streamed /v1/completions request."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout_s)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True, "ignore_eos": True})
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
        first, text = None, []
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("choices"):
                if first is None:
                    first = time.perf_counter()
                text.append(chunk["choices"][0].get("text") or "")
    finally:
        conn.close()
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return "".join(text), round(first - sent, 3), first


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


def run_stack(figs, model_dir: Path, release: Path | None, state: Path, prompt: str,
              max_tokens: int) -> None:
    from agent.cluster.control import control_call
    from agent.cluster.local_scaler import LocalScaler
    from agent.up import Stack

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
              f"release {release or 'none: eager'}")
    scaler = LocalScaler({"up": functools.partial(control_call, stack.agent_address, timeout_s=150.0)})
    try:
        text0, ttft, _ = complete(stack.http_url, model, prompt, max_tokens)
        rec = _live(agent, "warm")
        figs.fig("cold_boot_first_token_s", ttft, "s", path=rec.path if rec else "?")
        spec = agent.spec(model)
        figs.fig("capture_s", _wait("capture", lambda: agent.catalog.newest_ready(
            spec.name, spec.version), 90.0), "s")
        snap = agent.warm_for(device)
        try:
            figs.fig("zygote_warmed_s", _wait("a zygote warmed for the snapshot", lambda: any(
                z.warm == snap for z in agent.pool.get(device, [])), 60.0), "s", path=device)
        except RuntimeError as exc:
            figs.note(f"{exc}: the restore starts one on its path")
        scaler.set_target(model, 0, reason="device check: scale to zero (release=stop)")
        figs.fig("scaled_to_zero", _live(agent, "warm") is None, "", met=_live(agent, "warm") is None)

        text1, ttft, _ = complete(stack.http_url, model, prompt, max_tokens)
        rec = _live(agent, "warm")
        figs.fig("restore_path", rec.path if rec else None, "", met=rec is not None
                 and rec.path == "restore")
        if rec is not None and rec.attempts:
            figs.note(f"failed rungs before it: {rec.attempts}")
        io = getattr(rec.handle, "restore_io", None) if rec else None
        figs.fig("zygote_restore_first_token_s", ttft, "s", path=io or "?",
                 limit={"target_s": RESTORE_TARGET_S}, target=f"<= {RESTORE_TARGET_S} s",
                 met=ttft <= RESTORE_TARGET_S)
        figs.fig("tokens_match_after_restore", text1 == text0, "", met=text1 == text0)
        fallback = getattr(rec.handle, "fallback", None) if rec else None
        if fallback:
            figs.note(f"the device restore read through host memory: {fallback}")
        try:
            figs.note(f"restore phases_s {rec.handle.stats().get('phases_s')} (path {rec.path})")
        except Exception as exc:   # noqa: BLE001 - a note only
            figs.note(f"replica stats unavailable: {exc}")

        if agent.suspender is None:
            figs.note("suspend/resume skipped: this node's driver has no CUDA checkpoint API")
            return
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
        text2, _, first_at = complete(stack.http_url, model, prompt, max_tokens)
        took = round(first_at - t0, 3)
        figs.fig("resume_to_first_token_s", took, "s", path="suspended",
                 limit={"target_s": RESUME_TARGET_S}, target=f"<= {RESUME_TARGET_S} s",
                 met=took <= RESUME_TARGET_S)
        figs.fig("tokens_match_after_resume", text2 == text0, "", met=text2 == text0)
    finally:
        stack.close()
