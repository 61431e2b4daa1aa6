"""KV sizing reproduces docs/architecture.md's figures ("Sizing"); the allocator's limits."""

import pytest

from agent.errors import CapacityExceeded, ConfigError
from agent.replica.kv import KVSlotAllocator, kv_budget_bytes, plan_kv
from agent.replica.synthetic import preset_config


def test_design_document_13b_on_a100_figures():
    # docs/architecture.md, "Sizing": 160 KB per token; 11 GB headroom = 11,534,336 KB -> 72,089 tokens -> ~80 at 900
    config = preset_config("13b-shaped")
    assert config.kv_bytes_per_token == 163_840
    budget = 11_534_336 * 1024
    plan = plan_kv(config, budget, max_seq_len=900)
    assert budget // plan.bytes_per_token == 72_089
    assert plan.seqs_at(900) == 80
    assert plan.max_seqs == 80 and plan.capacity_tokens == 72_000
    assert plan.cache_bytes <= budget


def test_budget_at_and_just_under_one_slot():
    config = preset_config("tiny")
    one = config.kv_bytes_per_token * 32
    assert plan_kv(config, one, 32).max_seqs == 1
    with pytest.raises(ConfigError, match="holds no slot") as e:
        plan_kv(config, one - 1, 32)
    assert e.value.limit == one
    assert plan_kv(config, one * 10, 32, max_seqs_limit=4).max_seqs == 4


def test_max_seq_len_limit_is_the_context_length():
    config = preset_config("tiny")  # max_position_embeddings 256
    plan_kv(config, 1 << 30, 256)
    with pytest.raises(ConfigError, match="max_seq_len"):
        plan_kv(config, 1 << 30, 257)


def test_cpu_budget_is_configuration():
    # the A100 arithmetic of docs/architecture.md with GB as 2**30: 40 - 26 - 3 = 11
    gib = 1 << 30
    assert kv_budget_bytes(26 * gib, cpu_budget_bytes=40 * gib, overhead_bytes=3 * gib) == 11 * gib
    assert kv_budget_bytes(100, cpu_budget_bytes=50) == 0
    with pytest.raises(ConfigError, match="kv_budget_bytes"):
        kv_budget_bytes(100)


def test_allocator_hands_lowest_slot_and_frees():
    kv = KVSlotAllocator(3, 16)
    assert [kv.allocate(16), kv.allocate(5), kv.allocate(1)] == [0, 1, 2]
    assert kv.used_tokens == 22 and kv.active == 3 and kv.free_slots == 0
    kv.free(1)
    assert kv.allocate(4) == 1
    with pytest.raises(ConfigError, match="not allocated"):
        kv.free(7)


def test_sequence_longer_than_a_slot_at_and_over():
    kv = KVSlotAllocator(2, 16)
    kv.allocate(16)
    with pytest.raises(CapacityExceeded) as e:
        kv.allocate(17)
    assert (e.value.need_tokens, e.value.limit_tokens, e.value.code) == (17, 16, 413)


def test_exhausted_slots_give_a_clear_error():
    kv = KVSlotAllocator(2, 16)
    kv.allocate(3)
    kv.allocate(3)
    with pytest.raises(CapacityExceeded, match="no free KV slot.*all 2 slots") as e:
        kv.allocate(3)
    assert isinstance(e.value, MemoryError) and e.value.limit_tokens == 32 - 6
