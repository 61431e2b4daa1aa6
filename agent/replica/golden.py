"""The golden check: a restored replica must reproduce its first boot's tokens exactly.

At first boot :func:`record_golden` runs fixed prompts with a fixed seed and keeps the tokens;
the snapshot stores them (``Manifest.golden``).  Before a restored replica may serve,
:func:`verify_golden` replays them and raises :class:`~agent.errors.GoldenMismatch` at the
first differing token (fail closed: a replica that does not match never serves).

The check is teacher-forced (``Engine.teacher_forced``, agent/replica/lockstep.py): every
prompt followed by its recorded tokens goes through one batched prefill, and the token the
model samples at each position (given the prompt and the recorded tokens before it) is
compared with the recorded one; the last position comes from one batched decode step through
the KV cache that prefill wrote, so the decode kernels served requests use are checked too.
Two forward calls for P prompts x N tokens, where decoding them one by one costs N; every
token of every prompt is still sampled by the model (same seeds, same draws in the same order)
and compared.  Given that every earlier token matched, position ``k`` sees exactly the prefix
sequential generation would have fed it, so the check accepts exactly the tokens generation
would produce with the check's kernels.

Near-ties: prefill (S > 1) and decode (S = 1) kernels may round differently in the last bits,
so a token decided by such a difference could come out one way in sequential decoding and the
other in the check.  The record is therefore made with the check's own procedure
(:func:`record_golden` iterates to the fixed point where the teacher-forced replay reproduces
the tokens it is fed), and the check accepts only exact matches: a restore whose kernels flip a
near-tie fails closed (GoldenMismatch), never the other way.  ``GoldenCheck.method`` records
the procedure; a record made by any other (the lockstep decode of earlier releases) is refused
with SnapshotIncompatible, so such snapshots are recaptured, never served unchecked.

Cost (bench/golden_profile.py: SmolLM2-135M, its AOT package, 2 cores, load average 0.4-0.8,
median of 5 zygote restores): 266 ms, of which the prefill (B=3, S=12) 128 ms, the decode step
(B=3, S=1) 108 ms, the 24 draws 27 ms (each draws one exponential variate per vocabulary entry,
49,152, as ``torch.multinomial`` does: 0.94 ms of its 1.1 ms) and everything else (validation,
slots, slicing, comparison) under 1 ms.  The forward calls cost the same inside the check as
in the zygote's warm-up before it and in replays after it, so no first-call cost is left in
it.  The decode step costs twice a B=1 step (~55 ms): the package's matmuls go to MKL's
small-matrix path at M=3 on this CPU (a B=4 step measured ~85 ms).  With the warm-up on
another thread than the restore the same check took 372 ms (agent/replica/worker.py,
``make_engine_thread``).

On a GPU the draws stay on the host (each sequence's CPU generator draws what generation
draws), and the probabilities of every position of a replay come over in one transfer
(agent/replica/sampling.py ``sample_positions``), not one device synchronisation per draw.
What a GPU pays on a thread's first calls (its cuBLAS handles, lazily loaded kernels, the
allocator's segments) is paid by the zygote's warm-up on the thread that restores
(agent/replica/warmup.py).  Each restore records the check's prefill, decode and sampling
seconds (``golden_prefill_s``, ``golden_decode_s``, ``golden_sample_s`` in its phases;
agent/replica/lockstep.py ``replay_phases``), which bench/device_check.py reports.
"""

from __future__ import annotations

from typing import Any, Protocol
from collections.abc import Sequence

from agent.errors import GoldenMismatch, SnapshotIncompatible
from agent.snapshot.format import GoldenCheck

DEFAULT_SEED = 1234
DEFAULT_MAX_TOKENS = 8
GOLDEN_TEXTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")
"""Prompts a text model's golden check uses (tokenized by the model's own tokenizer)."""
GOLDEN_METHOD = "teacher_forced/1"
"""``GoldenCheck.method`` of a record this module made and the only one it verifies."""


class Generates(Protocol):
    """What the check needs from an engine (agent.replica.engine.Engine satisfies it): prompt
    ``i`` sampled with seed ``seed + i``; ``generate_lockstep`` gives exactly ``max_tokens``
    new tokens per prompt, ``teacher_forced`` what is sampled at each position of ``tokens``."""

    def generate_lockstep(self, prompts: list[list[int]], max_tokens: int,
                          seed: int | None = None) -> list[list[int]]: ...

    def teacher_forced(self, prompts: list[list[int]], tokens: list[list[int]],
                       seed: int | None = None) -> list[list[int]]: ...


