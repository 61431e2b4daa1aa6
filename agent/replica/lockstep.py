"""Whole prompt sets run together: lockstep generation and teacher-forced replay.

Two ways to run P prompts at once through the engine's ``forward`` (agent/replica/model.py),
both on an idle engine, both in groups of at most ``max_seqs`` prompts (one KV slot each):

- :meth:`Lockstep.generate_lockstep` samples ``max_tokens`` new tokens per prompt: one batched
  prefill (B = prompts, S = the longest prompt, the logits of each prompt's last token: K = 1),
  then one batched decode call per further token (B = prompts, S = 1).  ``max_tokens`` forward
  calls per group.
- :meth:`Lockstep.teacher_forced` replays tokens already known (a golden record,
  agent/replica/golden.py): for every position ``k`` of ``tokens[i]`` it returns what the model
  samples given ``prompts[i] + tokens[i][:k]``.  The inputs ``prompt + tokens[:-1]`` are fed as
  one batched prefill of all but the last input (B = prompts, S = the longest, the logits of
  every position: K = S, the LM head on the same [B, S] rows in every rewarm, so a golden
  record reproduces bit for bit), whose logits at
  the last prompt position and every later one give positions ``0 .. N-2``, then one batched
  decode step of the last input through the KV cache the prefill wrote (S = 1, the kernels a
  served request's decode uses) gives position ``N-1``.  Two forward calls per group, whatever
  ``N``.  For greedy decoding this is exactly the check "would sequential decoding produce these
  tokens": each position sees the same prefix.  Sampling with a seed draws from the same
  per-prompt generator in the same order as generation does.

Padding: rows shorter than the group's longest are padded at the end; a row's padded inputs
write cache positions beyond its own inputs, which the causal mask hides from its queries and
its decode overwrites (at its own position) before reading.  Both raise ProtocolError on a busy
engine and as :meth:`Engine.submit` for a prompt; nothing is left allocated after either.

Prefill and decode kernels may round differently in the last bits, so the two methods can
disagree where the top tokens nearly tie; a golden record is therefore made with the very
procedure that checks it (agent/replica/golden.py).

Where the time of a replay goes: :attr:`Lockstep.replay_phases` holds, after each
:meth:`~Lockstep.teacher_forced`, the seconds of its prefill calls, its decode calls and its
sampling (all positions of a group drawn with one host transfer,
agent/replica/sampling.py ``sample_positions``), summed over groups, and the thread that ran
it.  On a GPU the device is synchronised after each forward call so that its kernels count
where they ran, not in the next call that waits for them.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from agent.errors import ProtocolError
from agent.replica.model import every_position, last_positions
from agent.replica.sampling import sample_positions, sample_rows


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (a no-op on the CPU, where calls are synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Lockstep:
    """Mixed into :class:`agent.replica.engine.Engine` (uses its slots, forward and sampler).

    ``replay_phases``: the last :meth:`teacher_forced`'s ``prefill_s``, ``decode_s`` and
    ``sample_s`` (seconds, summed over its groups), ``groups`` and ``thread`` (the name of the
    thread that ran it); empty before the first."""

    replay_phases: dict[str, Any] = {}    # replaced, never mutated: one per replay

    def _lockstep_seqs(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                       seed: int | None) -> list:
        """Validate every prompt as :meth:`submit` does (before any runs) and take the queued
        sequences back off the queue: prompt ``i`` samples with seed ``seed + i``."""
        if self.busy:
            raise ProtocolError("a lockstep run needs an idle engine", field="active_seqs",
                                value=len(self._active) + len(self._waiting), limit=0)
        for i, p in enumerate(prompts):
            self.submit(p, max_tokens, None if seed is None else seed + i)
        empty: collections.deque = collections.deque()
        seqs, self._waiting = list(self._waiting), empty
        self._publish()   # else :attr:`load` keeps counting the prompts as waiting
        return seqs

    def _groups(self, seqs: list) -> list[list]:
        """``seqs`` in groups of at most ``max_seqs`` (one KV slot each)."""
        size = self.kv.max_seqs
        return [seqs[start:start + size] for start in range(0, len(seqs), size)]

    @contextlib.contextmanager
    def _slots(self, group: list):
        """Hold one KV slot per sequence of ``group`` while the block runs; free them after,
        whatever the block raised."""
        try:
            for seq in group:
                seq.slot = self.kv.allocate(len(seq.prompt) + seq.max_tokens)
            yield torch.tensor([s.slot for s in group], dtype=torch.int64, device=self.device)
        finally:
            for seq in group:
                if seq.slot >= 0:
                    self.kv.free(seq.slot)
                    seq.slot = -1

    def _prefill_rows(self, rows: list[list[int]], idx: torch.Tensor,
                      every: bool) -> torch.Tensor:
        """One batched prefill of ``rows`` (padded at the end to the longest, W): logits
        [B, W, V] at every position when ``every``, else [B, V] after each row's last token."""
        dev, width = self.device, max(len(r) for r in rows)
        tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int64,
                              device=dev)
        pos = torch.arange(width, device=dev).repeat(len(rows), 1)
        if every:
            return self.forward(tokens, pos, idx, self.k_caches, self.v_caches,
                                every_position(len(rows), width, dev))
        return self.forward(tokens, pos, idx, self.k_caches, self.v_caches,
                            last_positions([len(r) for r in rows], dev))[:, 0]

    def _decode_rows(self, last: list[int], positions: list[int], idx: torch.Tensor) -> torch.Tensor:
        """One batched decode step (S = 1): logits [B, V]."""
        dev = self.device
        tokens = torch.tensor([[t] for t in last], dtype=torch.int64, device=dev)
        pos = torch.tensor([[p] for p in positions], dtype=torch.int64, device=dev)
        return self.forward(tokens, pos, idx, self.k_caches, self.v_caches,
                            last_positions([1] * len(last), dev))[:, 0]

    def generate_lockstep(self, prompts: list[list[int]], max_tokens: int,
                          seed: int | None = None) -> list[list[int]]:
        """Exactly ``max_tokens`` sampled tokens for each prompt (no stop tokens): one prefill
        call per group, then one decode call per further token.  Sampling as
        :meth:`Engine.generate` (prompt ``i`` with seed ``seed + i``; greedy when None)."""
        seqs = self._lockstep_seqs([[int(t) for t in p] for p in prompts], max_tokens, seed)
        out: list[list[int]] = []
        with torch.inference_mode():
            for group in self._groups(seqs):
                with self._slots(group) as idx:
                    out += self._generate_group(group, idx, max_tokens)
        return out

    def _generate_group(self, group: list, idx: torch.Tensor, max_tokens: int) -> list[list[int]]:
        logits = self._prefill_rows([s.prompt for s in group], idx, every=False)  # [B, V]
        got: list[list[int]] = [[] for _ in group]
        for step in range(max_tokens):
            if step:
                logits = self._decode_rows([g[-1] for g in got],
                                           [len(s.prompt) + step - 1 for s in group], idx)
            for row, token in enumerate(sample_rows([s.sampler for s in group], logits)):
                got[row].append(token)
        return got

    def teacher_forced(self, prompts: list[list[int]], tokens: list[list[int]],
                       seed: int | None = None) -> list[list[int]]:
        """What the model samples at every position of ``tokens`` (``[P][N]`` ids, the same
        ``N`` for every prompt) given the prompt and the tokens before it: ``[P][N]`` ids.
        Prompt ``i`` samples with seed ``seed + i`` (greedy when None), one draw per position in
        order, as generation would.  Two forward calls per group of ``max_seqs`` prompts.
        Raises ProtocolError when ``tokens`` does not have one row of ``N >= 1`` ids in
        [0, vocab_size) per prompt, and as :meth:`Engine.submit` for a prompt."""
        n = len(tokens[0]) if tokens else 0
        if len(tokens) != len(prompts) or n < 1 or any(len(t) != n for t in tokens):
            raise ProtocolError(f"teacher_forced needs one row of N >= 1 tokens per prompt, got "
                                f"{[len(t) for t in tokens]} for {len(prompts)} prompts",
                                field="tokens", value=[len(t) for t in tokens], limit=len(prompts))
        tokens = [[int(t) for t in row] for row in tokens]
        vocab = self.config.vocab_size
        bad = next((t for row in tokens for t in row if not 0 <= t < vocab), None)
        if bad is not None:
            raise ProtocolError(f"token id {bad} outside [0, {vocab})", field="tokens",
                                value=bad, limit=vocab)
        seqs = self._lockstep_seqs([[int(t) for t in p] for p in prompts], n, seed)
        out: list[list[int]] = []
        phases: dict[str, Any] = {"prefill_s": 0.0, "decode_s": 0.0, "sample_s": 0.0,
                                  "groups": 0, "thread": threading.current_thread().name}
        with torch.inference_mode():
            for start, group in zip(range(0, len(seqs), self.kv.max_seqs), self._groups(seqs), strict=True):
                inputs = [s.prompt + tokens[start + row][:n - 1] for row, s in enumerate(group)]
                with self._slots(group) as idx:
                    out += self._replay_group(group, idx, inputs, n, phases)
                phases["groups"] += 1
        self.replay_phases = phases
        return out

    def _replay_group(self, group: list, idx: torch.Tensor, inputs: list[list[int]],
                      n: int, phases: dict) -> list[list[int]]:
        """Prefill every input but the last (logits for positions 0 .. n-2 of each row), then
        decode the last (position n-1); sample every position of every row with one host
        transfer (:func:`~agent.replica.sampling.sample_positions`: each row's draws in
        position order, the tokens :meth:`Engine._sample` would give one by one).  Adds the
        seconds of each part to ``phases``."""
        t = time.perf_counter()
        head = None
        if max(len(r) for r in inputs) > 1:
            logits = self._prefill_rows([r[:-1] for r in inputs], idx, every=True)  # [B, W, V]
            firsts = [len(seq.prompt) - 1 for seq in group]
            head = torch.stack([logits[row, first:first + n - 1]
                                for row, first in enumerate(firsts)])           # [B, n-1, V]
            _sync(self.device)
        t2 = time.perf_counter()
        tail = self._decode_rows([r[-1] for r in inputs], [len(r) - 1 for r in inputs], idx)
        _sync(self.device)
        t3 = time.perf_counter()
        # head is None only when n == 1: nothing before the last position
        every = tail.unsqueeze(1) if head is None else torch.cat([head, tail.unsqueeze(1)], 1)
        out = sample_positions([seq.sampler for seq in group], every)           # [B][n]
        phases["prefill_s"] += t2 - t
        phases["decode_s"] += t3 - t2
        phases["sample_s"] += time.perf_counter() - t3
        return out
