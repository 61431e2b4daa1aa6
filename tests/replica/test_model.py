"""The KV-cache-as-input forward: incremental decode equals a full pass, slots are independent,
the cache is written in place where the docstring says, both layouts load the same module."""

import pytest
import torch

from agent.errors import InvalidCheckpoint
from agent.replica.model import (Transformer, every_position, hf_to_runtime, last_positions,
                                 new_kv_caches, runtime_shapes)
from agent.replica.synthetic import preset_config, synthetic_tensors


@pytest.fixture(scope="module")
def setup():
    config = preset_config("tiny")
    hf = synthetic_tensors(config, seed=1)
    # norms of ones hide a wrong norm wiring; perturb them
    gen = torch.Generator().manual_seed(2)
    hf = {k: (v + 0.1 * torch.randn(v.shape, generator=gen)) if v.dim() == 1 else v * 10
          for k, v in hf.items()}
    return config, hf, Transformer.from_weights(config, hf_to_runtime(hf))


def run(model, tokens, pos, idx, caches, logit_pos=None):
    """The forward's logits at ``logit_pos`` (default: every position, [B, S, V])."""
    if logit_pos is None:
        logit_pos = every_position(*tokens.shape)
    with torch.inference_mode():
        return model(tokens, pos, idx, *caches, logit_pos)