def record_golden(engine: Generates, prompts: Sequence[Sequence[int]], seed: int = DEFAULT_SEED,
                  max_tokens: int = DEFAULT_MAX_TOKENS) -> GoldenCheck:
    """Record exactly ``max_tokens`` tokens per prompt (token ids), sampled with ``seed``, that
    the teacher-forced check reproduces.  Starts from sequential generation and replays until
    the replay gives back what it was fed.  Each replay fixes at least the first differing
    position of every prompt (that position saw the same prefix as the next replay will), so
    after ``max_tokens`` replays the record is consistent and one more confirms it; in practice
    one replay, two where a near-tie split the kernels.  Raises GoldenMismatch when it does not
    settle (a forward that is not deterministic)."""
    rows = [list(map(int, p)) for p in prompts]
    tokens = engine.generate_lockstep(rows, max_tokens, seed=seed)
    previous = tokens
    for _ in range(max_tokens + 1):
        replayed = engine.teacher_forced(rows, tokens, seed=seed)
        if replayed == tokens:
            return GoldenCheck(prompts=rows, seed=seed, max_tokens=max_tokens,
                               expected=tokens, method=GOLDEN_METHOD)
        previous, tokens = tokens, replayed
    i, pos, want, got = _first_difference(previous, tokens)
    raise GoldenMismatch(f"golden record did not settle after {max_tokens + 1} replays: prompt {i}, "
                         f"token {pos} alternates ({want} then {got}); the forward is not "
                         "deterministic", prompt_index=i, position=pos, expected=want, actual=got)


def check_method(golden: GoldenCheck, where: Any = None) -> None:
    """Raise SnapshotIncompatible unless ``golden`` was recorded by :data:`GOLDEN_METHOD` (a
    record made otherwise cannot be checked exactly by this procedure: recapture it)."""
    if golden.method != GOLDEN_METHOD:
        raise SnapshotIncompatible(
            f"{where}: golden check recorded by {golden.method or 'lockstep decode (no method)'!r}; "
            f"this rewarm verifies only {GOLDEN_METHOD!r} records: capture the snapshot again",
            path=where, mismatches={"golden.method": (golden.method, GOLDEN_METHOD)})


def verify_golden(engine: Generates, golden: GoldenCheck, where: Any = None) -> None:
    """Replay ``golden`` teacher-forced and raise GoldenMismatch (``prompt_index``,
    ``position``, ``expected``, ``actual``) at the first token that differs; return None when
    every token of every prompt matches.  A record of the wrong shape (no prompts, not one row
    of ``max_tokens`` ids per prompt, or an id the model cannot produce) is a mismatch too,
    its message starting "golden check failed" as the node agent reads a worker's answer.
    Raises SnapshotIncompatible (:func:`check_method`) before running anything."""
    check_method(golden, where)
    n = golden.max_tokens
    bad_row = next((i for i, row in enumerate(golden.expected) if len(row) != n), None)
    what = where or "the snapshot"
    if not golden.prompts:     # a record that checks nothing must not pass as checked
        raise GoldenMismatch(f"golden check failed: {what}: its record holds 0 prompts; limit "
                             "is >= 1", prompt_index=0, position=0, expected=1, actual=0)
    empty = next((i for i, p in enumerate(golden.prompts) if not p), None)
    if empty is not None:
        raise GoldenMismatch(f"golden check failed: {what}: prompt {empty} of its record holds "
                             "0 tokens; limit is >= 1", prompt_index=empty, position=0,
                             expected=1, actual=0)
    if len(golden.expected) != len(golden.prompts) or bad_row is not None or n < 1:
        i = bad_row if bad_row is not None else min(len(golden.expected), len(golden.prompts))
        raise GoldenMismatch(f"golden check failed: malformed: {len(golden.expected)} rows of "
                             f"{[len(r) for r in golden.expected][:8]} tokens for "
                             f"{len(golden.prompts)} prompts x {n}", prompt_index=i, position=0,
                             expected=n, actual=None)
    vocab = getattr(getattr(engine, "config", None), "vocab_size", None)
    for i, row in enumerate(golden.expected):
        pos = next((j for j, t in enumerate(row) if vocab is not None and not 0 <= t < vocab), None)
        if pos is not None:
            raise GoldenMismatch(f"golden check failed: prompt {i}, token {pos}: expected "
                                 f"{row[pos]}, outside the model's vocabulary of {vocab}",
                                 prompt_index=i, position=pos, expected=row[pos], actual=None)
    actual = engine.teacher_forced([list(p) for p in golden.prompts],
                                   [list(r) for r in golden.expected], seed=golden.seed)
    found = _first_difference(golden.expected, actual)
    if found is not None:
        i, pos, want, got = found
        raise GoldenMismatch(f"golden check failed: prompt {i}, token {pos}: expected {want}, "
                             f"got {got}", prompt_index=i, position=pos, expected=want, actual=got)


