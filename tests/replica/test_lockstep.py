"""Prompt sets run together: teacher-forced replay reproduces what generation samples, in two
forward calls (a batched prefill, then a batched decode step) per group, and frees its slots."""

import pytest

from agent.errors import ProtocolError
from agent.replica.engine import Engine

PROMPTS = [[1, 2, 3], [7, 7], [200, 3, 4, 5]]


def _recording(engine, positions=None):
    """Wrap ``engine.forward`` to record each call's sizes (B, S, K): tokens [B, S] and
    logit_pos [B, K] (its values appended to ``positions`` when given)."""
    calls, inner = [], engine.forward

    def forward(tokens, *args):
        logit_pos = args[-1]
        calls.append((*tokens.shape, logit_pos.shape[1]))
        if positions is not None:
            positions.append(logit_pos.tolist())
        return inner(tokens, *args)

    engine.forward = forward
    return calls


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
def test_replaying_generated_tokens_samples_them_back(tiny_engine, seed):
    generated = tiny_engine.generate_lockstep(PROMPTS, 6, seed=seed)
    assert tiny_engine.teacher_forced(PROMPTS, generated, seed=seed) == generated


def test_greedy_replay_agrees_with_the_serving_path(tiny_engine):
    """The server's way (each prompt prefilled alone, then batched decode) gives the tokens the
    replay accepts: the check checks what a served greedy request would produce."""
    served = tiny_engine.generate(PROMPTS, 5)
    assert tiny_engine.teacher_forced(PROMPTS, served) == served


def test_replay_costs_one_prefill_and_one_decode_per_group(tiny_engine):
    tokens = tiny_engine.generate_lockstep(PROMPTS, 6, seed=3)
    calls = _recording(tiny_engine)
    tiny_engine.teacher_forced(PROMPTS, tokens, seed=3)
    # the inputs are prompt + the first 5 of 6 tokens: all but the last (longest: 4 + 4), the
    # logits of every position (K = S), then the last alone (S = 1)
    assert calls == [(3, 4 + 4, 4 + 4), (3, 1, 1)]
    two = Engine(tiny_engine.config, tiny_engine.model.state_dict(), max_seqs=2, max_seq_len=32)
    calls = _recording(two)                # two groups: 2 prompts, then 1
    assert two.teacher_forced(PROMPTS, tokens, seed=3) == tokens
    assert calls == [(2, 3 + 4, 3 + 4), (2, 1, 1), (1, 4 + 4, 4 + 4), (1, 1, 1)]


def test_generation_costs_one_call_per_token(tiny_engine):
    """Each call asks for one position's logits per row: the prefill each prompt's last
    token (rows padded past it), each decode step its one token."""
    positions: list = []
    calls = _recording(tiny_engine, positions)
    tiny_engine.generate_lockstep(PROMPTS, 4, seed=0)
    assert calls == [(3, 4, 1), (3, 1, 1), (3, 1, 1), (3, 1, 1)]
    assert positions == [[[2], [1], [3]]] + [[[0], [0], [0]]] * 3


def test_a_single_token_after_a_single_token_prompt_is_a_decode_step_only(tiny_engine):
    first = tiny_engine.generate_lockstep([[9], [8]], 1)
    calls = _recording(tiny_engine)
    assert tiny_engine.teacher_forced([[9], [8]], first) == first
    assert calls == [(2, 1, 1)]


def test_one_different_token_changes_what_follows_not_what_precedes(tiny_engine):
    tokens = tiny_engine.generate_lockstep(PROMPTS, 6)
    changed = [list(t) for t in tokens]
    changed[1][2] = (changed[1][2] + 1) % 256
    got = tiny_engine.teacher_forced(PROMPTS, changed)
    assert got[0] == tokens[0] and got[2] == tokens[2]
    assert got[1][:3] == tokens[1][:3]     # positions up to the change saw the same prefix


@pytest.mark.parametrize("tokens, field", [([[1, 2]] * 2, "tokens"), ([[1], [2], []], "tokens"),
                                           ([[1, 2], [3], [4, 5]], "tokens"),
                                           ([[1], [256], [2]], "tokens"), ([[1], [-1], [2]], "tokens")])
def test_malformed_tokens_are_refused_before_anything_runs(tiny_engine, tokens, field):
    calls = _recording(tiny_engine)
    with pytest.raises(ProtocolError) as err:
        tiny_engine.teacher_forced(PROMPTS, tokens)
    assert err.value.field == field and calls == [] and not tiny_engine.busy


def test_a_failing_forward_leaves_no_slot_held(tiny_engine):
    tokens = tiny_engine.generate_lockstep(PROMPTS, 3)
    inner = tiny_engine.forward

    def forward(tokens_, *args):
        if tokens_.shape[1] == 1:
            raise RuntimeError("decode refused")
        return inner(tokens_, *args)

    tiny_engine.forward = forward
    with pytest.raises(RuntimeError, match="decode refused"):
        tiny_engine.teacher_forced(PROMPTS, tokens)
    assert tiny_engine.kv.active == 0 and tiny_engine.kv.free_slots == 3
    assert not tiny_engine.busy and tiny_engine.load.waiting_seqs == 0


def test_a_busy_engine_is_refused(tiny_engine):
    tiny_engine.submit([1, 2], 2)
    with pytest.raises(ProtocolError, match="idle engine"):
        tiny_engine.teacher_forced([[1]], [[2]])
    with pytest.raises(ProtocolError, match="idle engine"):
        tiny_engine.generate_lockstep([[1]], 1)


def test_padding_of_a_shorter_row_does_not_reach_its_tokens(tiny_engine):
    """A row replayed alone and the same row padded beside a longer one sample the same."""
    tokens = tiny_engine.generate_lockstep(PROMPTS, 5, seed=2)
    alone = tiny_engine.teacher_forced(PROMPTS[1:2], tokens[1:2], seed=3)   # prompt 1: seed 2 + 1
    assert alone == [tokens[1]]
    assert tiny_engine.teacher_forced(PROMPTS, tokens, seed=2) == tokens
