"""The command line's argparse types: each limit at and just past its value."""

from agent import exitcodes
import argparse

import pytest

from agent.argtypes import (deadline_factor, host_port, listen_address, nonneg_int, port,
                            positive_float, positive_int)


@pytest.mark.parametrize("fn, good, bad", [
    (positive_int, ["1", "64"], ["0", "-3", "1.5", "x"]),
    (nonneg_int, ["0", "7"], ["-1", "nan"]),
    (positive_float, ["0.001", "3"], ["0", "-1", "nan", "inf", "x"]),
    (deadline_factor, ["1", "1.0", "3"], ["0.999", "0", "nan", "x"]),
    (port, ["0", "65535"], ["65536", "99999", "-1", "p"]),
    (host_port, ["127.0.0.1:0", "[::1]:7400", "h:65535"], ["127.0.0.1", ":80", "h:65536", "h:x"]),
    (listen_address, ["unix:/tmp/a.sock", "0.0.0.0:1"], ["unix:", "garbage", "h:99999"]),
])
def test_limits_at_and_past_their_values(fn, good, bad):
    for text in good:
        assert str(fn(text)) == text or fn(text) == type(fn(text))(text)
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError) as err:
            fn(text)
        assert text in str(err.value) or "unix:" in str(err.value)


def test_a_bad_value_is_a_usage_error_not_a_traceback(capsys):
    from agent.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["replica", "--listen", "h:99999", "--zygote"])
    assert exit_.value.code == 2
    assert "99999" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["frontdoor", "--port", "99999"], "99999"),
    (["frontdoor", "--max-connections", "0"], "0 is below the limit 1"),
    (["predictor", "--tick-s", "0"], "must be > 0"),
    (["frontdoor", "--deadline-factor", "0.5"], "0.5 is below the limit 1"),
    (["simulate", "--trace", "t.csv", "--deadline-factor", "0.5"], "0.5 is below the limit 1"),
    (["agent", "run", "--state-dir", "s", "--model-dir", "m", "--listen", "h:70000"], "70000"),
    (["snapshot", "verify", "p", "--threads", "0"], "below the limit 1"),
    (["generate", "--model", "m", "--max-tokens", "-1", "hi"], "-1"),
    (["generate", "--model", "m", "--tokens", "1," + "9" * 23], "outside 0..2147483647"),
    (["generate", "--model", "m", "--seed", str(1 << 64), "hi"], "signed 64-bit"),
    (["generate", "--model", "m", "--max-tokens", str(1 << 70), "hi"], "above the limit"),
])
def test_every_component_cli_checks_its_numbers(argv, says, capsys):
    from agent.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_a_front_door_model_deadline_that_is_not_a_number_is_one_error_line(capsys):
    from agent.cli import main

    assert main(["frontdoor", "--model", "m=abc"]) == exitcodes.EX_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("error: --model 'm=abc'") and "Traceback" not in err