def _first_difference(want: list[list[int]], got: list[list[int]]):
    """``(prompt, position, wanted, got)`` of the first differing token, or None."""
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        for j, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return i, j, x, y
        if len(a) != len(b):
            j = min(len(a), len(b))
            return i, j, a[j] if j < len(a) else None, b[j] if j < len(b) else None
    if len(want) != len(got):
        return min(len(want), len(got)), 0, None, None
    return None


DRIFT_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Within "
    "fifty years presses were working in more than two hundred cities across Europe, and the "
    "price of a book fell so far that ordinary merchants could own one. def merge_sorted(a, b):"
    "\n    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:"
    "\n            out.append(a[i]); i += 1\n        else:\n            out.append(b[j]); j += 1"
    "\n    return out + a[i:] + b[j:]\nQuestion: what is the boiling point of water at sea level?"
    " Answer: one hundred degrees Celsius, or two hundred and twelve degrees Fahrenheit. Once "
    "upon a time, in a small village at the edge of a forest, there lived an old clockmaker "
    "who repaired every clock in the valley but never owned one himself. Photosynthesis turns "
    "light, water and carbon dioxide into sugar and oxygen; the light reactions happen in the "
    "thylakoid membranes and the Calvin cycle in the stroma of the chloroplast. The train "
    "left the station at seven, crossed the river twice and reached the coast before noon.")
DRIFT_TOKENS = 256
"""The drift prompt set: the first 256 tokens of :data:`DRIFT_TEXT` (prose, code, a question,
a story, science), in 4 rows of 64 for a batch-4 prefill."""


def drift_rows(encode, rows: int = 4) -> list[list[int]]:
    """The drift prompt set as ``rows`` lists of ``DRIFT_TOKENS // rows`` token ids (``encode``:
    text -> ids, the model's tokenizer).  Raises ValueError when the text is too short."""
    ids = list(encode(DRIFT_TEXT))
    if len(ids) < DRIFT_TOKENS:
        raise ValueError(f"drift text gives {len(ids)} tokens, needs {DRIFT_TOKENS}")
    n = DRIFT_TOKENS // rows
    return [ids[i * n:(i + 1) * n] for i in range(rows)]


def prefill_logits(forward, rows: list[list[int]], k_caches, v_caches):
    """logits [P, N, V] float32 at every position of one batched prefill of ``rows`` ([P][N]
    ids) into cache slots 0..P-1 of ``k_caches``/``v_caches`` (written in place)."""
    import torch

    from agent.replica.model import every_position

    tokens = torch.tensor(rows, dtype=torch.int64)
    b, n = tokens.shape
    with torch.inference_mode():
        return forward(tokens, torch.arange(n).repeat(b, 1), torch.arange(b), k_caches, v_caches,
                       every_position(b, n)).float()


def drift(reference, got) -> dict[str, float]:
    """How far logits ``got`` drift from ``reference`` (both [P, N, V] over the same tokens):
    ``top1_agreement`` (fraction of the P*N positions whose argmax is the same),
    ``max_logit_diff`` (largest absolute difference of any logit), ``max_logit`` (the
    reference's largest absolute logit, for scale), ``positions``."""
    return {"top1_agreement": float((reference.argmax(-1) == got.argmax(-1)).float().mean()),
            "max_logit_diff": float((reference - got).abs().max()),
            "max_logit": float(reference.abs().max()),
            "positions": int(reference.shape[0] * reference.shape[1])}
