"""The engine: batched decode of many sequences over the slot-allocated KV cache.

One step (:meth:`Engine.step`) admits waiting sequences while slots are free (each is
prefilled alone, in chunks of ``prefill_chunk`` tokens, B=1, S<=chunk), then decodes every
active sequence together (B=active, S=1).  Every call goes through the same
``forward(tokens, input_pos, cache_batch_idx, k_caches, v_caches)`` (see agent/replica/model.py),
either the eager :class:`Transformer` or any callable with that signature (a loaded AOT
package, a ``torch.compile`` of the module).

Sampling is per sequence (agent/replica/sampling.py: greedy, or temperature / top-k / top-p
with a per-sequence seeded generator); a decode step samples every active sequence from one
[B, V] logits tensor.  A sequence ends after ``max_tokens`` new tokens or when it samples a
stop token (the stop token is not returned).

Speed: every prefill (one prompt, its first token sampled) and every decode step (sampling
included) is timed with the injected ``clock`` and fed to the engine's
:class:`~agent.replica.speedmeter.SpeedMeter`; :attr:`Engine.load` is the queue as of the last
change (published on the engine thread, read by the server without a lock), and
:meth:`Engine.predict_ttft_s` what a new request would meet.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from agent.errors import ProtocolError
from agent.replica.config import LlamaConfig
from agent.replica.kv import KVPlan, KVSlotAllocator, plan_kv
from agent.replica.lockstep import Lockstep
from agent.replica.model import Transformer, new_kv_caches
from agent.replica.sampling import (GREEDY, MAX_SEED, Sampler, Sampling, make_sampler,  # noqa: F401
                                    sample, sample_rows)
from agent.replica.speedmeter import SpeedMeter
from agent.speed import slot_wait_steps

Forward = Callable[..., torch.Tensor]


def mark_dynamic_inputs(tokens: torch.Tensor, input_pos: torch.Tensor, cache_batch_idx: torch.Tensor,
                        k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]) -> None:
    """Mark the three dynamic sizes for ``torch.compile``: active batch (dim 0 of tokens,
    input_pos, cache_batch_idx), sequence length (dim 1 of tokens, input_pos) and cache batch
    (dim 0 of every cache): the ``Dim``s the AOT export declares (agent/replica/aot.py)."""
    mark = torch._dynamo.mark_dynamic
    for t in (tokens, input_pos):
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

    def forward(tokens, input_pos, cache_batch_idx, k_caches, v_caches):
        mark_dynamic_inputs(tokens, input_pos, cache_batch_idx, k_caches, v_caches)
        return compiled(tokens, input_pos, cache_batch_idx, k_caches, v_caches)

    return forward


@dataclasses.dataclass
class _Seq:
    seq_id: int
    prompt: list[int]
    max_tokens: int
    stop: frozenset[int]
    sampler: Sampler
    slot: int = -1
    pos: int = 0               # tokens written to the cache so far
    last: int = -1             # the token to feed next
    produced: int = 0


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """The engine's queue as of its last change (agent/speed.py's ``QUEUE_META_KEYS`` and
    ``active_seqs``).  ``remaining_tokens``: tokens each active sequence may still produce
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
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor] | None, *,
                 max_seqs: int, max_seq_len: int, forward: Forward | None = None,
                 device: str = "cpu", prefill_chunk: int = 256, temperature: float = 1.0,
                 top_k: int | None = None, meter: SpeedMeter | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
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
        self.prefill_chunk = prefill_chunk
        self.temperature, self.top_k = temperature, top_k
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._active: dict[int, _Seq] = {}
        self._next_id = 0
        self.plan: KVPlan | None = None  # set by Engine.sized
        self.meter = meter if meter is not None else SpeedMeter()
        self.clock = clock
        self.load = EngineLoad()

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
        1 and 2 (compilers specialise size 1, so {1, 2} x {1, 2} covers every graph a
        ``torch.compile``-d forward needs; after this no (B, S) recompiles, see
        tests/replica/test_recompiles.py).  Writes only into free slots, whose contents no
        sequence reads (the causal mask hides positions a sequence has not written).
        Returns the number of forward calls.  Raises ProtocolError while sequences are active."""
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
                    self.forward(tokens, pos, idx, self.k_caches, self.v_caches)
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
        """Drop a waiting or active sequence (freeing its slot); unknown ids are ignored."""
        self._waiting = collections.deque(s for s in self._waiting if s.seq_id != seq_id)
        for slot, seq in list(self._active.items()):
            if seq.seq_id == seq_id:
                del self._active[slot]
                self.kv.free(slot)
        self._publish()

    def _publish(self) -> None:
        """Replace :attr:`load` (one reference write: readers on other threads see the old
        or the new queue, never a half-updated one)."""
        active = list(self._active.values())
        self.load = EngineLoad(
            waiting_seqs=len(self._waiting),
            queued_prefill_tokens=sum(len(s.prompt) for s in self._waiting),
            active_seqs=len(active), active_ctx_tokens=sum(s.pos for s in active),
            remaining_tokens=tuple(sorted(s.max_tokens - s.produced for s in active)))

    def speed_report(self, active_seqs: int | None = None,
                     active_ctx_tokens: int | None = None) -> dict[str, float]:
        """The measured speed for a load report: agent/speed.py's ``SPEED_META_KEYS`` and
        ``decode_tokens_per_s_per_seq`` at the current batch (or the one given); {} until the
        meter has measured (contract: absent, never a guess)."""
        if not self.meter.measured:
            return {}
        profile, load = self.meter.profile(), self.load
        out = profile.to_dict()
        out["decode_tokens_per_s_per_seq"] = profile.decode_tokens_per_s(
            load.active_seqs if active_seqs is None else active_seqs,
            load.active_ctx_tokens if active_ctx_tokens is None else active_ctx_tokens)
        return out

    def predict_ttft_s(self, prompt_tokens: int, *, waiting_seqs: int = 0,
                       queued_prefill_tokens: int = 0) -> float:
        """Predicted TTFT (s) of a new request of ``prompt_tokens`` tokens submitted now, behind
        :attr:`load` plus ``waiting_seqs`` sequences of ``queued_prefill_tokens`` tokens the
        caller has not submitted yet (agent/speed.py's model on the measured profile).  When
        more sequences wait than slots are free, it also waits for the earliest-ending active
        sequences to finish (their remaining tokens, one decode step each)."""
        load, profile = self.load, self.meter.profile()
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
        """Admit waiting sequences into free slots (prefill), then one batched decode step."""
        return self.admit() + self.decode()

    @property
    def can_admit(self) -> bool:
        """Whether a sequence waits and a slot is free for it (:meth:`admit` would prefill)."""
        return bool(self._waiting) and self.kv.free_slots > 0

    def admit(self, limit: int | None = None) -> list[Event]:
        """The first half of a step: prefill waiting sequences (alone, in chunks, oldest
        first) while slots are free, at most ``limit`` of them (None: all that fit); returns
        their first tokens.  Each prefill is timed for the meter."""
        events: list[Event] = []
        clock, meter = self.clock, self.meter
        with torch.inference_mode():
            while self._waiting and self.kv.free_slots and (limit is None or len(events) < limit):
                t0 = clock()
                seq = self._waiting.popleft()
                seq.slot = self.kv.allocate(len(seq.prompt) + seq.max_tokens)
                logits = self._prefill(seq)
                self._active[seq.slot] = seq
                events.append(self._emit(seq, self._sample(seq, logits)))  # syncs the device
                meter.observe_prefill(len(seq.prompt), clock() - t0)
        if events:
            self._publish()
        return events

    def decode(self) -> list[Event]:
        """The second half of a step: one decode step over every active sequence (B=active,
        S=1), timed for the meter with the context it read (tokens cached before the step)."""
        batch = list(self._active.values())
        if not batch:
            return []
        events: list[Event] = []
        t0 = self.clock()
        ctx = sum(s.pos for s in batch)
        with torch.inference_mode():
            dev = self.device
            tokens = torch.tensor([[s.last] for s in batch], dtype=torch.int64, device=dev)
            pos = torch.tensor([[s.pos] for s in batch], dtype=torch.int64, device=dev)
            idx = torch.tensor([s.slot for s in batch], dtype=torch.int64, device=dev)
            logits = self.forward(tokens, pos, idx, self.k_caches, self.v_caches)[:, -1]
            picked = sample_rows([s.sampler for s in batch], logits)   # one host sync
            for seq, token in zip(batch, picked, strict=True):
                seq.pos += 1
                events.append(self._emit(seq, token))
        self.meter.observe_decode(len(batch), ctx, self.clock() - t0)
        self._publish()
        return events

    def _prefill(self, seq: _Seq) -> torch.Tensor:
        try:
            return self._prefill_chunks(seq)
        except BaseException:   # e.g. a forward that refused the call: the slot is not leaked
            self.kv.free(seq.slot)
            raise

    def _prefill_chunks(self, seq: _Seq) -> torch.Tensor:
        idx = torch.tensor([seq.slot], dtype=torch.int64, device=self.device)
        logits: torch.Tensor | None = None
        for start in range(0, len(seq.prompt), self.prefill_chunk):
            chunk = seq.prompt[start:start + self.prefill_chunk]
            tokens = torch.tensor([chunk], dtype=torch.int64, device=self.device)
            pos = torch.arange(start, start + len(chunk), device=self.device).unsqueeze(0)
            logits = self.forward(tokens, pos, idx, self.k_caches, self.v_caches)[0, -1]
        seq.pos = len(seq.prompt)
        assert logits is not None, "submit refuses an empty prompt"
        return logits

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
