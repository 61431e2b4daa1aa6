"""A replica's speed: measured service rates, and the TTFT they predict for a new request.

One pure module that the replica (which measures), the front door (which routes and admits by
predicted TTFT), the predictor (which sizes the warm pool) and the simulator (whose replicas run
at measured speed) all use, so the four agree on one model of a replica.

The model follows the engine's step (agent/replica/engine.py): each step first prefills every
admitted waiting sequence alone (B=1, in chunks), then runs one batched decode step over all
active sequences (B=active, S=1).  So, for one replica:

- prefill of a prompt of ``P`` tokens takes ``prefill_s(P) = prefill_overhead_s + P / prefill_tokens_per_s``;
- a decode step over ``B`` sequences holding ``C`` cached tokens in total takes
  ``decode_step_s(B, C) = decode_base_s + decode_per_seq_s * (B - 1) + decode_per_ctx_token_s * C``
  (weights are read once per step; attention reads every cached token);
- a request arriving now waits for the step in progress, then for the prefills queued ahead of
  it, then its own prefill: ``ttft_s = decode_step_s(B, C) + sum(prefill_s(p) for p queued) + prefill_s(P)``.
  The step in progress is charged whole (an upper bound; the front door admits on it).
  When every sequence slot is taken, the request also waits ``slot_wait_steps`` decode steps
  for one to free (the replica knows how many tokens its active sequences have left).

Little's law (L = lambda * W; J. D. C. Little, Operations Research 9(3), 1961) turns these rates
into warm-pool sizes: :meth:`SpeedProfile.sustainable_concurrency` is the batch a replica can
hold while a new arrival still meets the TTFT SLO, and :meth:`SpeedProfile.service_rps` the
request rate it serves at that batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from collections.abc import Mapping

from agent.errors import ConfigError

# Keys of a replica's speed and queue in its load report / registry meta (decimal strings there).
SPEED_META_KEYS = ("prefill_tokens_per_s", "prefill_overhead_s", "decode_base_s",
                   "decode_per_seq_s", "decode_per_ctx_token_s")
QUEUE_META_KEYS = ("waiting_seqs", "queued_prefill_tokens", "active_ctx_tokens")
PROFILE_SCHEMA = "rewarm.engine_profile/1"
"""``schema`` of the file bench/engine_profile.py writes (:meth:`SpeedProfile.from_file`)."""


@dataclass(frozen=True)
class SpeedProfile:
    """Measured service rates of one replica (seconds; tokens/s).  All fields finite, >= 0,
    ``prefill_tokens_per_s`` > 0 and ``decode_base_s`` > 0; else :class:`ConfigError`."""

    prefill_tokens_per_s: float
    prefill_overhead_s: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) \
                    or not math.isfinite(value) or value < 0:
                raise ConfigError(f"SpeedProfile {f.name}={value!r} must be a finite number "
                                  f">= 0", name=f.name, value=value, limit=0)
        for name in ("prefill_tokens_per_s", "decode_base_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"SpeedProfile {name}={getattr(self, name)!r} must be > 0",
                                  name=name, value=getattr(self, name), limit=0)

    # --- the engine's two kinds of work ------------------------------------------------
    def prefill_s(self, prompt_tokens: int) -> float:
        """Seconds to prefill one prompt of ``prompt_tokens`` tokens alone (B=1)."""
        return self.prefill_overhead_s + max(0, prompt_tokens) / self.prefill_tokens_per_s

    def decode_step_s(self, batch: int, context_tokens: int = 0) -> float:
        """Seconds of one decode step over ``batch`` sequences holding ``context_tokens``
        cached tokens in total; 0 for an empty batch."""
        if batch <= 0:
            return 0.0
        return (self.decode_base_s + self.decode_per_seq_s * (batch - 1)
                + self.decode_per_ctx_token_s * max(0, context_tokens))

    # --- what a request meets -----------------------------------------------------------
    def predict_ttft_s(self, prompt_tokens: int, *, active_seqs: int = 0,
                       active_ctx_tokens: int = 0, waiting_seqs: int = 0,
                       queued_prefill_tokens: int = 0, slot_wait_steps: int = 0) -> float:
        """Predicted TTFT (s) at this replica for a new request of ``prompt_tokens`` tokens,
        given its queue: the step in progress, ``slot_wait_steps`` more decode steps until a
        sequence slot frees (0 while one is free: the router's hard limit), the queued
        prefills, then its own prefill (module docstring)."""
        step_s = self.decode_step_s(active_seqs, active_ctx_tokens)
        return (step_s * (1 + max(0, slot_wait_steps))
                + waiting_seqs * self.prefill_overhead_s
                + max(0, queued_prefill_tokens) / self.prefill_tokens_per_s
                + self.prefill_s(prompt_tokens))

    def decode_tokens_per_s(self, batch: int, context_tokens: int = 0) -> float:
        """Tokens per second each of ``batch`` decoding sequences gets (one per decode step;
        a lone sequence's rate for an empty batch)."""
        return 1.0 / self.decode_step_s(max(1, batch), context_tokens)

    def service_s(self, prompt_tokens: float, gen_tokens: float, batch: int) -> float:
        """Engine seconds one request occupies at steady batch ``batch``: its prefill alone,
        plus its share (1/batch) of ``gen_tokens`` decode steps."""
        batch = max(1, batch)
        ctx = batch * (prompt_tokens + gen_tokens / 2.0)  # mean context held across the batch
        return self.prefill_s(int(prompt_tokens)) + gen_tokens * self.decode_step_s(batch, int(ctx)) / batch

    def service_rps(self, prompt_tokens: float, gen_tokens: float, batch: int) -> float:
        """Requests per second one replica completes at steady batch ``batch``."""
        return 1.0 / self.service_s(prompt_tokens, gen_tokens, batch)

    def sustainable_concurrency(self, ttft_slo_s: float, prompt_tokens: float,
                                gen_tokens: float, max_seqs: int) -> int:
        """The largest batch B <= ``max_seqs`` at which a new arrival still starts within
        ``ttft_slo_s`` while the replica keeps up: one decode step at B plus the prefills that
        arrive during it (B / time-in-system per step, Little's law) plus its own prefill.
        At least 1 (a replica always takes one request)."""
        best = 1
        for batch in range(1, max(1, max_seqs) + 1):
            ctx = int(batch * (prompt_tokens + gen_tokens / 2.0))
            step_s = self.decode_step_s(batch, ctx)
            in_system_s = self.prefill_s(int(prompt_tokens)) + gen_tokens * step_s
            arrivals_per_step = batch * step_s / in_system_s if in_system_s > 0 else 0.0
            ttft_s = step_s + arrivals_per_step * self.prefill_s(int(prompt_tokens)) \
                + self.prefill_s(int(prompt_tokens))
            if ttft_s > ttft_slo_s:
                break
            best = batch
        return best

    # --- wire form ----------------------------------------------------------------------
    def to_meta(self) -> dict[str, str]:
        """Registry-meta form (decimal strings, :data:`SPEED_META_KEYS`)."""
        return {k: repr(float(v)) for k, v in asdict(self).items()}

    @classmethod
    def from_meta(cls, meta: Mapping[str, object]) -> SpeedProfile | None:
        """The profile in a load report or registry meta, or None when any key is missing or
        not a finite number >= 0 (a replica that has not measured itself yet)."""
        try:
            return cls(**{k: float(meta[k]) for k in SPEED_META_KEYS})  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError):
            return None

    def to_dict(self) -> dict[str, float]:
        """JSON form (floats, :data:`SPEED_META_KEYS`)."""
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_file(cls, path: Path) -> SpeedProfile:
        """The ``speed`` object of an engine profile file (bench/engine_profile.py; schema
        :data:`PROFILE_SCHEMA`, documented there).  Raises :class:`ConfigError` naming the
        file and the key when it is unreadable, of another schema, or a value is missing or
        not a finite number >= 0."""
        data = read_profile_file(path)
        speed = data.get("speed")
        if not isinstance(speed, dict):
            raise ConfigError(f"engine profile {path}: 'speed' is {type(speed).__name__}, "
                              "not an object", name="speed", value=speed, limit="object")
        missing = [k for k in SPEED_META_KEYS if k not in speed]
        if missing:
            raise ConfigError(f"engine profile {path}: speed lacks {', '.join(missing)}",
                              name="speed", value=sorted(speed), limit=SPEED_META_KEYS)
        try:
            return cls(**{k: speed[k] for k in SPEED_META_KEYS})
        except ConfigError as exc:
            raise ConfigError(f"engine profile {path}: {exc.message}", name=exc.name,
                              value=exc.value, limit=exc.limit) from None


def slot_wait_steps(remaining_tokens: tuple[int, ...] | list[int], waiting_seqs: int,
                    free_slots: int) -> int:
    """Decode steps a new request waits for a sequence slot: 0 while ``waiting_seqs`` ahead
    of it leave a slot free, else until the ``k``-th earliest-ending active sequence ends
    (``remaining_tokens`` ascending, one token per step; beyond one round of the batch, whole
    lifetimes of the longest again: an upper bound)."""
    ahead = waiting_seqs + 1 - free_slots
    if ahead <= 0 or not remaining_tokens:
        return 0
    rounds, k = divmod(ahead - 1, len(remaining_tokens))
    return int(remaining_tokens[k] + rounds * remaining_tokens[-1])


MAX_PROFILE_BYTES = 16 << 20


def read_profile_file(path: Path) -> dict:
    """The JSON object of an engine profile file, schema checked.  Raises :class:`ConfigError`
    naming the file when it cannot be read, is over :data:`MAX_PROFILE_BYTES`, is not JSON or
    its ``schema`` is not :data:`PROFILE_SCHEMA`."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_PROFILE_BYTES:
            raise ConfigError(f"engine profile {path}: {size} bytes exceeds {MAX_PROFILE_BYTES}",
                              name="size_bytes", value=size, limit=MAX_PROFILE_BYTES)
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"engine profile {path}: cannot read it as JSON ({exc})",
                          name="path", value=str(path), limit="a JSON file") from None
    if not isinstance(data, dict) or data.get("schema") != PROFILE_SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"engine profile {path}: schema {found!r} is not {PROFILE_SCHEMA!r}",
                          name="schema", value=found, limit=PROFILE_SCHEMA)
    return data
