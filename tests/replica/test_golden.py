"""Golden check: recorded tokens verify; any difference fails with the first position."""

import dataclasses

import pytest
import torch

from agent.errors import GoldenMismatch
from agent.replica.engine import Engine
from agent.replica.golden import record_golden, verify_golden
from agent.replica.synthetic import preset_config, synthetic_tensors

PROMPTS = [[1, 2, 3], [7, 7], [200, 3, 4, 5]]


def test_record_then_verify_on_a_fresh_engine(tiny_engine, tiny_dir):
    golden = record_golden(tiny_engine, PROMPTS, seed=11, max_tokens=6)
    assert golden.seed == 11 and [len(e) for e in golden.expected] == [6, 6, 6]
    config = tiny_engine.config
    other = Engine(config, {k: v.clone() for k, v in tiny_engine.model.state_dict().items()},
                   max_seqs=1, max_seq_len=32)  # different slot count, same tokens
    verify_golden(other, golden)


def test_tampered_expected_names_first_differing_position(tiny_engine):
    golden = record_golden(tiny_engine, PROMPTS, seed=11, max_tokens=6)
    expected = [list(e) for e in golden.expected]
    expected[2][4] = (expected[2][4] + 1) % 256
    expected[2][5] = (expected[2][5] + 1) % 256
    with pytest.raises(GoldenMismatch) as e:
        verify_golden(tiny_engine, dataclasses.replace(golden, expected=expected))
    assert (e.value.prompt_index, e.value.position) == (2, 4)
    assert e.value.actual == golden.expected[2][4] and e.value.expected == expected[2][4]
    assert "prompt 2, token 4" in str(e.value)


def test_different_weights_fail_the_check(tiny_engine):
    golden = record_golden(tiny_engine, PROMPTS, seed=11, max_tokens=6)
    config = preset_config("tiny")
    weights = synthetic_tensors(config, seed=0)
    weights["model.norm.weight"] = weights["model.norm.weight"] * torch.linspace(0.5, 1.5, 64)
    with pytest.raises(GoldenMismatch):
        verify_golden(Engine(config, weights, max_seqs=3, max_seq_len=32), golden)
