"""Stop strings over text fed in pieces: spanning pieces, held tails, nothing past a stop."""

import pytest

from agent.replica.stops import StopText


def _run(stops, pieces):
    st = StopText(stops)
    out = [st.feed(p) for p in pieces]
    return out, st


def test_a_stop_string_spanning_pieces_is_found_and_never_sent():
    out, st = _run(["END"], ["Hello ", "E", "N", "D and more", " even more"])
    assert "".join(out) == "Hello " and st.stopped
    assert out == ["Hello ", "", "", "", ""]      # "E", "EN" were held, then dropped
    assert st.flush() == ""


def test_a_held_prefix_that_does_not_complete_is_let_out():
    out, st = _run(["END"], ["a E", "Nx", "b"])
    assert out == ["a ", "ENx", "b"] and not st.stopped
    out, st = _run(["\n\n"], ["line\n", "next\n"])
    assert out == ["line", "\nnext"] and st.flush() == "\n"


def test_the_earliest_of_several_stops_wins_and_overlaps_work():
    out, st = _run(["world", "lo w"], ["hel", "lo wor", "ld"])
    assert "".join(out) == "hel" and st.stopped
    out, st = _run(["abab"], ["ab", "a", "bab"])         # "ababab": the first at 0
    assert "".join(out) == "" and st.stopped
    out, st = _run(["aab"], ["a", "a", "a", "b"])         # held "aa" slides to the last two
    assert "".join(out) == "a" and st.stopped


@pytest.mark.parametrize("split", range(1, 12))
def test_any_split_of_the_text_gives_the_same_output(split):
    text = "one two\n\nthree"
    out, _ = _run(["\n\n"], [text[:split], text[split:]])
    assert "".join(out) == "one two"


def test_no_stops_passes_everything_and_empty_stops_are_ignored():
    out, st = _run(["", ""], ["a", "b"])
    assert out == ["a", "b"] and st.flush() == "" and st.stops == ()
