"""The engine's step under a prefill budget (agent/replica/engine.py): oldest first within the
budget, short prompts sharing a call, a running stream decoding every step, the first token
when a prompt's last chunk runs, cancels and failures mid-prefill freeing the slot, the
floor, and the same tokens as whole-prompt prefill."""

import pytest

from agent.errors import ConfigError
from agent.replica.config import LlamaConfig
from agent.replica.engine import Engine
from agent.replica.speedmeter import SpeedMeter
from agent.replica.weights import load_hf_weights
from agent.speed import SpeedProfile

# 1000 prompt tokens/s, 2 ms a call (2 tokens), 10 ms a decode step (+1 ms a sequence)
FIX = SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.002, decode_base_s=0.01,
                   decode_per_seq_s=0.001, decode_per_ctx_token_s=0.0)
TARGET_S = 0.042    # a step's budget: 40 tokens alone, 30 beside one running sequence


def make_engine(tiny_dir, itl_target_s=TARGET_S, profile=FIX, **kw):
    """The tiny model (eager) whose meter holds ``profile`` fixed, and no step overrun (the
    wall time of the steps on a shared machine would shrink the budgets); ``calls`` logs each
    prefill call's real row lengths (agent/speed.py ``plan_prefill_call``'s answer)."""
    config = LlamaConfig.from_dir(tiny_dir)
    meter = SpeedMeter(profile, measured_prior=True)
    meter.observe_prefill = meter.observe_decode = lambda *a: None  # type: ignore[method-assign]
    meter.observe_step = lambda *a: None  # type: ignore[method-assign]
    kw = {"max_seqs": 3, "max_seq_len": 96, **kw}
    engine = Engine(config, load_hf_weights(tiny_dir, config), meter=meter,
                    itl_target_s=itl_target_s, **kw)
    engine.calls = []
    run = engine._run_chunks

    def logged(group, rows, width):
        engine.calls.append(list(rows))
        return run(group, rows, width)
    engine._run_chunks = logged
    return engine


def prompt(n, salt=0):
    return [(11 * i + 3 + salt) % 250 + 1 for i in range(n)]


def test_a_step_runs_the_oldest_first_within_its_budget_and_short_prompts_share_a_call(tiny_dir):
    engine = make_engine(tiny_dir)
    a = engine.submit(prompt(60), 3)
    b = engine.submit(prompt(8, 1), 3)
    c = engine.submit(prompt(8, 2), 3)
    assert engine.begin_step() == 40
    assert engine.step() == [] and engine.calls == [[40]]      # A cut at the budget, alone
    assert engine.kv.active == 1 and engine.load.queued_prefill_tokens == 20 + 8 + 8
    events = engine.step()
    # A's last 20 alone (B would pad it by 12 > one call's 2 tokens); a further call pays
    # 2 tokens of overhead and B and C share it; then the decode of all three
    assert engine.calls[1:] == [[20], [8, 8]]
    assert [(e.seq_id, e.done) for e in events] == [(a, False), (b, False), (c, False),
                                                     (a, False), (b, False), (c, False)]
    assert engine.load.waiting_seqs == 0 and engine.load.active_seqs == 3


def test_a_running_stream_gets_a_token_every_step_while_a_long_prompt_prefills(tiny_dir):
    engine = make_engine(tiny_dir)
    running = engine.submit(prompt(4), 20)
    engine.step()
    long = engine.submit(prompt(70, 5), 2)
    per_step: list[list[int]] = []
    while long not in sum(per_step, []) and len(per_step) < 10:
        per_step.append([e.seq_id for e in engine.step()])
    # beside one running sequence a step holds (0.042 - 0.01 - 0.002) * 1000 = 30 tokens
    assert engine.calls[1:] == [[30], [30], [10]]
    assert per_step == [[running], [running], [long, running, long]]


def test_chunked_prefill_gives_the_tokens_of_whole_prompts(tiny_dir):
    """Cut at odd places, shared and padded calls: the same greedy and seeded tokens."""
    prompts = [prompt(37), prompt(5, 1), prompt(6, 2), prompt(61, 3), prompt(4, 4)]
    chunked = make_engine(tiny_dir, max_seqs=3)
    whole = make_engine(tiny_dir, itl_target_s=0.0, max_seqs=3)
    for seed in (None, 7):
        assert chunked.generate(prompts, 6, seed=seed) == whole.generate(prompts, 6, seed=seed)
    assert any(len(set(rows)) > 1 for rows in chunked.calls)   # a padded shared call ran
    assert any(rows[0] < n for rows, n in zip(chunked.calls, [37, 61], strict=False))
    assert all(len(rows) == 1 for rows in whole.calls)           # whole prompts: alone


