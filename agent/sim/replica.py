"""A simulated replica that batches and serves at a measured speed, step by step like the engine.

The live replica's loop (agent/replica/worker.py) runs steps back to back while it has work:
each step first prefills the waiting sequences that free slots admit, one after another (B=1),
each first token sent as its own prefill ends; then one decode step over every active sequence (B=active, S=1).
A request that arrives during a step waits for the next one.  :class:`SimReplica` is that loop
on a virtual clock, with every duration from agent/speed.py's :class:`SpeedProfile` (measured
by bench/engine_profile.py): ``prefill_s(P)`` per admitted prompt, ``decode_step_s(B, C)`` per
decode step.  It holds no clock and schedules nothing itself: the simulation calls
:meth:`start_step` when the replica is idle and has work, and :meth:`end_step` at the time it
returned.  A sequence whose one token came from its prefill ends at the end of that step.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from agent.errors import ConfigError
from agent.speed import SpeedProfile, slot_wait_steps


class SimReplica:
    """One replica's engine: ``max_seqs`` slots; requests are opaque ids with token counts.
    It steps at ``speed``; it reports and predicts with ``reported`` (its speed meter's
    profile; default ``speed``), which a live replica's meter may get wrong."""

    def __init__(self, speed: SpeedProfile, max_seqs: int,
                 reported: SpeedProfile | None = None) -> None:
        self.speed = speed
        self.reported = reported or speed   # what its speed meter says (reports, predictions)
        self.max_seqs = max_seqs
        self._waiting: deque[tuple[int, int, int]] = deque()   # (request, prompt, output)
        self._active: list[list[int]] = []                     # [request, remaining, ctx]
        self._queued_tokens = 0
        self._ctx = 0
        self._ending: list[int] = []
        self.stepping = False
        self.generation = 0
        self.steps = 0

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._active)

    def reset(self) -> None:
        """Empty it (the replica stopped); a step in flight is ignored when it ends."""
        generation = self.generation + 1
        self.__init__(self.speed, self.max_seqs, self.reported)  # type: ignore[misc]  # a fresh replica of the same class
        self.generation = generation

    def submit(self, request: int, prompt_tokens: int, output_tokens: int) -> None:
        """Queue one request (``output_tokens`` >= 1 tokens to generate)."""
        self._waiting.append((request, int(prompt_tokens), max(1, int(output_tokens))))
        self._queued_tokens += int(prompt_tokens)

    def start_step(self, now_s: float) -> tuple[list[tuple[int, float]], float]:
        """Run one step from ``now_s``: returns ``([(request, first_token_s)], end_s)``."""
        sp, t = self.speed, now_s
        firsts = []
        while self._waiting and len(self._active) < self.max_seqs:
            req, p, o = self._waiting.popleft()
            self._queued_tokens -= p
            t += sp.prefill_s(p)
            firsts.append((req, t))     # sent when its own prefill ends (agent/replica/worker.py)
            if o <= 1:
                self._ending.append(req)
            else:
                self._active.append([req, o - 1, p])
                self._ctx += p
        if self._active:
            t += sp.decode_step_s(len(self._active), self._ctx)
            still = []
            for seq in self._active:
                seq[1] -= 1
                seq[2] += 1
                if seq[1] == 0:
                    self._ending.append(seq[0])
                    self._ctx -= seq[2] - 1
                else:
                    still.append(seq)
            self._ctx += len(still)
            self._active = still
        self.stepping = True
        self.steps += 1
        return firsts, t

    def end_step(self) -> list[int]:
        """The step ended: the requests it finished."""
        self.stepping = False
        done, self._ending = self._ending, []
        return done

    # --- what the live replica reports and predicts --------------------------------------
    def report(self) -> dict[str, float]:
        """The load report a live replica gives (agent/speed.py's keys), KV left out."""
        return {"max_seqs": self.max_seqs, "active_seqs": len(self._active),
                "waiting_seqs": len(self._waiting), "queued_prefill_tokens": self._queued_tokens,
                "active_ctx_tokens": self._ctx, **self.reported.to_dict()}

    def predict_ttft_s(self, prompt_tokens: int) -> float:
        """What the live replica predicts for a new request (agent/replica/engine.py)."""
        remaining = sorted(seq[1] for seq in self._active)
        return self.reported.predict_ttft_s(
            prompt_tokens, active_seqs=len(self._active), active_ctx_tokens=self._ctx,
            waiting_seqs=len(self._waiting), queued_prefill_tokens=self._queued_tokens,
            slot_wait_steps=slot_wait_steps(remaining, len(self._waiting),
                                            self.max_seqs - len(self._active)))


def service_s(speed: SpeedProfile, prompt: np.ndarray, output: np.ndarray, batch: int) -> np.ndarray:
    """Seconds each request [N] holds a slot at a steady batch of ``batch``: its prefill, then
    ``output - 1`` decode steps at that batch over the batch's mean context."""
    ctx = int(batch * float(np.mean(prompt + output / 2.0))) if len(prompt) else 0
    step = speed.decode_step_s(batch, ctx)
    return speed.prefill_overhead_s + prompt / speed.prefill_tokens_per_s \
        + np.maximum(output - 1, 0) * step


def fit_tokens(prompt: np.ndarray, output: np.ndarray, max_seq_len: int,
               token_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, int]:
    """Scale token counts by ``token_scale`` (at least 1 each) and shrink, keeping its
    prompt:output ratio, any request longer than a slot of ``max_seq_len`` tokens.  Returns
    ``(prompt, output, requests_shrunk)``.  Raises ConfigError for a scale that is not > 0."""
    if not token_scale > 0 or token_scale == float("inf"):
        raise ConfigError(f"token_scale={token_scale} must be a finite number > 0",
                          name="token_scale", value=token_scale, limit="> 0")
    p = np.maximum(1, np.rint(prompt * token_scale)).astype(np.int64)
    o = np.maximum(1, np.rint(output * token_scale)).astype(np.int64)
    over = p + o > max_seq_len
    if over.any():
        f = max_seq_len / (p[over] + o[over])
        o_new = np.maximum(1, np.floor(o[over] * f)).astype(np.int64)
        p[over] = np.maximum(1, np.minimum(np.floor(p[over] * f), max_seq_len - o_new)).astype(np.int64)
        o[over] = np.minimum(o_new, max_seq_len - p[over])
    return p, o, int(over.sum())
