"""A replica's speed: measured service rates, its step, and the TTFT they predict for a new request.

One pure module that the replica (which measures and schedules), the front door (which routes
and admits by predicted TTFT), the predictor (which sizes the warm pool) and the simulator
(whose replicas run at measured speed) all use, so the four agree on one model of a replica.

The rates, for one replica:

- a prefill call over ``N`` prompt tokens (one chunk of one sequence, or equal-length rows of
  several, ``N`` counting every row) takes ``prefill_s(N) = prefill_overhead_s + N / prefill_tokens_per_s``;
- a decode step over ``B`` sequences holding ``C`` cached tokens in total takes
  ``decode_step_s(B, C) = decode_base_s + decode_per_seq_s * (B - 1) + decode_per_ctx_token_s * C``
  (weights are read once per step; attention reads every cached token).

The step (agent/replica/engine.py runs it, agent/sim/replica.py replays it): prefill chunks
of the waiting sequences, oldest first, within the step's token budget, each sequence's first
token sampled when its last chunk runs; then one decode step over every running sequence
(B, S=1).  The budget is chunked prefill's ``max_num_batched_tokens`` (vLLM,
vllm/v1/core/sched/scheduler.py ``Scheduler.schedule``: running requests are scheduled
first, then waiting ones in arrival order are chunked into what is left) sized as
Sarathi-Serve sizes it (Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference
with Sarathi-Serve", OSDI 2024: from the TBT SLO and profiled step times): the most prompt
tokens a step can carry and still end within the inter-token-latency target, so a burst of
prompts never stalls the running streams for longer than one target.  The target is the
replica's ``itl_target_s``; unlike vLLM's constant, the budget comes from the measured rates:

    budget(B, C) = max(floor, (itl_target_s - decode_step_s(B, C) - prefill_overhead_s) * prefill_tokens_per_s)
    floor        = max(MIN_PREFILL_BUDGET_TOKENS, prefill_overhead_s * prefill_tokens_per_s)

The floor keeps prefill moving when the decode alone fills the target (a long batch on a slow
machine): at least 16 tokens a step, and never a chunk shorter than its own call's fixed cost
(at that length half a call's time is tokens).  The target is a p99 and the fit holds means,
so a replica plans by its ITL target less the p99 of how far its recent steps overran their
plan (agent/replica/speedmeter.py ``step_overrun_s``: its loop's own time, noise; at most a
quarter of the target, agent/replica/engine.py ``MAX_OVERRUN_SHARE``), and that is the
``itl_target_s`` it reports, so the router and the simulator count the steps it runs.
``itl_target_s`` 0 means no budget: each waiting sequence is prefilled whole, one after
another, before the decode (the replica's schedule without chunked prefill; also what a load
report without the key describes).  The ITL target's default for a replica,
:data:`DEFAULT_ITL_SLO_S` = 200 ms, is MLPerf Inference's inter-token (TPOT) p99 constraint
for its Llama 2 70B server scenario, the one whose TTFT constraint is 2 s, this project's warm
TTFT SLO (mlcommons/inference loadgen/mlperf.conf:
``llama2-70b.Server.ttft_latency = 2000``, ``tpot_latency = 200``, in ms).

Which sequences share a prefill call (:func:`plan_prefill_call`): the oldest waiting one's
chunk comes first; when that chunk ends its prompt, the next ones join the call as further rows
``[k, L]`` (each its whole prompt left, shorter rows padded to the longest) while the call fits
the budget and its padding costs less than the calls it saves, so no sequence is passed by a
younger one and a shared call is never dearer than separate ones.  Measured on SmolLM2-135M's
AOT package (2 cores, bench/results/prefill_burst.json, ``--shapes``): a call's cost follows
its tokens whatever the rows ([1,96] 171 ms, [8,12] 159 ms, [1,128] 228 ms, [2,64] 205 ms)
beside a fixed ~20 ms a call ([1,8] 20 ms), so a burst of short prompts goes as one call
instead of one each.  Where the rows differ in length the padding is paid in full, so long
prompts rarely share; a step that ends one and starts the next pays two calls' overhead.  The
decode does not share the prefill's call: its rows would be padded to the chunk's length
([4,96] with three decode rows 605 ms against 180 ms for a [3,1] decode and a [1,96] chunk
apart).

So a request that arrives now meets: the decode of the step in progress, charged whole (an
upper bound; the front door admits on it); when every sequence slot is taken, ``slot_wait_steps``
more decode steps for one to free (the replica knows how many tokens its active sequences have
left); then the steps that prefill the tokens queued ahead of it and its own
(:meth:`SpeedProfile.prefill_wait_s`).  With a budget, the ``W`` sequences ahead join the
decode batch as their prefills end, on average half of them over the wait, so each of those
steps runs ``decode_step_s(B + W/2, C + Q/2)`` beside its chunk.  Prompts that arrive after a
request may still share its last call, so its first token can come up to one step (the ITL
target) later than predicted; a shared call saves the overheads the prediction counts for it.

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
# The speed's last key, the step's ITL target, may be absent (0: no budget, whole prompts).
SPEED_META_KEYS = ("prefill_tokens_per_s", "prefill_overhead_s", "decode_base_s",
                   "decode_per_seq_s", "decode_per_ctx_token_s", "itl_target_s")
RATE_META_KEYS = SPEED_META_KEYS[:5]
"""The measured rates: required wherever a speed is read."""
QUEUE_META_KEYS = ("waiting_seqs", "queued_prefill_tokens", "active_ctx_tokens")
QUEUE_META_LIMITS = {"waiting_seqs": 1 << 20, "queued_prefill_tokens": 1 << 40,
                     "active_ctx_tokens": 1 << 40}
"""The most a queue key may state (a reader takes a larger value as this much: as busy as a
report can say): within them, and :meth:`SpeedProfile.check_limits`'s, a prediction's
arithmetic stays within floats."""
PROFILE_SCHEMA = "rewarm.engine_profile/1"
"""``schema`` of the file bench/engine_profile.py writes (:meth:`SpeedProfile.from_file`)."""

DEFAULT_ITL_SLO_S = 0.2
"""A replica's inter-token-latency target by default (s): MLPerf Inference's TPOT p99
constraint for Llama 2 70B, server scenario (module docstring)."""
MIN_PREFILL_BUDGET_TOKENS = 16
"""The least prompt tokens a step's budget holds, however long its decode (module docstring)."""

