"""The repository is documentation and code for its users as it is: no development history
(issue numbers, contract points, runs, sessions or engineers) in code, comments or docs. A
comment that depends on a contract writes it out or cites docs/architecture.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HISTORY = re.compile(
    r"\b[Ii]ssue \d+|\bcontract (?:point|item) \d|\brun [A-D]\b|\bengineers?\b"
    r"|\b(?:this|last|previous|next) session\b|\bthe lead's\b")
TEXT = (".py", ".pyx", ".h", ".md", ".sh", ".hcl", ".service", ".toml", ".cfg", ".example",
        ".json")


def test_no_development_history_in_tracked_files():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    found = []
    for name in files:
        path = REPO / name
        if name.startswith("tests/docs/") or not name.endswith(TEXT + ("Makefile",)) \
                or not path.exists():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = HISTORY.search(line)
            if m:
                found.append(f"{name}:{n}: {m.group(0)!r} in {line.strip()[:100]}")
    assert not found, "\n".join(found)


def test_the_pattern_catches_history_and_spares_field_terms():
    for text in ("as issue 12 says", "contract point 3", "run A and run B", "the engineer",
                 "this session's code", "the lead's rerun"):
        assert HISTORY.search(text), text
    for text in ("the lead time (restore p99 + decision latency)", "longer than the lead",
                 "a Consul session lock",
                 "run a replica", "the session's TTL"):
        assert not HISTORY.search(text), text
