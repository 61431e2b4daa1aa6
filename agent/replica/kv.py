"""KV-cache sizing and the slot allocator.

Sizing follows docs/architecture.md ("Sizing"): the KV
cache gets the memory left after the weights and a fixed overhead, divided by the bytes one
token costs (``2 * layers * kv_heads * head_dim * dtype_bytes``).  For the document's 13B
model on a 40 GB A100 that is 11 GB / 160 KB = 72,089 tokens, ~80 sequences of 900 tokens
(``tests/replica/test_kv.py`` reproduces those figures).

The engine's cache is ``max_seqs`` slots of ``max_seq_len`` tokens each (the layout the exported
forward indexes with ``cache_batch_idx``), so a sequence needs one free slot and
``prompt + max_tokens <= max_seq_len``.  A request that cannot fit raises
:class:`~agent.errors.CapacityExceeded`, before anything is allocated.
"""

from __future__ import annotations

import dataclasses

import torch

from agent.errors import CapacityExceeded, ConfigError
from agent.replica.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class KVPlan:
    """How much KV cache fits.  ``capacity_tokens = max_seqs * max_seq_len``."""

    bytes_per_token: int
    budget_bytes: int
    max_seq_len: int
    max_seqs: int

    @property
    def capacity_tokens(self) -> int:
        return self.max_seqs * self.max_seq_len

    @property
    def cache_bytes(self) -> int:
        return self.capacity_tokens * self.bytes_per_token

    def seqs_at(self, context_len: int) -> int:
        """Concurrent sequences of ``context_len`` tokens the budget holds (tokens // context),
        docs/architecture.md's figure; never more than the slot count when slots are that long."""
        if context_len < 1:
            raise ConfigError(f"context_len={context_len} must be >= 1", name="context_len",
                              value=context_len, limit=1)
        return (self.budget_bytes // self.bytes_per_token) // context_len


def plan_kv(config: LlamaConfig, budget_bytes: int, max_seq_len: int,
            max_seqs_limit: int | None = None) -> KVPlan:
    """Slots of ``max_seq_len`` tokens that fit in ``budget_bytes``.

    Raises ConfigError when not even one slot fits (naming the budget and the bytes one needs).
    """
    per_token = config.kv_bytes_per_token
    if max_seq_len < 1 or max_seq_len > config.max_position_embeddings:
        raise ConfigError(f"max_seq_len={max_seq_len} must be in [1, {config.max_position_embeddings}]",
                          name="max_seq_len", value=max_seq_len, limit=config.max_position_embeddings)
    slots = budget_bytes // (per_token * max_seq_len)
    if max_seqs_limit is not None:
        slots = min(slots, max_seqs_limit)
    if slots < 1:
        raise ConfigError(f"KV budget {budget_bytes} bytes holds no slot of {max_seq_len} tokens "
                          f"({per_token * max_seq_len} bytes)", name="kv_budget_bytes",
                          value=budget_bytes, limit=per_token * max_seq_len)
    return KVPlan(per_token, budget_bytes, max_seq_len, slots)


def kv_budget_bytes(weights_bytes: int, *, device: str = "cpu", cpu_budget_bytes: int | None = None,
                    overhead_bytes: int = 0) -> int:
    """Memory the KV cache may take (docs/architecture.md, "Sizing": 40 GB - 26 GB weights
    - ~3 GB activations/CUDA context = 11 GB).

    On CUDA: free device memory now (the weights, ``weights_bytes``, are already resident, so
    they are not subtracted again) less ``overhead_bytes``.  On CPU, memory is shared with
    everything else on the host, so the replica's total is configuration: ``cpu_budget_bytes``
    less ``weights_bytes`` and ``overhead_bytes``.  Never negative.  Raises ConfigError when a
    CPU replica has no ``cpu_budget_bytes``.
    """
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return max(0, free - overhead_bytes)
    if cpu_budget_bytes is None:
        raise ConfigError("a CPU replica needs kv_budget_bytes (configuration)", name="kv_budget_bytes",
                          value=None, limit=None)
    return max(0, cpu_budget_bytes - weights_bytes - overhead_bytes)


class KVSlotAllocator:
    """Hands out cache slots 0..max_seqs-1; tracks tokens reserved per slot.

    ``allocate(need_tokens)`` reserves the lowest free slot for a sequence that will hold at
    most ``need_tokens`` tokens (prompt + max_tokens).  Raises CapacityExceeded when
    ``need_tokens > max_seq_len`` or no slot is free.
    """

    def __init__(self, max_seqs: int, max_seq_len: int) -> None:
        if max_seqs < 1 or max_seq_len < 1:
            raise ConfigError(f"max_seqs={max_seqs}, max_seq_len={max_seq_len} must be >= 1",
                              name="max_seqs", value=max_seqs, limit=1)
        self.max_seqs, self.max_seq_len = max_seqs, max_seq_len
        self._free = list(range(max_seqs - 1, -1, -1))  # pop() gives the lowest
        self._reserved: dict[int, int] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.max_seqs * self.max_seq_len

    @property
    def used_tokens(self) -> int:
        return sum(self._reserved.values())

    @property
    def active(self) -> int:
        return len(self._reserved)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def check(self, need_tokens: int) -> None:
        """Raise CapacityExceeded if a sequence of ``need_tokens`` can never fit a slot."""
        if need_tokens > self.max_seq_len:
            raise CapacityExceeded(f"sequence needs {need_tokens} KV tokens (prompt + max_tokens), "
                                   f"a slot holds {self.max_seq_len}", need_tokens=need_tokens,
                                   limit_tokens=self.max_seq_len)

    def allocate(self, need_tokens: int) -> int:
        self.check(need_tokens)
        if not self._free:
            raise CapacityExceeded(f"no free KV slot for {need_tokens} tokens: all {self.max_seqs} "
                                   f"slots in use ({self.used_tokens} of {self.capacity_tokens} tokens)",
                                   need_tokens=need_tokens, limit_tokens=self.capacity_tokens - self.used_tokens)
        slot = self._free.pop()
        self._reserved[slot] = need_tokens
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot``.  Raises ConfigError for a slot that is not allocated."""
        if slot not in self._reserved:
            raise ConfigError(f"KV slot {slot} is not allocated", name="slot", value=slot,
                              limit=sorted(self._reserved))
        del self._reserved[slot]
        self._free.append(slot)
        self._free.sort(reverse=True)
