"""Golden check: recorded tokens verify; any difference fails with the first position; the
record is made by the check's own (teacher-forced) procedure, and a record of another is refused."""

import dataclasses

import pytest
import torch

from agent.errors import GoldenMismatch, SnapshotIncompatible
from agent.replica.engine import Engine
from agent.replica.golden import GOLDEN_METHOD, record_golden, verify_golden
from agent.snapshot.format import GoldenCheck
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


class _Rule:
    """A stand-in engine whose model is a rule of the prefix (deterministic, like the real one):
    the teacher-forced replay applies the rule; ``generate_lockstep`` applies it too, except
    that at ``split`` (prompt, position) its decode "kernel" breaks a near-tie the other way."""

    def __init__(self, split=None, flaky=False):
        self.split, self.flaky, self.replays = split, flaky, 0

    @staticmethod
    def rule(prefix):
        return (sum(prefix) * 7 + len(prefix)) % 50

    def generate_lockstep(self, prompts, max_tokens, seed=None):
        out = []
        for i, p in enumerate(prompts):
            got = []
            for k in range(max_tokens):
                t = self.rule(p + got)
                got.append((t + 1) % 50 if (i, k) == self.split else t)
            out.append(got)
        return out

    def teacher_forced(self, prompts, tokens, seed=None):
        self.replays += 1
        flip = self.flaky and self.replays % 2
        return [[(self.rule(p + row[:k]) + flip) % 50 for k in range(len(row))]
                for p, row in zip(prompts, tokens, strict=True)]


def test_a_near_tie_between_kernels_is_recorded_the_way_the_check_sees_it():
    engine = _Rule(split=(1, 2))
    golden = record_golden(engine, [[1, 2], [3], [4, 4]], seed=0, max_tokens=5)
    want = _Rule().generate_lockstep([[1, 2], [3], [4, 4]], 5)
    assert golden.expected == want and golden.method == GOLDEN_METHOD
    assert engine.generate_lockstep([[1, 2], [3], [4, 4]], 5)[1] != want[1]   # decoding differs
    assert engine.replays <= 5 + 1
    verify_golden(engine, golden)                                # and the check accepts it


def test_a_record_that_never_settles_is_refused():
    with pytest.raises(GoldenMismatch, match="did not settle") as err:
        record_golden(_Rule(flaky=True), [[1, 2]], seed=0, max_tokens=3)
    assert err.value.prompt_index == 0


def test_record_without_a_split_takes_one_replay():
    engine = _Rule()
    record_golden(engine, [[1], [2]], seed=0, max_tokens=8)
    assert engine.replays == 1


@pytest.mark.parametrize("position", [0, 3, 5], ids=["first", "middle", "last-by-decode"])
def test_every_position_is_compared(tiny_engine, position):
    golden = record_golden(tiny_engine, PROMPTS, seed=11, max_tokens=6)
    expected = [list(e) for e in golden.expected]
    expected[1][position] = (expected[1][position] + 1) % 256
    with pytest.raises(GoldenMismatch) as e:
        verify_golden(tiny_engine, dataclasses.replace(golden, expected=expected))
    assert (e.value.prompt_index, e.value.position) == (1, position)
    assert e.value.actual == golden.expected[1][position]


def test_a_record_of_another_method_is_refused_before_anything_runs():
    engine = _Rule()
    golden = dataclasses.replace(record_golden(engine, [[1]], seed=0, max_tokens=2), method="")
    engine.replays = 0
    with pytest.raises(SnapshotIncompatible) as err:
        verify_golden(engine, golden, "snap-x")
    assert err.value.mismatches == {"golden.method": ("", GOLDEN_METHOD)}
    assert "snap-x" in str(err.value) and engine.replays == 0


@pytest.mark.parametrize("expected, position", [([[1, 2]], 0), ([[1, 2], [3]], 0),
                                                ([[1, 2], [3, 4, 5]], 0)],
                         ids=["a row missing", "a row short", "a row long"])
def test_a_malformed_record_is_a_mismatch(expected, position):
    golden = GoldenCheck(prompts=[[1], [2]], seed=0, max_tokens=2, expected=expected,
                         method=GOLDEN_METHOD)
    with pytest.raises(GoldenMismatch, match="malformed") as err:
        verify_golden(_Rule(), golden)
    assert err.value.position == position


def test_a_recorded_token_outside_the_vocabulary_is_a_mismatch(tiny_engine):
    golden = record_golden(tiny_engine, PROMPTS, seed=11, max_tokens=3)
    expected = [list(e) for e in golden.expected]
    expected[2][1] = 256                     # tiny vocab: 256
    with pytest.raises(GoldenMismatch, match="vocabulary") as err:
        verify_golden(tiny_engine, dataclasses.replace(golden, expected=expected))
    assert (err.value.prompt_index, err.value.position, err.value.expected) == (2, 1, 256)


def test_a_record_of_no_prompts_is_a_mismatch_not_a_pass():
    """A manifest whose golden record holds no prompts checks nothing: refused by name (as the
    node agent reads it: 'golden check failed'), before the engine is asked anything."""
    engine = _Rule()
    golden = GoldenCheck(prompts=[], seed=0, max_tokens=2, expected=[], method=GOLDEN_METHOD)
    with pytest.raises(GoldenMismatch) as err:
        verify_golden(engine, golden, "snap-x")
    assert str(err.value).startswith("golden check failed: snap-x: its record holds 0 prompts")
    assert err.value.expected == 1 and err.value.actual == 0 and engine.replays == 0


def test_a_malformed_record_reads_as_a_failed_check_across_the_worker_boundary():
    from agent.node.processes import _raise_for

    golden = GoldenCheck(prompts=[[1], [2]], seed=0, max_tokens=2, expected=[[1, 2]],
                         method=GOLDEN_METHOD)
    with pytest.raises(GoldenMismatch) as err:
        verify_golden(_Rule(), golden)
    with pytest.raises(GoldenMismatch):       # the worker answers the message as its reason
        _raise_for("restore", {"reason": str(err.value), "code": 500})


def test_a_record_with_an_empty_prompt_is_a_mismatch_before_anything_runs():
    engine = _Rule()
    golden = GoldenCheck(prompts=[[1], []], seed=0, max_tokens=2, expected=[[1, 2], [3, 4]],
                         method=GOLDEN_METHOD)
    with pytest.raises(GoldenMismatch) as err:
        verify_golden(engine, golden, "snap-x")
    assert "snap-x: prompt 1 of its record holds 0 tokens" in str(err.value)
    assert err.value.prompt_index == 1 and engine.replays == 0


def test_drift_counts_argmax_agreement_and_the_largest_logit_difference():
    import torch

    from agent.replica.golden import drift

    ref = torch.zeros(2, 2, 4)
    ref[..., 1] = 1.0
    got = ref.clone()
    got[1, 1, 3] = 2.5        # one of four positions now prefers token 3
    out = drift(ref, got)
    assert out == {"top1_agreement": 0.75, "max_logit_diff": 2.5, "max_logit": 1.0, "positions": 4}


def test_drift_rows_are_256_tokens_of_the_fixed_text():
    from agent.replica.golden import DRIFT_TEXT, drift_rows

    rows = drift_rows(lambda text: [ord(c) for c in text])
    assert [len(r) for r in rows] == [64] * 4
    assert sum(rows, []) == [ord(c) for c in DRIFT_TEXT[:256]]
    with pytest.raises(ValueError, match="gives 3 tokens, needs 256"):
        drift_rows(lambda text: [1, 2, 3])