def test_without_a_budget_each_prompt_is_prefilled_whole_and_alone(tiny_dir):
    engine = make_engine(tiny_dir, itl_target_s=0.0, prefill_chunk=32)
    ids = [engine.submit(prompt(70), 2), engine.submit(prompt(8, 1), 2)]
    assert engine.begin_step() is None
    events = engine.step()
    assert engine.calls == [[32], [32], [6], [8]]                # in chunks of prefill_chunk
    assert [e.seq_id for e in events] == ids + ids


def test_a_prompt_longer_than_a_call_and_than_the_budget(tiny_dir):
    engine = make_engine(tiny_dir, prefill_chunk=16)
    seq = engine.submit(prompt(50), 2)
    assert engine.step() == []
    # 16 (the longest row), then 24 - 2 = 22 for a further call: 16 again; 6 - 2 < 16: over
    assert engine.calls == [[16], [16]]
    events = engine.step()
    assert engine.calls[2:] == [[16], [2]]
    assert [(e.seq_id, e.done) for e in events] == [(seq, False), (seq, True)]


def test_cancel_mid_prefill_frees_the_slot(tiny_dir):
    engine = make_engine(tiny_dir)
    a = engine.submit(prompt(60), 3)
    engine.step()
    assert engine.kv.active == 1 and engine.load.waiting_seqs == 1
    engine.cancel(a)
    assert engine.kv.active == 0 and not engine.busy
    assert (engine.load.waiting_seqs, engine.load.queued_prefill_tokens) == (0, 0)


def test_a_failed_call_frees_its_sequences_slots_and_leaves_the_others(tiny_dir):
    engine = make_engine(tiny_dir)
    inner, calls = engine.forward, []

    def failing(tokens, *rest):        # the second prefill call raises
        calls.append(tuple(tokens.shape))
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return inner(tokens, *rest)
    engine.forward = failing
    a = engine.submit(prompt(60), 3)
    engine.step()                      # [1, 40]: A holds its slot, part-way
    b = engine.submit(prompt(50, 1), 3)
    with pytest.raises(RuntimeError, match="illegal memory"):
        engine.step()                  # A's last 20: raises
    assert engine.kv.active == 0       # A's slot freed, A dropped
    assert [s.seq_id for s in engine._waiting] == [b] and engine.load.waiting_seqs == 1
    engine.cancel(a)                   # what the replica's loop does next: a no-op here
    out = []
    while engine.busy:
        out += [e.token for e in engine.step() if e.seq_id == b]
    assert len(out) == 3 and engine.kv.active == 0


def test_the_floor_keeps_prefill_moving_when_the_decode_fills_the_target(tiny_dir):
    slow = SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.002,
                        decode_base_s=0.1, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0)
    engine = make_engine(tiny_dir, profile=slow)
    engine.submit(prompt(4), 30)
    engine.step()
    engine.submit(prompt(40, 1), 2)
    for _ in range(3):
        assert engine.begin_step() == 16   # a decode of 0.1 s over a 0.042 s target
        engine.step()
    assert engine.calls[1:] == [[16], [16], [8]]


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "0.2"])
def test_an_itl_target_that_is_not_a_finite_number_ge_0_is_refused(tiny_dir, bad):
    with pytest.raises(ConfigError) as err:
        make_engine(tiny_dir, itl_target_s=bad)
    assert err.value.name == "itl_target_s" and err.value.limit == 0
    engine = make_engine(tiny_dir)
    with pytest.raises(ConfigError):
        engine.itl_target_s = bad
    assert engine.itl_target_s == TARGET_S


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_a_prefill_chunk_below_one_token_is_refused(tiny_dir, bad):
    # a call of no tokens advances no prompt: whole-prompt prefill would loop for ever
    with pytest.raises(ConfigError) as err:
        make_engine(tiny_dir, prefill_chunk=bad)
    assert err.value.name == "prefill_chunk" and err.value.limit == 1

