"""The golden check: a restored replica must reproduce its first boot's tokens exactly.

At first boot :func:`record_golden` runs fixed prompts with a fixed seed and keeps the tokens;
the snapshot stores them (``Manifest.golden``).  Before a restored replica may serve,
:func:`verify_golden` runs the same prompts and raises :class:`~agent.errors.GoldenMismatch`
at the first differing token (fail closed: a replica that does not match never serves).

Both run the prompts in lockstep (``Engine.generate_lockstep``): one batched prefill of every
prompt, then one batched decode call per token, so a check of P prompts x N tokens costs N
forward calls, not P prefills plus N - 1 decodes.  Recording and verifying take the same path,
so the same kernels at the same shapes produce the tokens both times; every token of every
prompt is still sampled by the model and compared.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from agent.errors import GoldenMismatch
from agent.snapshot.format import GoldenCheck

DEFAULT_SEED = 1234
DEFAULT_MAX_TOKENS = 8
GOLDEN_TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")
"""Prompts a text model's golden check uses (tokenized by the model's own tokenizer)."""


class Generates(Protocol):
    """What the check needs from an engine (agent.replica.engine.Engine satisfies it):
    exactly ``max_tokens`` sampled tokens per prompt, prompt ``i`` seeded with ``seed + i``."""

    def generate_lockstep(self, prompts: list[list[int]], max_tokens: int,
                          seed: int | None = None) -> list[list[int]]: ...


def record_golden(engine: Generates, prompts: Sequence[Sequence[int]], seed: int = DEFAULT_SEED,
                  max_tokens: int = DEFAULT_MAX_TOKENS) -> GoldenCheck:
    """Run ``prompts`` (token ids) sampled with ``seed`` and keep exactly ``max_tokens`` each
    (no stop tokens, so the length is fixed)."""
    prompts = [list(map(int, p)) for p in prompts]
    expected = engine.generate_lockstep(prompts, max_tokens, seed=seed)
    return GoldenCheck(prompts=prompts, seed=seed, max_tokens=max_tokens, expected=expected)


def verify_golden(engine: Generates, golden: GoldenCheck) -> None:
    """Raise GoldenMismatch (``prompt_index``, ``position``, ``expected``, ``actual``) at the
    first token that differs from ``golden.expected``; return None when all match."""
    actual = engine.generate_lockstep([list(p) for p in golden.prompts], golden.max_tokens,
                                      seed=golden.seed)
    for i, (want, got) in enumerate(zip(golden.expected, actual)):
        if want == got:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        exp = want[pos] if pos < len(want) else None
        act = got[pos] if pos < len(got) else None
        raise GoldenMismatch(f"golden check failed: prompt {i}, token {pos}: expected {exp}, got {act}",
                             prompt_index=i, position=pos, expected=exp, actual=act)
    if len(actual) != len(golden.expected):
        raise GoldenMismatch(f"golden check failed: {len(actual)} outputs for "
                             f"{len(golden.expected)} prompts", prompt_index=len(actual),
                             position=0, expected=len(golden.expected), actual=len(actual))
