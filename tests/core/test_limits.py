"""agent/limits.py: the soft descriptor limit is raised to the hard one, in a subprocess
started under a low soft limit (the test process's own limits are left alone)."""

import json
import resource
import subprocess
import sys

CHILD = r"""
import json, logging, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from agent.limits import raise_nofile
limit = raise_nofile("test")
print(json.dumps({"soft": limit.soft, "hard": limit.hard, "before": limit.before,
                  "raised": limit.raised,
                  "now": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}))
"""


def _run(soft: int, hard: int):
    def pre():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                       preexec_fn=pre, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout), p.stderr


def test_soft_raised_to_hard_and_logged():
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard = min(hard, 4096)
    out, err = _run(64, hard)
    assert out == {"soft": hard, "hard": hard, "before": 64, "raised": True, "now": hard}
    assert f"RLIMIT_NOFILE soft={hard} hard={hard} (raised from 64)" in err


def test_already_at_hard_is_left_and_still_logged():
    out, err = _run(128, 128)
    assert out == {"soft": 128, "hard": 128, "before": 128, "raised": False, "now": 128}
    assert "RLIMIT_NOFILE soft=128 hard=128" in err and "raised" not in err
