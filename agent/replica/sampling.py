"""How the engine picks each sequence's next token from its logits.

Per sequence (:class:`Sampling`): greedy (argmax) when ``temperature`` is 0, or when neither a
temperature nor a seed is given; otherwise a draw from ``softmax(logits / temperature)``
restricted to the ``top_k`` most likely tokens and then to the smallest set whose probability
reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019, "The Curious Case of Neural Text
Degeneration"), with a per-sequence ``torch.Generator`` seeded with ``seed`` (a random seed
when absent), so a sequence's tokens do not depend on what else is in the batch.

:func:`sample_rows` picks for a whole decode batch at once: the greedy rows of ``logits``
[B, V] in one ``argmax`` and one ``tolist`` (one pass over B x V values and one host
transfer per step instead of one per sequence), the sampled rows one by one (each has its
own generator).  :func:`sample_positions` picks N tokens per sequence from logits [B, N, V]
(the golden check's teacher-forced replay, agent/replica/lockstep.py) with one host transfer
for all of them: on a GPU each draw of :func:`sample` waits for the device and copies its
[V] probabilities to the host, so 24 draws were 24 synchronisations.

The draw itself stays on the host (``torch.multinomial`` with the sequence's CPU generator):
its tokens must be the ones generation draws.  Batching does not change them: the
probabilities of a row come from the same kernels whether the row is alone or one of many
(ATen's softmax over the last dimension computes each row by itself: one CUDA block per row,
its variant chosen by the row length and the buffer's alignment, aten/src/ATen/native/cuda/
SoftMax.cu ``host_softmax``; one loop iteration per row on the CPU, native/cpu/
SoftMaxKernel.cpp ``_vec_softmax_lastdim``), and tests/replica/test_sampling.py holds them
equal bit for bit.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Sequence

import torch

from agent.errors import ProtocolError

MAX_SEED = 2**63 - 1
"""Largest sampling seed (torch.Generator.manual_seed takes a signed 64-bit value)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How one sequence picks its tokens.  ``temperature`` None means the engine's default
    (used only when ``seed`` is given: no temperature and no seed is greedy); 0 is greedy.
    ``top_k`` 0 or None and ``top_p`` 1.0 or None leave the distribution whole."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


GREEDY = Sampling()


@dataclasses.dataclass(frozen=True)
class Sampler:
    """One sequence's resolved sampling: ``generator`` None is greedy; ``top_p`` None and
    ``top_k`` None leave the distribution whole."""

    generator: torch.Generator | None
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None


def check_sampling(seed: int | None, sampling: Sampling) -> None:
    """Raise ProtocolError for a seed outside [0, MAX_SEED], temperature < 0, top_p outside
    (0, 1] or top_k < 0 (naming the field, the value and the limit)."""
    if seed is not None and not 0 <= int(seed) <= MAX_SEED:
        raise ProtocolError(f"seed={seed} outside [0, {MAX_SEED}]", field="seed", value=seed,
                            limit=MAX_SEED)
    temperature = sampling.temperature
    if temperature is not None and not temperature >= 0:
        raise ProtocolError(f"temperature={temperature} must be >= 0", field="temperature",
                            value=temperature, limit=0)
    if sampling.top_p is not None and not 0 < sampling.top_p <= 1:
        raise ProtocolError(f"top_p={sampling.top_p} outside (0, 1]", field="top_p",
                            value=sampling.top_p, limit=1)
    if sampling.top_k is not None and sampling.top_k < 0:
        raise ProtocolError(f"top_k={sampling.top_k} must be >= 0", field="top_k",
                            value=sampling.top_k, limit=0)


def make_sampler(seed: int | None, sampling: Sampling, *, default_temperature: float,
                 default_top_k: int | None, vocab_size: int) -> Sampler:
    """The :class:`Sampler` for a request (checked with :func:`check_sampling` first)."""
    check_sampling(seed, sampling)
    temperature = sampling.temperature
    if temperature == 0 or (temperature is None and seed is None):
        return Sampler(None)
    gen = torch.Generator().manual_seed(int(seed) if seed is not None else secrets.randbits(63))
    top_k = sampling.top_k if sampling.top_k is not None else default_top_k
    return Sampler(gen, temperature if temperature is not None else default_temperature,
                   sampling.top_p if sampling.top_p is not None and sampling.top_p < 1 else None,
                   min(top_k, vocab_size) if top_k else None)


def sample(sampler: Sampler, logits: torch.Tensor) -> int:
    """One token id from ``logits`` [V] (any float dtype; sampling runs in float32)."""
    if sampler.generator is None:
        return int(logits.argmax())
    return _draw(sampler, _probs(sampler, logits).cpu())


def _probs(sampler: Sampler, logits: torch.Tensor) -> torch.Tensor:
    """The distribution a seeded sampler draws from, on ``logits``' device: float32
    ``[..., V]`` for logits ``[..., V]`` (temperature, then top-k; every row alone)."""
    scaled = logits.float() / max(sampler.temperature, 1e-5)
    if sampler.top_k is not None:
        kth = torch.topk(scaled, sampler.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.softmax(scaled, dim=-1)


def _draw(sampler: Sampler, probs: torch.Tensor) -> int:
    """One token id drawn with ``sampler``'s generator from ``probs`` [V] float32 on the
    host (top-p applied here)."""
    if sampler.top_p is not None:
        # keep the most likely tokens until their mass reaches top_p (the token that
        # crosses it included), then renormalise by sampling from what is left
        sorted_p, order = torch.sort(probs, descending=True)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= sampler.top_p
        drop[0] = False   # the most likely always stays (a top_p that is 0 in float32)
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=sampler.generator))


def sample_rows(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[int]:
    """One token id per row of ``logits`` [B, V] (row b by ``samplers[b]``): the greedy rows
    in one batched argmax, the others one by one.  Same tokens as :func:`sample` per row."""
    greedy = [b for b, s in enumerate(samplers) if s.generator is None]
    out = [0] * len(samplers)
    if len(greedy) == len(samplers):
        return logits.argmax(dim=-1).tolist()
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        for b, token in zip(greedy, logits.index_select(0, rows).argmax(dim=-1).tolist(),
                            strict=True):
            out[b] = token
    for b, s in enumerate(samplers):
        if s.generator is not None:
            out[b] = sample(s, logits[b])
    return out


def sample_positions(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[list[int]]:
    """``N`` token ids per sequence from ``logits`` [B, N, V]: sequence ``b`` draws position
    0, 1, ... N-1 of row ``b`` in order with ``samplers[b]`` (as N calls of :func:`sample`
    would, and with the same tokens).  One host transfer for the greedy rows (their argmax)
    and one for the sampled rows (their probabilities), whatever B and N."""
    out: list[list[int]] = [[] for _ in samplers]
    if not samplers or logits.shape[1] == 0:
        return out
    greedy = [b for b, s in enumerate(samplers) if s.generator is None]
    if greedy:
        rows = logits.index_select(0, torch.tensor(greedy, device=logits.device))
        for b, tokens in zip(greedy, rows.argmax(dim=-1).tolist(), strict=True):
            out[b] = tokens
    drawn = [b for b, s in enumerate(samplers) if s.generator is not None]
    if drawn:
        probs = torch.stack([_probs(samplers[b], logits[b]) for b in drawn]).cpu()  # [D, N, V]
        for j, b in enumerate(drawn):
            out[b] = [_draw(samplers[b], probs[j, k]) for k in range(probs.shape[1])]
    return out
