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


def test_a_missing_trace_exits_66_and_a_malformed_one_65(tmp_path, capsys):
    """The README's exit statuses: 66 for an input named on the command line that does not
    exist, 65 for bad input data (a missing trace exited 65)."""
    from agent import exitcodes
    from agent.cli import main
    from agent.errors import TraceNotFound

    with pytest.raises(TraceNotFound):
        load_trace(tmp_path / "nope.csv")
    assert main(["simulate", "--trace", str(tmp_path / "nope.csv")]) == exitcodes.EX_NOINPUT
    assert "nope.csv" in capsys.readouterr().err
    bad = write(tmp_path, "TIMESTAMP,ContextTokens,GeneratedTokens\nnot a time,1,1\n")
    assert main(["simulate", "--trace", str(bad)]) == exitcodes.EX_DATAERR


# --- bad input: one InvalidTrace naming the file and the row ------------------------------

HEAD = b"TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = b"2023-11-16 18:17:04.0000000,40,3\n"


def write_bytes(tmp_path, data, name="b.csv"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_a_non_utf8_byte_names_its_line(tmp_path):
    p = write_bytes(tmp_path, HEAD + ROW + b"2023-11-16 18:17:05.0\xff,40,3\n")
    with pytest.raises(InvalidTrace) as e:
        load_trace(p)
    assert e.value.line == 3 and e.value.field == "encoding" and e.value.value == 0xFF
    assert str(p) in str(e.value) and "line 3" in str(e.value)


@pytest.mark.parametrize("stamp", [b"NaT", b"nat", b"2023-13-45 99:00:00", b"yesterday",
                                   b"2023-11-16 18:17:05.0000000x"])
def test_a_bad_timestamp_names_its_line(tmp_path, stamp):
    p = write_bytes(tmp_path, HEAD + ROW + ROW + stamp + b",40,3\n" + ROW)
    with pytest.raises(InvalidTrace) as e:
        load_trace(p)
    assert e.value.line == 4 and e.value.field == "TIMESTAMP"
    assert e.value.value == stamp.decode() and "line 4" in str(e.value)


def test_blank_last_lines_are_accepted(tmp_path):
    for tail in (b"\n", b"\n\n", b"\r\n", b"  \n"):
        rows = tr.read_trace(write_bytes(tmp_path, HEAD + ROW + ROW + tail))
        assert len(rows) == 2
        np.testing.assert_array_equal(rows.line, [2, 3])


def test_a_blank_line_between_rows_names_it(tmp_path):
    with pytest.raises(InvalidTrace) as e:
        load_trace(write_bytes(tmp_path, HEAD + ROW + b"\n" + ROW))
    assert e.value.line == 3 and e.value.field == "row"


def test_a_utf8_bom_header_is_accepted(tmp_path):
    assert len(tr.read_trace(write_bytes(tmp_path, b"\xef\xbb\xbf" + HEAD + ROW))) == 1


def test_an_unterminated_quote_is_invalid_trace(tmp_path):
    with pytest.raises(InvalidTrace) as e:
        load_trace(write_bytes(tmp_path, HEAD + ROW + b'"2023-11-16,1,1\n'))
    assert e.value.path == tmp_path / "b.csv"


def test_a_directory_is_invalid_trace(tmp_path):
    with pytest.raises(InvalidTrace) as e:
        load_trace(tmp_path)
    assert e.value.field == "path"


def test_read_trace_keeps_tokens_and_lines_sorted_and_windows(tmp_path):
    rows = tr.read_trace(write(tmp_path, CSV))
    np.testing.assert_allclose(rows.arrival_s, [0.0, 0.5, 1.75])
    np.testing.assert_array_equal(rows.context_tokens, [800, 4000, 0])
    np.testing.assert_array_equal(rows.generated_tokens, [60, 30, 0])
    np.testing.assert_array_equal(rows.line, [3, 2, 4])
    win = rows.window(0.25, 1.0)
    np.testing.assert_allclose(win.arrival_s, [0.25])
    np.testing.assert_array_equal(win.context_tokens, [4000])


def test_background_rps_inf_is_a_usage_error(capsys):
    from agent.cli import main

    with pytest.raises(SystemExit) as e:
        main(["simulate", "--trace", "x.csv", "--background-rps", "inf"])
    assert e.value.code == 2
    assert "'inf' is not a finite number" in capsys.readouterr().err
