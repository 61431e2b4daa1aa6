"""The command line: building the parser (every ``--help``) imports no torch; a typed error
is one line on stderr and exit status 2, never a traceback."""

import pytest

from agent import exitcodes
import subprocess
import sys


def test_building_the_parser_imports_no_torch():
    code = ("import sys; from agent.cli import build_parser; p = build_parser(); "
            "names = sorted(p._subparsers._group_actions[0].choices); "
            "print(','.join(names)); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert {"up", "build", "replica", "snapshot"} <= set(out[0].split(","))
    assert out[1] == "False"


def test_a_typed_error_is_one_line_and_exit_2(tmp_path, capsys):
    from agent.cli import main

    assert main(["snapshot", "verify", str(tmp_path / "nope")]) == exitcodes.EX_NOINPUT
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope" in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_an_unknown_flag_is_reported_by_the_subcommand_it_was_given_to(capsys):
    from agent.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["agent", "status", "--bogus"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.startswith("usage: rewarm agent status")
    assert "unrecognized arguments: --bogus (see rewarm agent status --help)" in err