MAX_PREFILL_TOKENS_PER_S = 1e9
MIN_PREFILL_TOKENS_PER_S = 1e-3
"""The prefill rates a reported profile may state (tokens/s): at most the speed meter's own
ceiling (one nanosecond a token, agent/replica/speedmeter.py ``MIN_S_PER_TOKEN``), at least a
token in a thousand seconds."""
MAX_PROFILE_S = 3600.0
"""The most any of a reported profile's seconds may be (a call's overhead, a decode step's
costs, the ITL target): an hour.  Within these limits the products the step's budget and the
predictions turn into integers (``prefill_overhead_s * prefill_tokens_per_s``, the budget
in tokens) stay finite, and so does one request's service time; past them a report is a
broken meter or a forged entry (:meth:`SpeedProfile.check_limits`)."""


@dataclass(frozen=True)
class SpeedProfile:
    """Measured service rates of one replica (seconds; tokens/s) and the step time its prefill
    budget plans by, ``itl_target_s`` (s; its ITL target less its steps' measured overrun,
    module docstring; 0: no prefill budget, whole prompts).
    All fields finite, >= 0, ``prefill_tokens_per_s`` > 0 and ``decode_base_s`` > 0; else
    :class:`ConfigError`."""

    prefill_tokens_per_s: float
    prefill_overhead_s: float
    decode_base_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    itl_target_s: float = 0.0

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

    def check_limits(self) -> SpeedProfile:
        """This profile, when every field is within the limits a report may state
        (:data:`MIN_PREFILL_TOKENS_PER_S` <= ``prefill_tokens_per_s`` <=
        :data:`MAX_PREFILL_TOKENS_PER_S`, every seconds field <= :data:`MAX_PROFILE_S`);
        else ConfigError naming the field, the value and the limit.  Checked where a profile
        is read (:meth:`from_meta`, :meth:`from_file`), not where one is computed."""
        rate = self.prefill_tokens_per_s
        if not MIN_PREFILL_TOKENS_PER_S <= rate <= MAX_PREFILL_TOKENS_PER_S:
            limit = MIN_PREFILL_TOKENS_PER_S if rate < MIN_PREFILL_TOKENS_PER_S \
                else MAX_PREFILL_TOKENS_PER_S
            raise ConfigError(f"SpeedProfile prefill_tokens_per_s={rate!r} is outside "
                              f"[{MIN_PREFILL_TOKENS_PER_S:g}, {MAX_PREFILL_TOKENS_PER_S:g}]",
                              name="prefill_tokens_per_s", value=rate, limit=limit)
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if value > MAX_PROFILE_S:
                raise ConfigError(f"SpeedProfile {f.name}={value!r} exceeds {MAX_PROFILE_S:g} s",
                                  name=f.name, value=value, limit=MAX_PROFILE_S)
        return self

    # --- the engine's two kinds of work ------------------------------------------------
    def prefill_s(self, prompt_tokens: int) -> float:
        """Seconds of one prefill call over ``prompt_tokens`` tokens (all its rows)."""
        return self.prefill_overhead_s + max(0, prompt_tokens) / self.prefill_tokens_per_s

    def decode_step_s(self, batch: float, context_tokens: float = 0) -> float:
        """Seconds of one decode step over ``batch`` sequences holding ``context_tokens``
        cached tokens in total; 0 for an empty batch.  (A fractional batch is a mean over
        steps: :meth:`prefill_wait_s`.)"""
        if batch <= 0:
            return 0.0
        return (self.decode_base_s + self.decode_per_seq_s * (batch - 1)
                + self.decode_per_ctx_token_s * max(0, context_tokens))

    # --- the step -------------------------------------------------------------------------
    def prefill_budget_tokens(self, batch: float, context_tokens: float = 0) -> int | None:
        """Prompt tokens one step may prefill beside a decode of ``batch`` sequences holding
        ``context_tokens``: the module docstring's ``budget(B, C)``, at least its floor;
        None when ``itl_target_s`` is 0 (no budget: whole prompts)."""
        if self.itl_target_s <= 0:
            return None
        spare_s = self.itl_target_s - self.decode_step_s(batch, context_tokens) \
            - self.prefill_overhead_s
        floor = self.budget_floor_tokens()
        return max(floor, int(spare_s * self.prefill_tokens_per_s)) if spare_s > 0 else floor

    def budget_floor_tokens(self) -> int:
        """The least prompt tokens a step's budget holds: the module docstring's ``floor``."""
        return max(MIN_PREFILL_BUDGET_TOKENS, self.call_overhead_tokens())

    def call_overhead_tokens(self) -> int:
        """One prefill call's fixed cost in prompt tokens, ``prefill_overhead_s`` at the
        measured rate, rounded up."""
        return math.ceil(self.prefill_overhead_s * self.prefill_tokens_per_s)

    def call_budget_tokens(self, budget_left: int, calls: int) -> int:
        """Prompt tokens the next prefill call of a step may use, with ``budget_left`` of the
        step's budget unspent after ``calls`` calls: all of it for the step's first call; for
        a further one what is left after that call's own overhead, if that still reaches
        :meth:`budget_floor_tokens`, else 0 (the step's prefill is over)."""
        if calls == 0:
            return max(0, budget_left)
        left = budget_left - self.call_overhead_tokens()
        return left if left >= self.budget_floor_tokens() else 0

    # --- what a request meets -----------------------------------------------------------
    def prefill_wait_s(self, prompt_tokens: int, *, waiting_seqs: float = 0,
                       queued_prefill_tokens: float = 0, active_seqs: float = 0,
                       active_ctx_tokens: float = 0) -> float:
        """Seconds from the end of the step in progress to the first token of a new request
        of ``prompt_tokens`` tokens behind ``waiting_seqs`` sequences with
        ``queued_prefill_tokens`` prompt tokens left, beside ``active_seqs`` running ones
        holding ``active_ctx_tokens`` (module docstring).  Without a budget: each queued
        prompt's call, then its own.  With one, the ``W`` queued sequences and its own are
        prefilled oldest first in ``n`` steps, one call each plus one more where a prompt
        ends inside a step (``W`` more at most: a shared call saves them), every call's
        overhead charged to its step's budget: ``n = ceil((Q + P + W * overhead_tokens) /
        budget)``; the decodes of the first ``n - 1`` steps come between, at the batch the
        sequences ahead swell it to on average.  So one step is the same as no budget."""
        own, queued = max(0, prompt_tokens), max(0.0, queued_prefill_tokens)
        waiting = max(0.0, waiting_seqs)
        rate, overhead = self.prefill_tokens_per_s, self.prefill_overhead_s
        if self.itl_target_s <= 0:
            return (waiting + 1) * overhead + (queued + own) / rate
        batch = max(0.0, active_seqs) + waiting / 2
        ctx = max(0.0, active_ctx_tokens) + queued / 2
        budget = self.prefill_budget_tokens(batch, ctx)
        assert budget is not None  # itl_target_s > 0
        steps = max(1, math.ceil((queued + own + waiting * self.call_overhead_tokens())
                                 / budget))
        return (steps + waiting) * overhead + (queued + own) / rate \
            + (steps - 1) * self.decode_step_s(batch, ctx)

    def predict_ttft_s(self, prompt_tokens: int, *, active_seqs: int = 0,
                       active_ctx_tokens: int = 0, waiting_seqs: float = 0,
                       queued_prefill_tokens: float = 0, slot_wait_steps: int = 0) -> float:
        """Predicted TTFT (s) at this replica for a new request of ``prompt_tokens`` tokens,
        given its queue: the step in progress, ``slot_wait_steps`` more decode steps until a
        sequence slot frees (0 while one is free: the router's hard limit), then the steps
        that prefill the queued tokens and its own (:meth:`prefill_wait_s`)."""
        step_s = self.decode_step_s(active_seqs, active_ctx_tokens)
        return step_s * (1 + max(0, slot_wait_steps)) + self.prefill_wait_s(
            prompt_tokens, waiting_seqs=waiting_seqs,
            queued_prefill_tokens=queued_prefill_tokens, active_seqs=active_seqs,
            active_ctx_tokens=active_ctx_tokens)

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
        arrive during it (B / time-in-system per step, Little's law) and its own, on the
        step's schedule (:meth:`prefill_wait_s`).  At least 1 (a replica always takes one
        request)."""
        best = 1
        for batch in range(1, max(1, max_seqs) + 1):
            ctx = int(batch * (prompt_tokens + gen_tokens / 2.0))
            step_s = self.decode_step_s(batch, ctx)
            in_system_s = self.prefill_s(int(prompt_tokens)) + gen_tokens * step_s
            arrivals_per_step = batch * step_s / in_system_s if in_system_s > 0 else 0.0
            ttft_s = step_s + self.prefill_wait_s(
                int(prompt_tokens), waiting_seqs=arrivals_per_step,
                queued_prefill_tokens=arrivals_per_step * int(prompt_tokens),
                active_seqs=batch, active_ctx_tokens=ctx)
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
        """The profile in a load report or registry meta, or None when any rate
        (:data:`RATE_META_KEYS`) is missing, or any key is not a finite number >= 0 or is
        outside the limits a report may state (:meth:`check_limits`: a replica that has not
        measured itself yet, or whose figures are no measurement).  A missing
        ``itl_target_s`` is 0."""
        try:
            values = {k: float(meta[k]) for k in RATE_META_KEYS}  # type: ignore[arg-type]
            values["itl_target_s"] = float(meta.get("itl_target_s", 0.0))  # type: ignore[arg-type]
            return cls(**values).check_limits()
        except (KeyError, TypeError, ValueError, OverflowError):
            return None

    def to_dict(self) -> dict[str, float]:
        """JSON form (floats, :data:`SPEED_META_KEYS`)."""
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_file(cls, path: Path) -> SpeedProfile:
        """The ``speed`` object of an engine profile file (bench/engine_profile.py; schema
        :data:`PROFILE_SCHEMA`, documented there).  Raises :class:`ConfigError` naming the
        file and the key when it is unreadable, of another schema, or a rate
        (:data:`RATE_META_KEYS`) is missing or a value is not a finite number >= 0 or is
        outside :meth:`check_limits`'s limits.  A missing ``itl_target_s`` is 0 (the
        profile measures rates, not a schedule)."""
        data = read_profile_file(path)
        speed = data.get("speed")
        if not isinstance(speed, dict):
            raise ConfigError(f"engine profile {path}: 'speed' is {type(speed).__name__}, "
                              "not an object", name="speed", value=speed, limit="object")
        missing = [k for k in RATE_META_KEYS if k not in speed]
        if missing:
            raise ConfigError(f"engine profile {path}: speed lacks {', '.join(missing)}",
                              name="speed", value=sorted(speed), limit=RATE_META_KEYS)
        try:
            return cls(**{k: speed[k] for k in SPEED_META_KEYS if k in speed}).check_limits()
        except ConfigError as exc:
            raise ConfigError(f"engine profile {path}: {exc.message}", name=exc.name,
                              value=exc.value, limit=exc.limit) from None


def plan_prefill_call(left: list[int], room: list[int], budget_tokens: int, max_len: int,
                      join_padding_tokens: int) -> list[int]:
    """Prompt tokens each of the oldest waiting sequences prefills in one call (module
    docstring): ``left`` [n] the prompt tokens each has still to prefill, oldest first (only
    those that hold or can take a sequence slot); ``room`` [n] the positions left in each
    one's slot from where its prefill stands (a padded row may not run past it);
    ``budget_tokens`` the call's budget (>= 1); ``max_len`` the longest row the forward
    takes; ``join_padding_tokens`` one call's fixed cost in tokens
    (:meth:`SpeedProfile.call_overhead_tokens`).

    The oldest sequence's chunk is ``min(left[0], budget_tokens, max_len)``.  Only when that
    ends its prompt do the next ones join, in order, each with its whole prompt left, while
    the call ``[k, L]`` (``L`` its longest row, shorter rows padded) fits the budget and its
    slots, and its padding stays within the overhead of the ``k - 1`` calls it saves: so a
    shared call is never dearer than separate ones, and no sequence is passed by a younger
    one.  Returns ``[k]`` token counts (the call costs ``k * max(rows)`` tokens of the
    budget); ``[]`` when ``left`` is empty."""
    if not left:
        return []
    rows = [max(1, min(left[0], budget_tokens, max_len))]
    if rows[0] < left[0]:
        return rows                   # cut by the budget: the call is this chunk alone
    width, padding = rows[0], 0
    for n, _ in zip(left[1:], room[1:], strict=True):
        wider = max(width, n)
        pad = padding + (wider - width) * len(rows) + (wider - n)
        if n > max_len or (len(rows) + 1) * wider > budget_tokens \
                or pad > len(rows) * join_padding_tokens \
                or min(room[:len(rows) + 1]) < wider:
            break
        rows.append(n)
        width, padding = wider, pad
    return rows


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
