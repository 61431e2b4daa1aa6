"""Trace loading (Azure LLM 2023 CSV format), its limits, scaling and mixing."""

import numpy as np
import pytest

from agent.errors import InvalidTrace
from agent.sim import trace as tr
from agent.sim.trace import TokenTiming, load_trace, mix, poisson_arrivals, time_scale

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:04.0000000,4000,30
2023-11-16 18:17:03.5000000,800,60
2023-11-16 18:17:05.2500000,0,0
"""


def write(tmp_path, text, name="t.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_load_sorts_and_times(tmp_path):
    w = load_trace(write(tmp_path, CSV), timing=TokenTiming(4000.0, 30.0))
    np.testing.assert_allclose(w.arrival_s, [0.0, 0.5, 1.75])
    np.testing.assert_array_equal(w.need_tokens, [860, 4030, 0])
    np.testing.assert_allclose(w.prefill_s, [0.2, 1.0, 0.0])
    np.testing.assert_allclose(w.occupancy_s, [0.2 + 2.0, 1.0 + 1.0, 0.0])
    assert len(w) == 3 and w.duration_s == 1.75


def test_offered_concurrency_by_hand(tmp_path):
    w = load_trace(write(tmp_path, CSV), timing=TokenTiming(4000.0, 30.0))
    # in flight: r0 [0, 2.2), r1 [0.5, 2.5), r2 zero length at 1.75
    np.testing.assert_array_equal(w.offered_concurrency(np.array([0.0, 0.6, 1.75, 2.3, 3.0])),
                                  [1, 2, 2, 1, 0])


def test_row_limit_at_and_over(tmp_path):
    p = write(tmp_path, CSV)
    assert len(load_trace(p, max_rows=3)) == 3
    with pytest.raises(InvalidTrace) as e:
        load_trace(p, max_rows=2)
    assert e.value.field == "rows" and e.value.limit == 2 and e.value.line == 4


def test_byte_limit_at_and_over(tmp_path):
    p = write(tmp_path, CSV)
    size = p.stat().st_size
    assert len(load_trace(p, max_bytes=size)) == 3
    with pytest.raises(InvalidTrace) as e:
        load_trace(p, max_bytes=size - 1)
    assert e.value.value == size and e.value.limit == size - 1


def test_token_limit_at_and_over(tmp_path):
    top = tr.MAX_TOKENS_PER_REQUEST
    ok = write(tmp_path, f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00.0,{top},1\n")
    assert load_trace(ok).need_tokens[0] == top + 1
    bad = write(tmp_path, f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00.0,1,{top + 1}\n",
                "b.csv")
    with pytest.raises(InvalidTrace) as e:
        load_trace(bad)
    assert e.value.field == "GeneratedTokens" and e.value.value == top + 1 and e.value.line == 2


@pytest.mark.parametrize("text,field", [
    ("a,b,c\n", "header"),
    ("", "header"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "rows"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00.0,12\n", "row"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00.0,x,1\n", "ContextTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 00:00:00.0,-1,1\n", "ContextTokens"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n", "TIMESTAMP"),
])
def test_malformed(tmp_path, text, field):
    with pytest.raises(InvalidTrace) as e:
        load_trace(write(tmp_path, text))
    assert e.value.field == field


def test_time_scale_and_mix(tmp_path):
    w = load_trace(write(tmp_path, CSV))
    fast = time_scale(w, 2.0)
    np.testing.assert_allclose(fast.arrival_s, [0.0, 0.25, 0.875])
    np.testing.assert_array_equal(fast.occupancy_s, w.occupancy_s)
    with pytest.raises(InvalidTrace):
        time_scale(w, 0.0)
    bg = tr.background(10.0, 5.0, occupancy_s=1.0, prefill_s=0.1, need_tokens=7,
                       rng=np.random.default_rng(0))
    both = mix(w, bg)
    assert len(both) == len(w) + len(bg)
    assert np.all(np.diff(both.arrival_s) >= 0)
    assert int((both.tenant == 1).sum()) == len(bg)


def test_poisson_arrivals_rate():
    a = poisson_arrivals(np.full(1000, 50.0), step_s=1.0, rng=np.random.default_rng(3))
    assert abs(len(a) - 50_000) < 1000          # 4.5 sigma
    assert np.all(np.diff(a) >= 0) and a[0] >= 0 and a[-1] < 1000


def test_a_missing_trace_is_invalid_trace_naming_the_path(tmp_path):
    from agent.errors import InvalidTrace
    from agent.sim.trace import load_trace

    with pytest.raises(InvalidTrace) as err:
        load_trace(tmp_path / "nope.csv")
    assert err.value.field == "path" and "nope.csv" in str(err.value)
