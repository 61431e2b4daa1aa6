"""The engine: chunked prefill and batched decode of many sequences over the slot-allocated KV cache.

One step (:meth:`Engine.step`; the replica's loop runs the same parts one engine call at a
time, agent/replica/batching.py):

1. :meth:`Engine.begin_step` sets the step's prefill budget in prompt tokens from the measured
   speed and the inter-token-latency target ``itl_target_s`` (agent/speed.py
   ``SpeedProfile.prefill_budget_tokens``: what fits beside the decode of the running batch
   within the target; vLLM's ``max_num_batched_tokens``, sized as Sarathi-Serve sizes it);
2. :meth:`Engine.prefill`, while :attr:`Engine.can_prefill`: one forward call over the oldest
   waiting sequence's next chunk, and the whole prompts of the next ones when they may share
   it (agent/speed.py ``plan_prefill_call``: rows ``[k, L]``, shorter ones padded, within the
   budget left).  A sequence takes its KV slot when its first chunk runs; when its last chunk
   runs its first token is sampled and returned at once, and it joins the running batch.  A
   further call in the step is charged one call's overhead (``SpeedProfile.call_budget_tokens``);
3. :meth:`Engine.decode`: one decode step over every running sequence (B=running, S=1).

With ``itl_target_s`` 0 there is no budget: each waiting sequence is prefilled whole, alone
(B=1, in chunks of ``prefill_chunk``), one per :meth:`Engine.prefill` call, before the decode
(:meth:`Engine.admit`: the schedule without chunked prefill).  Why the chunks of several
sequences share one call and the decode never does: agent/speed.py's module docstring, with
the measurements.

Padding is safe because a row's padded positions lie past its written prompt in its own
slot: attention masks key positions after each query (agent/replica/model.py), and each later
chunk or decode writes a position before any query reads it.

Every call goes through the same ``forward(tokens, input_pos, cache_batch_idx, k_caches,
v_caches, logit_pos)`` (see agent/replica/model.py), either the eager :class:`Transformer` or
any callable with that signature (a loaded AOT package, a ``torch.compile`` of the module).
Serving asks for one position's logits per row (K = 1): a prefill call's last prompt token
of each row (its padding and earlier tokens need none), a decode step's one token.

Sampling is per sequence (agent/replica/sampling.py: greedy, or temperature / top-k / top-p
with a per-sequence seeded generator); a decode step samples every active sequence from one
[B, V] logits tensor.  A sequence ends after ``max_tokens`` new tokens or when it samples a
stop token (the stop token is not returned).

Speed: every prefill call (its tokens counted over all rows, padding included, its first
tokens sampled) and every decode step (sampling included) is timed with the injected
``clock`` and fed to the engine's :class:`~agent.replica.speedmeter.SpeedMeter`;
:meth:`Engine.profile` is the meter's fit with the engine's ITL target; :attr:`Engine.load`
is the queue as of the last change (published on the engine thread, read by the server
without a lock), and :meth:`Engine.predict_ttft_s` what a new request would meet.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from agent.errors import ConfigError, ProtocolError
from agent.replica.config import LlamaConfig
from agent.replica.kv import KVPlan, KVSlotAllocator, plan_kv
from agent.replica.lockstep import Lockstep
from agent.replica.model import Transformer, every_position, last_positions, new_kv_caches
from agent.replica.sampling import (GREEDY, MAX_SEED, Sampler, Sampling, make_sampler,  # noqa: F401
                                    sample, sample_rows)
from agent.replica.speedmeter import SpeedMeter
from agent.speed import (DEFAULT_ITL_SLO_S, MAX_PROFILE_S, SpeedProfile, plan_prefill_call,
                         slot_wait_steps)

Forward = Callable[..., torch.Tensor]

MAX_OVERRUN_SHARE = 0.25
"""The most of its ITL target a step gives up to its measured overrun: beyond a quarter the
overrun is a neighbour's stall on the CPU (seconds, measured in bench/prefill_burst.py), which
smaller steps do not shorten but which they would pay for in TTFT."""


def mark_dynamic_inputs(tokens: torch.Tensor, input_pos: torch.Tensor, cache_batch_idx: torch.Tensor,
                        k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                        logit_pos: torch.Tensor) -> None:
    """Mark the four dynamic sizes for ``torch.compile``: active batch (dim 0 of tokens,
    input_pos, cache_batch_idx, logit_pos), sequence length (dim 1 of tokens, input_pos),
    cache batch (dim 0 of every cache) and logit positions (dim 1 of logit_pos): the ``Dim``s
    the AOT export declares (agent/replica/aot.py)."""
    mark = torch._dynamo.mark_dynamic
    for t in (tokens, input_pos, logit_pos):
        mark(t, 0)
        mark(t, 1)
    mark(cache_batch_idx, 0)
    for c in (*k_caches, *v_caches):
        mark(c, 0)


def jit_forward(model: torch.nn.Module, **compile_kwargs) -> Forward:
    """``torch.compile(model)`` with the dynamic dimensions marked on every call: the
    just-in-time path (``naive_s`` / ``jit_cached_s`` in bench/cold_start.py).  Pass it to
    :class:`Engine` as ``forward`` and call :meth:`Engine.warmup` before serving."""
    compiled = torch.compile(model, **compile_kwargs)

    def forward(tokens, input_pos, cache_batch_idx, k_caches, v_caches, logit_pos):
        mark_dynamic_inputs(tokens, input_pos, cache_batch_idx, k_caches, v_caches, logit_pos)
        return compiled(tokens, input_pos, cache_batch_idx, k_caches, v_caches, logit_pos)

    return forward


@dataclasses.dataclass
class _Seq:
    seq_id: int
    prompt: list[int]
    max_tokens: int
    stop: frozenset[int]
    sampler: Sampler
    slot: int = -1             # its KV slot, taken when its first chunk runs
    pos: int = 0               # tokens written to the cache so far (prefill done at len(prompt))
    last: int = -1             # the token to feed next
    produced: int = 0


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """The engine's queue as of its last change (agent/speed.py's ``QUEUE_META_KEYS`` and
    ``active_seqs``).  ``waiting_seqs``: sequences with prompt tokens still to prefill (a
    partly prefilled one holds its slot), ``queued_prefill_tokens`` those tokens;
    ``active_seqs`` the running (decoding) sequences, ``active_ctx_tokens`` their cached
    tokens.  ``remaining_tokens``: tokens each active sequence may still produce
    (``max_tokens - produced``, an upper bound: a stop token ends one sooner), ascending."""

    waiting_seqs: int = 0
    queued_prefill_tokens: int = 0
    active_seqs: int = 0
    active_ctx_tokens: int = 0
    remaining_tokens: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Event:
    """One generated token (``token`` is -1 on the final event of a stopped sequence)."""

    seq_id: int
    token: int
    done: bool


class Engine(Lockstep):
    """Serve one model: ``generate`` for whole batches, ``submit``/``step`` for a server loop,
    ``generate_lockstep`` / ``teacher_forced`` for prompt sets run together (agent/replica/lockstep.py).

    ``weights`` are runtime-layout tensors (adopted without a copy); they may be None when
    ``forward`` is given and carries its own weights.  ``max_seqs`` slots of ``max_seq_len``
    tokens are allocated at construction: ``max_seqs * max_seq_len * config.kv_bytes_per_token``
    bytes for K and V together (weights already on another device are moved to ``device``).
    ``prefill_chunk``: the most tokens per row of one prefill call; ``itl_target_s``: the
    step's inter-token-latency target (s, default agent/speed.py's
    :data:`~agent.speed.DEFAULT_ITL_SLO_S`; 0: no prefill budget, whole prompts; settable
    while serving).  Raises ConfigError for a target that is not a finite number >= 0, or
    over :data:`~agent.speed.MAX_PROFILE_S` (the most a load report may carry), and for a
    ``prefill_chunk`` that is not an int >= 1.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor] | None, *,
                 max_seqs: int, max_seq_len: int, forward: Forward | None = None,
                 device: str = "cpu", prefill_chunk: int = 256, temperature: float = 1.0,
                 top_k: int | None = None, meter: SpeedMeter | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 itl_target_s: float = DEFAULT_ITL_SLO_S) -> None:
        self.config = config
        if weights is not None and any(t.device != torch.device(device) for t in weights.values()):
            weights = {k: t.to(device) for k, t in weights.items()}  # e.g. host restore -> GPU
        self.model = Transformer.from_weights(config, weights) if weights is not None else None
        if forward is None:
            if self.model is None:
                raise ProtocolError("Engine needs weights or a forward callable",
                                    field="weights", value=None, limit=None)
            forward = self.model
        self.forward: Forward = forward
        self.device = torch.device(device)
        self.kv = KVSlotAllocator(max_seqs, max_seq_len)
        self.k_caches, self.v_caches = new_kv_caches(config, max_seqs, max_seq_len, self.device)
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) \
                or prefill_chunk < 1:   # a call of no tokens advances no prompt: for ever
            raise ConfigError(f"prefill_chunk={prefill_chunk!r} must be an int >= 1 (tokens "
                              "per row of one prefill call)", name="prefill_chunk",
                              value=prefill_chunk, limit=1)
        self.prefill_chunk = prefill_chunk
        self.temperature, self.top_k = temperature, top_k
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._active: dict[int, _Seq] = {}
        self._next_id = 0
        self.plan: KVPlan | None = None  # set by Engine.sized
        self.meter = meter if meter is not None else SpeedMeter()
        self.clock = clock
        self.itl_target_s = itl_target_s
        self._budget_left: int | None = None   # this step's prefill budget left (tokens)
        self._step_calls = 0                   # prefill calls so far in this step
        self._step_plan_s = 0.0                # the fit's seconds for this step's calls so far
        self._step_t0 = 0.0
        self.load = EngineLoad()

    @property
    def itl_target_s(self) -> float:
        """The step's inter-token-latency target (s); 0: no prefill budget (whole prompts)."""
        return self._itl_target_s

    @itl_target_s.setter
    def itl_target_s(self, value: float) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool) \
                or not math.isfinite(value) or value < 0:
            raise ConfigError(f"itl_target_s={value!r} must be a finite number >= 0 (0: no "
                              "prefill budget)", name="itl_target_s", value=value, limit=0)
        if value > MAX_PROFILE_S:   # what a load report may carry (agent/speed.py)
            raise ConfigError(f"itl_target_s={value!r} exceeds {MAX_PROFILE_S:g} s",
                              name="itl_target_s", value=value, limit=MAX_PROFILE_S)
        self._itl_target_s = float(value)

    def profile(self) -> SpeedProfile:
        """The measured speed (the meter's fit) with the step target this engine plans by:
        its ITL target less the p99 of its steps' overruns (the meter's
        ``step_overrun_s``), by at most :data:`MAX_OVERRUN_SHARE` of the target; 0 without
        one.  The one model the step's budget, the load report and :meth:`predict_ttft_s`
        use."""
        target = self.itl_target_s
        if target > 0:
            target -= min(MAX_OVERRUN_SHARE * target, self.meter.step_overrun_s())
        return dataclasses.replace(self.meter.profile(), itl_target_s=target)

    @classmethod
    def sized(cls, config: LlamaConfig, weights, *, budget_bytes: int, max_seq_len: int,
              max_seqs_limit: int | None = None, **kwargs) -> Engine:
        """An engine with as many slots as ``budget_bytes`` holds (see agent/replica/kv.py)."""
        plan = plan_kv(config, budget_bytes, max_seq_len, max_seqs_limit)
        engine = cls(config, weights, max_seqs=plan.max_seqs, max_seq_len=max_seq_len, **kwargs)
        engine.plan = plan
        return engine

    # --- capacity ------------------------------------------------------------------------
    def capacity(self, context_len: int | None = None) -> dict[str, int]:
        """KV capacity in tokens and sequences (``seqs_at_context`` for ``context_len``)."""
        plan = KVPlan(self.config.kv_bytes_per_token,
                      self.kv.capacity_tokens * self.config.kv_bytes_per_token,
                      self.kv.max_seq_len, self.kv.max_seqs)
        out = {"kv_capacity_tokens": self.kv.capacity_tokens, "kv_used_tokens": self.kv.used_tokens,
               "max_seqs": self.kv.max_seqs, "active_seqs": self.kv.active,
               "max_seq_len": self.kv.max_seq_len, "kv_bytes_per_token": plan.bytes_per_token,
               "kv_cache_bytes": plan.cache_bytes}
        load = self.load
        out.update(waiting_seqs=load.waiting_seqs, queued_prefill_tokens=load.queued_prefill_tokens,
                   active_ctx_tokens=load.active_ctx_tokens)
        if context_len is not None:
            out["context_len"] = context_len
            out["seqs_at_context"] = min(self.kv.max_seqs, plan.seqs_at(context_len)) \
                if context_len <= self.kv.max_seq_len else 0
        return out

    def warmup(self) -> int:
        """Run the forward once per shape class the engine will use, before serving: B and S of
        1 and 2, each with the logits of its last position (K = 1, serving) and, where S is 2,
        of every position (K = S, the golden check's replay): compilers specialise size 1, so
        these cover every graph a ``torch.compile``-d forward needs; after this no (B, S, K)
        recompiles, see tests/replica/test_recompiles.py.  Writes only into free slots, whose
        contents no sequence reads (the causal mask hides positions a sequence has not
        written).  Returns the number of forward calls.  Raises ProtocolError while sequences
        are active."""
        if self._active:
            raise ProtocolError("warmup with sequences active", field="active_seqs",
                                value=len(self._active), limit=0)
        calls = 0
        with torch.inference_mode():
            for b in sorted({1, min(2, self.kv.max_seqs)}):
                for s in sorted({1, min(2, self.kv.max_seq_len)}):
                    tokens = torch.zeros((b, s), dtype=torch.int64, device=self.device)
                    pos = torch.arange(s, device=self.device).repeat(b, 1)
                    idx = torch.arange(b, device=self.device)
                    picks = [last_positions([s] * b, self.device)]
                    if s > 1:
                        picks.append(every_position(b, s, self.device))
                    for logit_pos in picks:
                        self.forward(tokens, pos, idx, self.k_caches, self.v_caches, logit_pos)
                        calls += 1
        return calls

    # --- the server-loop API ---------------------------------------------------------------
    def submit(self, prompt: Sequence[int], max_tokens: int, seed: int | None = None,
               stop: set[int] | frozenset[int] | None = None,
               sampling: Sampling = GREEDY) -> int:
        """Queue one sequence; returns its id.  Raises ProtocolError (empty prompt, token id
        out of [0, vocab_size), max_tokens < 1, seed outside [0, MAX_SEED], temperature < 0,
        top_p outside (0, 1], top_k < 0) or CapacityExceeded (prompt + max_tokens longer
        than a slot) before anything is allocated."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ProtocolError("prompt has no tokens", field="tokens", value=0, limit=1)
        bad = next((t for t in prompt if not 0 <= t < self.config.vocab_size), None)
        if bad is not None:
            raise ProtocolError(f"token id {bad} outside [0, {self.config.vocab_size})",
                                field="tokens", value=bad, limit=self.config.vocab_size)
        if max_tokens < 1:
            raise ProtocolError(f"max_tokens={max_tokens} must be >= 1", field="max_tokens",
                                value=max_tokens, limit=1)
        sampler = make_sampler(seed, sampling, default_temperature=self.temperature,
                               default_top_k=self.top_k, vocab_size=self.config.vocab_size)
        self.kv.check(len(prompt) + max_tokens)
        seq = _Seq(self._next_id, prompt, max_tokens, frozenset(stop or ()), sampler)
        self._next_id += 1
        self._waiting.append(seq)
        self._publish()
        return seq.seq_id

    def adopt_prefilled(self, prompt: Sequence[int], logits: torch.Tensor, max_tokens: int, *,
                        seed: int | None = None, stop: set[int] | None = None) -> tuple[int, int]:
        """Take over a sequence whose prompt was already prefilled into slot 0 of this engine's
        caches (agent/replica/firstboot.py).  ``logits`` [V] are the prompt's last position.
        Returns ``(seq_id, first_token)`` (token -1 when it was a stop token).  Raises
        ProtocolError unless the engine is empty, as :meth:`submit` for the request."""
        if self._active or self._waiting:
            raise ProtocolError("adopt_prefilled needs an empty engine", field="active_seqs",
                                value=len(self._active) + len(self._waiting), limit=0)
        seq_id = self.submit(prompt, max_tokens, seed, stop)
        seq = self._waiting.pop()
        seq.slot = self.kv.allocate(len(seq.prompt) + seq.max_tokens)  # the lowest: slot 0
        seq.pos = len(seq.prompt)
        self._active[seq.slot] = seq
        token = self._emit(seq, self._sample(seq, logits)).token
        self._publish()
        return seq_id, token

    def cancel(self, seq_id: int) -> None:
        """Drop a waiting, partly prefilled or active sequence (freeing its slot); unknown
        ids are ignored."""
        for seq in [s for s in self._waiting if s.seq_id == seq_id]:
            self._drop_waiting(seq)
        for slot, seq in list(self._active.items()):
            if seq.seq_id == seq_id:
                del self._active[slot]
                self.kv.free(slot)
        self._publish()

    def _drop_waiting(self, seq: _Seq) -> None:
        """Take ``seq`` off the waiting queue and free the slot it holds (if any)."""
        self._waiting = collections.deque(s for s in self._waiting if s is not seq)
        if seq.slot >= 0:
            self.kv.free(seq.slot)
            seq.slot = -1

    def _publish(self) -> None:
        """Replace :attr:`load` (one reference write: readers on other threads see the old
        or the new queue, never a half-updated one)."""
        active = list(self._active.values())
        self.load = EngineLoad(
            waiting_seqs=len(self._waiting),
            queued_prefill_tokens=sum(len(s.prompt) - s.pos for s in self._waiting),
            active_seqs=len(active), active_ctx_tokens=sum(s.pos for s in active),
            remaining_tokens=tuple(sorted(s.max_tokens - s.produced for s in active)))

    def speed_report(self, active_seqs: int | None = None,
                     active_ctx_tokens: int | None = None) -> dict[str, float]:
        """The measured speed for a load report: agent/speed.py's ``SPEED_META_KEYS`` (the
        ITL target among them), ``decode_tokens_per_s_per_seq`` at the current batch (or the
        one given), and ``prefill_budget_tokens`` a step there may prefill and
        ``step_overrun_s`` the p99 of the steps' overrun of their plan (both absent without a
        budget); {} until the meter has measured (contract: absent, never a guess)."""
        if not self.meter.measured:
            return {}
        profile, load = self.profile(), self.load
        batch = load.active_seqs if active_seqs is None else active_seqs
        ctx = load.active_ctx_tokens if active_ctx_tokens is None else active_ctx_tokens
        out = profile.to_dict()
        out["decode_tokens_per_s_per_seq"] = profile.decode_tokens_per_s(batch, ctx)
        budget = profile.prefill_budget_tokens(batch, ctx)
        if budget is not None:
            out["prefill_budget_tokens"] = budget
            out["step_overrun_s"] = self.meter.step_overrun_s()
        return out

    def predict_ttft_s(self, prompt_tokens: int, *, waiting_seqs: int = 0,
                       queued_prefill_tokens: int = 0) -> float:
        """Predicted TTFT (s) of a new request of ``prompt_tokens`` tokens submitted now, behind
        :attr:`load` plus ``waiting_seqs`` sequences of ``queued_prefill_tokens`` tokens the
        caller has not submitted yet (agent/speed.py's model on :meth:`profile`).  When
        more sequences wait than slots are free, it also waits for the earliest-ending active
        sequences to finish (their remaining tokens, one decode step each)."""
        load, profile = self.load, self.profile()
        waiting = load.waiting_seqs + waiting_seqs
        slot_wait = slot_wait_steps(load.remaining_tokens, waiting,
                                    self.kv.max_seqs - load.active_seqs)
        return profile.predict_ttft_s(
            prompt_tokens, active_seqs=load.active_seqs, active_ctx_tokens=load.active_ctx_tokens,
            waiting_seqs=waiting, queued_prefill_tokens=load.queued_prefill_tokens
            + queued_prefill_tokens, slot_wait_steps=slot_wait)

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._active)

    def step(self) -> list[Event]:
        """One step (module docstring): the prefill calls its budget allows, then one batched
        decode step; the events in the order they were produced."""
        self.begin_step()
        events: list[Event] = []
        while self.can_prefill:
            events += self.prefill()
        events += self.decode()
        self.end_step()
        return events

    # --- the step's parts ----------------------------------------------------------------
    def begin_step(self) -> int | None:
        """Start a step: its prefill budget in prompt tokens at the running batch (None:
        no budget, whole prompts), which the step's :meth:`prefill` calls spend."""
        load = self.load
        self._budget_left = self.profile().prefill_budget_tokens(load.active_seqs,
                                                                 load.active_ctx_tokens)
        self._step_calls, self._step_plan_s, self._step_t0 = 0, 0.0, self.clock()
        return self._budget_left

    def end_step(self, elapsed_s: float | None = None) -> None:
        """End a step begun by :meth:`begin_step`: one that ran a prefill call tells the
        meter its plan and ``elapsed_s``, its wall time as the caller's loop saw it (default:
        since :meth:`begin_step` on :attr:`clock`), whose overrun the next budgets allow for
        (:meth:`profile`)."""
        if self._step_calls:
            self.meter.observe_step(self._step_plan_s, self.clock() - self._step_t0
                                    if elapsed_s is None else elapsed_s)

    def _runnable(self) -> list[_Seq]:
        """The oldest waiting sequences that hold a slot or can take a free one, in order."""
        out, free = [], self.kv.free_slots
        for seq in self._waiting:
            if seq.slot < 0:
                if free == 0:
                    break
                free -= 1
            out.append(seq)
        return out

    def _call_budget(self) -> int:
        """Prompt tokens the next prefill call of this step may use (0: none)."""
        assert self._budget_left is not None
        return self.profile().call_budget_tokens(self._budget_left, self._step_calls)

    @property
    def can_prefill(self) -> bool:
        """Whether :meth:`prefill` would run a call now: a waiting sequence holds or can take
        a slot and the step's budget (if any) allows another call."""
        if not self._waiting or (self._waiting[0].slot < 0 and self.kv.free_slots == 0):
            return False
        return self._budget_left is None or self._call_budget() > 0

    def prefill(self) -> list[Event]:
        """One prefill call of the step (module docstring): the first tokens of the
        sequences whose last chunk it ran.  Timed for the meter.  A call that raises frees
        the slots of its sequences and drops them (what it wrote is unknown), then raises."""
        if self._budget_left is None:
            return self.admit(1)
        budget = self._call_budget()
        group = self._runnable()
        profile = self.profile()
        rows = plan_prefill_call([len(s.prompt) - s.pos for s in group],
                                 [self.kv.max_seq_len - s.pos for s in group], budget,
                                 self.prefill_chunk, profile.call_overhead_tokens()) \
            if budget > 0 else []
        if not rows:
            return []
        group = group[:len(rows)]
        width = max(rows)
        self._budget_left = budget - len(rows) * width   # its overhead, if any, is off budget
        self._step_calls += 1
        self._step_plan_s += profile.prefill_s(len(rows) * width)
        clock, t0 = self.clock, self.clock()
        try:
            for seq in group:
                if seq.slot < 0:
                    seq.slot = self.kv.allocate(len(seq.prompt) + seq.max_tokens)
            picks = self._run_chunks(group, rows, width)
        except BaseException:   # e.g. a forward that refused the call: no slot is leaked
            for seq in group:
                self._drop_waiting(seq)
            self._publish()
            raise
        events = []
        for seq, n in zip(group, rows, strict=True):
            seq.pos += n
            if seq.pos == len(seq.prompt):
                self._waiting = collections.deque(s for s in self._waiting if s is not seq)
                self._active[seq.slot] = seq
                events.append(self._emit(seq, picks[seq.seq_id]))
        self.meter.observe_prefill(len(rows) * width, clock() - t0)
        self._publish()
        return events

    def _run_chunks(self, group: list[_Seq], rows: list[int], width: int) -> dict[int, int]:
        """One forward call ``[len(group), width]`` over the next ``rows[i]`` prompt tokens of
        each sequence (shorter rows padded with token 0 past their chunk), with the logits of
        each row's last chunk token only (K = 1); returns the first token of each sequence
        whose prompt this call completes, by sequence id."""
        dev = self.device
        with torch.inference_mode():   # inputs made as warmup makes them (no recompile)
            tokens = torch.tensor([s.prompt[s.pos:s.pos + n] + [0] * (width - n)
                                   for s, n in zip(group, rows, strict=True)],
                                  dtype=torch.int64, device=dev)
            pos = torch.stack([torch.arange(s.pos, s.pos + width, device=dev) for s in group])
            idx = torch.tensor([s.slot for s in group], dtype=torch.int64, device=dev)
            logits = self.forward(tokens, pos, idx, self.k_caches, self.v_caches,
                                  last_positions(rows, dev))                    # [k, 1, V]
            done = [(i, s) for i, (s, n) in enumerate(zip(group, rows, strict=True))
                    if s.pos + n == len(s.prompt)]
            if not done:
                return {}
            last = logits[[i for i, _ in done], 0]                              # [F, V]
            picked = sample_rows([s.sampler for _, s in done], last)            # one host sync
        return {s.seq_id: token for (_, s), token in zip(done, picked, strict=True)}

    @property
    def can_admit(self) -> bool:
        """Whether a sequence waits and a slot is free for it (:meth:`admit` would prefill)."""
        return bool(self._waiting) and (self._waiting[0].slot >= 0 or self.kv.free_slots > 0)

    def admit(self, limit: int | None = None) -> list[Event]:
        """Prefill waiting sequences whole (alone, in chunks of ``prefill_chunk``, oldest
        first) while slots are free, at most ``limit`` of them (None: all that fit); returns
        their first tokens.  The step's prefill without a budget; each chunk is timed for the
        meter.  A sequence whose chunk raises is dropped with its slot freed."""
        events: list[Event] = []
        while self.can_admit and (limit is None or len(events) < limit):
            seq = self._waiting[0]
            if seq.slot < 0:
                seq.slot = self.kv.allocate(len(seq.prompt) + seq.max_tokens)
            try:
                token = self._prefill_chunks(seq)
            except BaseException:   # e.g. a forward that refused the call: no slot is leaked
                self._drop_waiting(seq)
                self._publish()
                raise
            self._waiting.popleft()
            self._active[seq.slot] = seq
            events.append(self._emit(seq, token))
        if events:
            self._publish()
        return events

    def _prefill_chunks(self, seq: _Seq) -> int:
        """The rest of ``seq``'s prompt, B=1, in chunks of ``prefill_chunk`` (each timed for
        the meter, the last with its first token's sampling); returns that first token."""
        with torch.inference_mode():
            while True:
                t0 = self.clock()
                n = min(self.prefill_chunk, len(seq.prompt) - seq.pos)
                picks = self._run_chunks([seq], [n], n)
                seq.pos += n
                self.meter.observe_prefill(n, self.clock() - t0)
                if seq.pos == len(seq.prompt):
                    return picks[seq.seq_id]

    def decode(self) -> list[Event]:
        """The step's last part: one decode step over every active sequence (B=active,
        S=1), timed for the meter with the context it read (tokens cached before the step)."""
        batch = list(self._active.values())
        if not batch:
            return []
        events: list[Event] = []
        t0 = self.clock()
        ctx = sum(s.pos for s in batch)
        self._step_plan_s += self.meter.profile().decode_step_s(len(batch), ctx)
        with torch.inference_mode():
            dev = self.device
            tokens = torch.tensor([[s.last] for s in batch], dtype=torch.int64, device=dev)
            pos = torch.tensor([[s.pos] for s in batch], dtype=torch.int64, device=dev)
            idx = torch.tensor([s.slot for s in batch], dtype=torch.int64, device=dev)
            logits = self.forward(tokens, pos, idx, self.k_caches, self.v_caches,
                                  last_positions([1] * len(batch), dev))[:, 0]   # [B, V]
            picked = sample_rows([s.sampler for s in batch], logits)   # one host sync
            for seq, token in zip(batch, picked, strict=True):
                seq.pos += 1
                events.append(self._emit(seq, token))
        self.meter.observe_decode(len(batch), ctx, self.clock() - t0)
        self._publish()
        return events

    def _sample(self, seq: _Seq, logits: torch.Tensor) -> int:
        """One token for ``seq`` from ``logits`` [V] (agent/replica/sampling.py)."""
        return sample(seq.sampler, logits)

    def _emit(self, seq: _Seq, token: int) -> Event:
        seq.produced += 1
        stopped = token in seq.stop
        done = stopped or seq.produced >= seq.max_tokens
        seq.last = token
        if done:
            del self._active[seq.slot]
            self.kv.free(seq.slot)
        return Event(seq.seq_id, -1 if stopped else token, done)

    # --- whole batches ---------------------------------------------------------------------
    def generate_stream(self, prompts: list[list[int]], max_tokens: int, seed: int | None = None,
                        stop: set[int] | None = None) -> Iterator[tuple[int, int]]:
        """Yield ``(prompt_index, token)`` as tokens are produced.  Prompt ``i`` samples with
        seed ``seed + i`` (greedy when ``seed`` is None).  More prompts than slots wait their turn.
        Raises as :meth:`submit` (every prompt is checked before any runs)."""
        for p in prompts:  # validate all first, so a bad prompt leaves nothing queued
            self.kv.check(len(p) + max_tokens)
        ids = {}
        try:
            for i, p in enumerate(prompts):
                ids[self.submit(p, max_tokens, None if seed is None else seed + i, stop)] = i
            remaining = set(ids)
            while remaining:
                for ev in self.step():
                    if ev.seq_id in remaining:
                        if ev.token >= 0:
                            yield ids[ev.seq_id], ev.token
                        if ev.done:
                            remaining.discard(ev.seq_id)
        finally:
            for seq_id in ids:
                self.cancel(seq_id)

    def generate(self, prompts: list[list[int]], max_tokens: int, seed: int | None = None,
                 stop: set[int] | None = None) -> list[list[int]]:
        """Generated token ids for each prompt ([len(prompts)] lists of <= max_tokens ids)."""
        out: list[list[int]] = [[] for _ in prompts]
        for i, token in self.generate_stream(prompts, max_tokens, seed, stop):
            out[i].append(token)
        return out
