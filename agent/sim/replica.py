"""A simulated replica that batches and serves at a measured speed, step by step like the engine.

The live replica's loop (agent/replica/batching.py) runs steps back to back while it has work,
each the engine's step (agent/replica/engine.py; agent/speed.py's module docstring): prefill
calls over chunks of the oldest waiting prompts within the step's token budget (the budget
from the replica's reported speed and its ITL target; a further call charged one call's
overhead), each prompt's first token sent when its last chunk's call ends; then one decode step
over every running sequence (B=running, S=1).  Without a budget (``itl_target_s`` 0) each
waiting prompt is prefilled whole, alone, in calls of ``prefill_chunk`` tokens.  A request that
arrives during a step waits for the next one.  :class:`SimReplica` is that loop on a virtual
clock: it plans each call with agent/speed.py's own ``plan_prefill_call`` and
``SpeedProfile.call_budget_tokens`` on the ``reported`` profile (what the live replica's meter
says), and times it with ``speed`` (what the machine does): ``prefill_s(k * L)`` per call,
``decode_step_s(B, C)`` per decode step.  It holds no clock and schedules nothing itself: the
simulation calls :meth:`start_step` when the replica is idle and has work, and :meth:`end_step`
at the time it returned.  A sequence whose one token came from its prefill frees its slot at
once and ends at the end of that step.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from agent.errors import ConfigError
from agent.speed import DEFAULT_ITL_SLO_S, SpeedProfile, plan_prefill_call, slot_wait_steps


@dataclasses.dataclass
class _Waiting:
    request: int
    prompt: int
    output: int
    pos: int = 0              # prompt tokens prefilled so far
    slot: bool = False        # holds a sequence slot (taken when its first chunk runs)


class SimReplica:
    """One replica's engine: ``max_seqs`` slots of ``max_seq_len`` tokens (None: a padded row
    is never short of room); requests are opaque ids with token counts.  It steps at
    ``speed``; it plans its steps, reports and predicts with ``reported`` (its speed meter's
    profile; default ``speed``, which a live replica's meter may get wrong) at the step target
    ``itl_target_s`` (0: whole prompts; None: the profile's own, a live replica's report, else
    the engine's default).  ``prefill_chunk``: the most tokens per row of one call, as the
    engine's (ConfigError below 1)."""

    def __init__(self, speed: SpeedProfile, max_seqs: int,
                 reported: SpeedProfile | None = None, *,
                 itl_target_s: float | None = None, max_seq_len: int | None = None,
                 prefill_chunk: int = 256) -> None:
        self.speed = speed
        reported = reported or speed
        if itl_target_s is None:
            itl_target_s = reported.itl_target_s or DEFAULT_ITL_SLO_S
        # what its speed meter says (reports, predictions), at the step target it plans by
        self.reported = dataclasses.replace(reported, itl_target_s=itl_target_s)
        self.max_seqs = max_seqs
        self.max_seq_len = max_seq_len
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) \
                or prefill_chunk < 1:   # as the engine: a call of no tokens never ends
            raise ConfigError(f"prefill_chunk={prefill_chunk!r} must be an int >= 1",
                              name="prefill_chunk", value=prefill_chunk, limit=1)
        self.prefill_chunk = prefill_chunk
        self._waiting: deque[_Waiting] = deque()
        self._active: list[list[int]] = []                     # [request, remaining, ctx]
        self._queued_tokens = 0
        self._ctx = 0
        self._ending: list[int] = []
        self.stepping = False
        self.generation = 0
        self.steps = 0
        self.calls = 0            # prefill calls so far

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._active)

    @property
    def slots_held(self) -> int:
        """Sequence slots taken: the running sequences and the prompts part-way through."""
        return len(self._active) + sum(1 for w in self._waiting if w.slot)

    def reset(self) -> None:
        """Empty it (the replica stopped); a step in flight is ignored when it ends."""
        generation = self.generation + 1
        self.__init__(self.speed, self.max_seqs, self.reported,  # type: ignore[misc]  # a fresh replica of the same class
                      itl_target_s=self.reported.itl_target_s, max_seq_len=self.max_seq_len,
                      prefill_chunk=self.prefill_chunk)
        self.generation = generation

    def submit(self, request: int, prompt_tokens: int, output_tokens: int) -> None:
        """Queue one request (``output_tokens`` >= 1 tokens to generate)."""
        self._waiting.append(_Waiting(request, int(prompt_tokens), max(1, int(output_tokens))))
        self._queued_tokens += int(prompt_tokens)

    def start_step(self, now_s: float) -> tuple[list[tuple[int, float]], float]:
        """Run one step from ``now_s``: returns ``([(request, first_token_s)], end_s)``."""
        firsts: list[tuple[int, float]] = []
        t = self._prefill_calls(now_s, firsts)
        if self._active:
            t += self.speed.decode_step_s(len(self._active), self._ctx)
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

    def _runnable(self) -> list[_Waiting]:
        """The oldest waiting prompts that hold a slot or can take a free one, in order."""
        out, free = [], self.max_seqs - self.slots_held
        for w in self._waiting:
            if not w.slot:
                if free == 0:
                    break
                free -= 1
            out.append(w)
        return out

    def _prefill_calls(self, t: float, firsts: list[tuple[int, float]]) -> float:
        """The step's prefill calls from time ``t`` (the engine's rule, module docstring);
        appends each completed prompt's ``(request, first_token_s)``; returns the time after."""
        budget = self.reported.prefill_budget_tokens(len(self._active), self._ctx)
        calls, room = 0, self.max_seq_len or (1 << 62)
        while True:
            group = self._runnable()
            if not group:
                return t
            if budget is None:     # whole prompts: the head alone, in calls of prefill_chunk
                rows = [min(self.prefill_chunk, group[0].prompt - group[0].pos)]
            else:
                call_budget = self.reported.call_budget_tokens(budget, calls)
                if call_budget <= 0:
                    return t
                rows = plan_prefill_call(
                    [w.prompt - w.pos for w in group], [room - w.pos for w in group],
                    call_budget, self.prefill_chunk, self.reported.call_overhead_tokens())
                budget = call_budget - len(rows) * max(rows)
            calls += 1
            self.calls += 1
            t += self.speed.prefill_s(len(rows) * max(rows))
            for w, n in zip(group[:len(rows)], rows, strict=True):
                w.slot = True
                w.pos += n
                self._queued_tokens -= n
                if w.pos == w.prompt:
                    self._start(w, t, firsts)

    def _start(self, w: _Waiting, t: float, firsts: list[tuple[int, float]]) -> None:
        """``w``'s prompt is prefilled at ``t``: its first token; it runs, or ends (one token)."""
        self._waiting.remove(w)
        firsts.append((w.request, t))     # sent when its call ends (agent/replica/batching.py)
        if w.output <= 1:
            self._ending.append(w.request)
        else:
            self._active.append([w.request, w.output - 1, w.prompt])
            self._ctx += w.prompt

    def end_step(self) -> list[int]:
        """The step ended: the requests it finished."""
        self.stepping = False
        done, self._ending = self._ending, []
        return done

    # --- what the live replica reports and predicts --------------------------------------
    def report(self) -> dict[str, float]:
        """The load report a live replica gives (agent/speed.py's keys), KV left out:
        ``active_seqs`` the slots held, as the engine's capacity counts them."""
        return {"max_seqs": self.max_seqs, "active_seqs": self.slots_held,
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