def test_incremental_decode_matches_full_pass(setup):
    config, _, model = setup
    tokens = torch.randint(0, config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    full = run(model, tokens, torch.arange(12)[None], torch.tensor([0]), new_kv_caches(config, 2, 16))
    caches = new_kv_caches(config, 2, 16)
    steps = [run(model, tokens[:, :7], torch.arange(7)[None], torch.tensor([1]), caches)[:, -1]]
    for p in range(7, 12):
        steps.append(run(model, tokens[:, p:p + 1], torch.tensor([[p]]), torch.tensor([1]), caches)[:, -1])
    assert full.shape == (1, 12, config.vocab_size) and full.dtype == torch.float32
    torch.testing.assert_close(torch.cat(steps), full[0, 6:], atol=1e-4, rtol=1e-4)
    assert full[0, -1].std() > 0.1  # a real signal, not a constant


def test_batched_rows_equal_single_rows_and_slots_do_not_leak(setup):
    config, _, model = setup
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, config.vocab_size, (1, 5), generator=g) for _ in range(2))
    caches = new_kv_caches(config, 4, 16)
    # stale garbage in slot 2 from an earlier occupant must not be read
    for c in caches[0] + caches[1]:
        c[2].fill_(50.0)
    both = run(model, torch.cat([a, b]), torch.arange(5).repeat(2, 1), torch.tensor([2, 0]), caches)
    alone_a = run(model, a, torch.arange(5)[None], torch.tensor([0]), new_kv_caches(config, 1, 16))
    alone_b = run(model, b, torch.arange(5)[None], torch.tensor([0]), new_kv_caches(config, 1, 16))
    torch.testing.assert_close(both[0], alone_a[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(both[1], alone_b[0], atol=1e-4, rtol=1e-4)


def test_cache_written_in_place_at_slot_and_position(setup):
    config, _, model = setup
    k, v = new_kv_caches(config, 3, 8)
    run(model, torch.tensor([[5, 6]]), torch.tensor([[3, 4]]), torch.tensor([1]), (k, v))
    for c in k + v:
        assert c.shape == (3, 8, config.num_key_value_heads, config.head_dim)
        written = c.abs().sum(dim=(2, 3))
        assert torch.count_nonzero(written) == 2 and written[1, 3] > 0 and written[1, 4] > 0


def test_hf_layout_loads_through_the_hook(setup):
    config, hf, model = setup
    with torch.device("meta"):
        other = Transformer(config)
    other.load_state_dict(hf, assign=True)
    for name, tensor in model.state_dict().items():
        assert torch.equal(other.state_dict()[name], tensor), name
    assert set(model.state_dict()) == set(runtime_shapes(config))
    assert "output.weight" not in model.state_dict()  # tiny ties embeddings


def test_fused_layout_orders_q_k_v_and_gate_up(setup):
    config, hf, model = setup
    wqkv = model.state_dict()["layers.1.attention.wqkv.weight"]
    assert torch.equal(wqkv[:config.n_q], hf["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(wqkv[config.n_q + config.n_kv:], hf["model.layers.1.self_attn.v_proj.weight"])
    w13 = model.state_dict()["layers.1.feed_forward.w13.weight"]
    assert torch.equal(w13[config.intermediate_size:], hf["model.layers.1.mlp.up_proj.weight"])


def test_from_weights_names_tensor_and_both_shapes(setup):
    config, hf, _ = setup
    bad = dict(hf)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(config.n_kv + 1, config.hidden_size)
    with pytest.raises(InvalidCheckpoint, match=r"layers\.0\.attention\.wqkv\.weight.*\(129, 64\).*\(128, 64\)"):
        Transformer.from_weights(config, bad)


def test_rope_rotates_pairs_half_apart(setup):
    _, _, model = setup
    cos, sin = model.rope_cos_sin(torch.tensor([[0, 1]]))
    assert cos.shape == (1, 2, 1, model.config.head_dim)
    torch.testing.assert_close(cos[0, 0], torch.ones_like(cos[0, 0]))
    # frequency 0 of the first half equals frequency 0 of the second half (rotate-half layout)
    assert cos[0, 1, 0, 0] == cos[0, 1, 0, model.config.head_dim // 2] == torch.cos(torch.tensor(1.0, dtype=torch.float64)).float()


def test_live_context_is_the_longest_position_rounded_up_to_a_block():
    from agent.replica.model import CONTEXT_BLOCK, live_context

    assert CONTEXT_BLOCK == 16
    assert live_context(torch.tensor([[0]]), 64) == 16
    assert live_context(torch.tensor([[3], [15]]), 64) == 16
    assert live_context(torch.tensor([[3], [16]]), 64) == 32
    assert live_context(torch.tensor([[63]]), 64) == 64
    assert live_context(torch.tensor([[5]]), 16) == 16      # one block: the whole slot
    assert live_context(torch.tensor([[5]]), 40) == 40      # not a multiple of the block


def test_attention_over_the_live_context_equals_attention_over_the_whole_slot(setup, monkeypatch):
    """A batched decode step of sequences at different positions reads [0, L) of each slot;
    the logits and the cache it leaves are those of reading all T positions (the masked tail,
    here stale garbage from an earlier occupant, contributes nothing either way)."""
    from agent.replica import model as model_mod

    config, _, model = setup
    g = torch.Generator().manual_seed(5)
    t, lens = 64, (3, 20, 37)
    caches = new_kv_caches(config, 4, t)
    for c in caches[0] + caches[1]:
        c.normal_(generator=g)                       # every position holds something
    slots = torch.tensor([2, 0, 3])
    tokens = torch.randint(0, config.vocab_size, (3, 1), generator=g)
    pos = torch.tensor([[n] for n in lens])
    whole = ([c.clone() for c in caches[0]], [c.clone() for c in caches[1]])
    live = run(model, tokens, pos, slots, caches)
    monkeypatch.setattr(model_mod, "live_context", lambda input_pos, max_seq_len: max_seq_len)
    full = run(model, tokens, pos, slots, whole)
    torch.testing.assert_close(live, full, atol=1e-5, rtol=1e-5)
    for a, b in zip(caches[0] + caches[1], whole[0] + whole[1], strict=True):
        assert torch.equal(a, b)


def test_compiled_rope_tables_equal_eager_bit_for_bit():
    """The package computes cos/sin with Inductor's vectorised math, eager with ATen's; in
    float32 they differ by one ulp in most entries, which bfloat16 rounding turns into
    different prefill logits.  Computed in float64 and rounded, they agree exactly."""
    from agent.replica.config import LlamaConfig

    config = LlamaConfig(hidden_size=576, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=16,
                         max_position_embeddings=1024, rope_theta=100000.0)
    with torch.device("meta"):
        shell = Transformer(config)
    pos = torch.arange(512).view(2, 256)

    def tables(p):
        return Transformer.rope_cos_sin(shell, p)

    eager, compiled = tables(pos), torch.compile(tables, dynamic=False)(pos)
    assert eager[0].dtype == torch.float32 and eager[0].shape == (2, 256, 1, 64)
    for a, b in zip(eager, compiled, strict=True):
        assert torch.equal(a, b)


def test_position_helpers_ask_for_each_rows_last_token_or_every_position():
    assert last_positions([3, 1, 5]).tolist() == [[2], [0], [4]]
    assert last_positions([3]).dtype == torch.int64
    every = every_position(2, 3)
    assert every.tolist() == [[0, 1, 2], [0, 1, 2]] and every.is_contiguous()


def test_logits_come_only_from_the_positions_asked_for(setup):
    """``logit_pos`` [B, K] picks the rows of the every-position logits: the last real token
    of padded rows (K = 1, as a prefill call asks), any positions in any order with repeats
    (K > S too); the cache is written the same whatever K."""
    config, _, model = setup
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (3, 6), generator=g)
    pos, idx = torch.arange(6).repeat(3, 1), torch.tensor([2, 0, 1])
    caches = new_kv_caches(config, 3, 16)
    full = run(model, tokens, pos, idx, caches)                                # [3, 6, V]
    for logit_pos in (last_positions([6, 2, 4]), torch.tensor([[5, 0, 5, 1, 3, 2, 4, 4]] * 3),
                      torch.tensor([[1, 0], [5, 5], [3, 2]])):
        others = new_kv_caches(config, 3, 16)
        got = run(model, tokens, pos, idx, others, logit_pos)
        assert got.shape == (3, logit_pos.shape[1], config.vocab_size)
        assert got.dtype == torch.float32
        want = torch.stack([full[b, logit_pos[b]] for b in range(3)])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for a, b in zip(caches[0] + caches[1], others[0] + others[1], strict=True):
            assert torch.equal(a, b)


def test_every_position_in_order_gives_the_heads_own_bits(setup):
    """At K = S in order the norm and the LM head see the very rows of the last layer: the
    logits are bitwise what the head gives on all of them (the golden record's replay asks
    for this, agent/replica/lockstep.py)."""
    config, _, model = setup
    tokens = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(8))
    pos, idx = torch.arange(9).repeat(2, 1), torch.tensor([0, 1])
    got = run(model, tokens, pos, idx, new_kv_caches(config, 2, 16))
    k, v = new_kv_caches(config, 2, 16)
    with torch.inference_mode():
        cos, sin = model.rope_cos_sin(pos)
        mask = model.causal_mask(pos, 16)
        h = model.embed(tokens)
        for layer, kc, vc in zip(model.layers, k, v, strict=True):
            h = layer(h, cos, sin, pos, idx, kc, vc, mask)
        want = model.head(h)
    assert torch.equal(got, want)


def test_a_logit_position_outside_the_call_is_refused_by_eager(setup):
    config, _, model = setup
    tokens = torch.tensor([[1, 2, 3]])
    for bad in (torch.tensor([[3]]), torch.tensor([[-1]])):
        with pytest.raises(RuntimeError, match="index"):
            run(model, tokens, torch.arange(3)[None], torch.tensor([0]),
                new_kv_caches(config, 1, 16), bad)
