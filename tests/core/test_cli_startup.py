"""The command line's parser is cheap: building it (every ``--help``) imports no torch."""

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
