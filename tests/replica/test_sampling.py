"""Batched sampling picks per row what one-row sampling picks."""

import torch

from agent.replica.sampling import GREEDY, Sampling, make_sampler, sample, sample_rows


def _samplers(specs):
    return [make_sampler(seed, sampling, default_temperature=1.0, default_top_k=None,
                         vocab_size=50) for seed, sampling in specs]


def test_greedy_rows_take_the_argmax_of_their_own_row():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    samplers = _samplers([(None, GREEDY)] * 6)
    assert sample_rows(samplers, logits) == logits.argmax(dim=-1).tolist()
    assert sample_rows(samplers, logits) == [sample(s, row) for s, row in zip(samplers, logits, strict=True)]


def test_mixed_rows_equal_one_row_at_a_time_with_the_same_seeds():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 3
    specs = [(None, GREEDY), (7, Sampling(temperature=0.8)), (None, GREEDY),
             (9, Sampling(temperature=1.2, top_k=5, top_p=0.9))]
    batched = sample_rows(_samplers(specs), logits)
    alone = [sample(s, row) for s, row in zip(_samplers(specs), logits, strict=True)]
    assert batched == alone
    assert batched[0] == int(logits[0].argmax()) and batched[2] == int(logits[2].argmax())


def test_sampled_positions_draw_what_one_call_per_position_draws():
    from agent.replica.sampling import sample_positions

    logits = torch.randn(3, 8, 50, generator=torch.Generator().manual_seed(2)) * 2
    specs = [(11, Sampling()), (None, GREEDY), (13, Sampling(temperature=0.7, top_k=9, top_p=0.8))]
    batched = sample_positions(_samplers(specs), logits)
    samplers = _samplers(specs)
    alone = [[sample(s, logits[b, k]) for k in range(8)] for b, s in enumerate(samplers)]
    assert batched == alone
    assert batched[1] == logits[1].argmax(dim=-1).tolist()
    assert sample_positions([], logits[:0]) == []


def test_a_rows_probabilities_are_the_same_bits_alone_or_batched():
    from agent.replica.sampling import _probs

    sampler = _samplers([(5, Sampling())])[0]
    logits = torch.randn(24, 49152, generator=torch.Generator().manual_seed(3)) * 4
    batched = _probs(sampler, logits)
    for k in range(24):
        assert torch.equal(batched[k], _probs(sampler, logits[k])), k