def test_an_itl_target_up_to_the_report_limit_serves_and_past_it_is_refused(tiny_dir):
    """The target travels in the load report, whose limit is MAX_PROFILE_S: at it the step's
    budget is every prompt whole (the product with a fast meter's rate stays finite); just
    past it the engine refuses the target, naming it and the limit (a target of 1e306 s made
    the budget int(inf): every step raised OverflowError and the replica was taken as
    broken)."""
    from agent.speed import MAX_PREFILL_TOKENS_PER_S, MAX_PROFILE_S

    fast = SpeedProfile(prefill_tokens_per_s=MAX_PREFILL_TOKENS_PER_S, prefill_overhead_s=0.0,
                        decode_base_s=0.01, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0)
    engine = make_engine(tiny_dir, itl_target_s=MAX_PROFILE_S, profile=fast)
    engine.submit(prompt(60), 2)
    events = engine.step()
    assert engine.calls == [[60]] and len(events) == 2
    for over in (MAX_PROFILE_S * 1.0001, 1e306):
        with pytest.raises(ConfigError) as err:
            engine.itl_target_s = over
        assert (err.value.name, err.value.value, err.value.limit) == \
            ("itl_target_s", over, MAX_PROFILE_S)
    assert engine.itl_target_s == MAX_PROFILE_S


def test_steps_that_overran_their_plan_shrink_the_next_budgets(tiny_dir):
    """The meter keeps each prefill step's overrun of its plan (the loop's own time, noise);
    the engine plans by its ITL target less their p99, by at most a quarter of the target,
    and a decode-only step is not counted."""
    engine = make_engine(tiny_dir)
    del engine.meter.observe_step      # the meter's own: these steps give their wall times

    def run_step(overrun_s):           # as the replica's loop does, with a wall time
        engine.begin_step()
        while engine.can_prefill:
            engine.prefill()
        engine.decode()
        engine.end_step(engine._step_plan_s + overrun_s)
    assert engine.profile().itl_target_s == TARGET_S and engine.begin_step() == 40
    engine.submit(prompt(60), 30)
    run_step(0.018)                    # [1, 40]: planned 42 ms
    assert engine._step_plan_s == pytest.approx(0.042)
    run_step(0.004)                    # [1, 20] and a decode: planned 22 + 10 ms
    assert engine._step_plan_s == pytest.approx(0.032)
    assert engine.meter.step_overrun_s() == pytest.approx(0.004)    # the second largest
    engine.begin_step()
    engine.decode()
    engine.end_step(5.0)               # no prefill call: no sample
    assert engine.meter.step_overrun_s() == pytest.approx(0.004)
    engine.meter.observe_step(0.04, 0.048)
    engine.meter.observe_step(0.04, 0.048)          # 8 ms over, twice
    assert engine.profile().itl_target_s == pytest.approx(TARGET_S - 0.008)
    assert engine.begin_step() == int(((TARGET_S - 0.008) - 0.01 - 0.002) * 1000.0)
    engine.meter.observe_step(0.04, 1.0)
    engine.meter.observe_step(0.04, 1.0)
    assert engine.profile().itl_target_s == pytest.approx(0.75 * TARGET_S)   # the floor


def test_each_call_asks_only_for_its_rows_last_chunk_token(tiny_dir):
    """A shared call padded to its longest row asks for one position per row, the last of
    the row's own chunk (K = 1: never the padding's); a decode step for its one token."""
    engine = make_engine(tiny_dir)
    inner, asked = engine.forward, []

    def recording(tokens, input_pos, idx, k, v, logit_pos):
        asked.append((tuple(tokens.shape), logit_pos.tolist()))
        return inner(tokens, input_pos, idx, k, v, logit_pos)
    engine.forward = recording
    engine.submit(prompt(60), 2)
    engine.submit(prompt(8, 1), 2)
    engine.submit(prompt(7, 2), 2)
    engine.step()                      # A's first 40 alone
    engine.step()                      # A's last 20; B and C share [2, 8]; a decode of all
    assert asked[0] == ((1, 40), [[39]])
    assert asked[1:] == [((1, 20), [[19]]), ((2, 8), [[7], [6]]), ((3, 1), [[0], [0], [0]])]
