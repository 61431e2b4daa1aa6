"""bench/engine_compare.py's parent side: engine children asked for figures in alternating rounds.

Each engine runs in a child process (``engine_compare.py --child NAME``) that loads its
engine, prints ``FIRST`` after its first token and ``READY {...}`` once warm, then answers
one ``RESULT {...}`` line per figure name read from stdin (``ttft:N``, ``decode:C``,
``mem``).  :func:`compare` asks every live child for every figure in turn, round after round,
rotating the engine order, and keeps each figure's best round (:func:`best_of`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "engine_compare.py"
CONCURRENCY = (1, 4, 8)

FIGURES = ("ttft:32", "ttft:512", *(f"decode:{c}" for c in CONCURRENCY))


class Child:
    """One engine's child process: started, then asked for figures one line at a time.
    Every wait is bounded by ``timeout_s`` (the child is killed past it)."""

    def __init__(self, python: str, name: str, argv: list[str], timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.lines: queue.Queue[str | None] = queue.Queue()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [python, str(SCRIPT), "--child", name, *argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict = {}
        first = self._expect(("FIRST", "RESULT "))
        if first is not None and first.startswith("FIRST"):
            self.info["start_to_first_token_s"] = round(time.perf_counter() - t0, 2)
            ready = self._expect(("READY ",))
            if ready is not None:
                self.info.update(json.loads(ready[len("READY "):]))
        elif first is not None:                    # a one-shot child (golden)
            self.info.update(json.loads(first[len("RESULT "):]))

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _expect(self, prefixes: tuple[str, ...]) -> str | None:
        deadline = time.monotonic() + self.timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith(prefixes):
                return line
        self.close()
        return None

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, figure: str) -> dict | None:
        if not self.alive:
            return None
        assert self.proc.stdin is not None
        self.proc.stdin.write(figure + "\n")
        self.proc.stdin.flush()
        line = self._expect(("RESULT ",))
        return None if line is None else json.loads(line[len("RESULT "):])

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def error(self) -> dict:
        err = self.proc.stderr.read() if self.proc.stderr is not None else ""
        return {"error": (err or "").strip().splitlines()[-1:] or [f"exit {self.proc.returncode}"]}


def best_of(rounds: list[dict]) -> dict:
    """An engine's figures from its rounds: the lowest TTFT, the highest decode tokens/s per
    sequence, and at 8 concurrent the round with the highest output tokens/s (its served
    count and slowest TTFT with it)."""
    out: dict = {"ttft_ms": {}, "decode_tok_s_per_seq": {}}
    for n in ("32", "512"):
        got = [r[f"ttft:{n}"]["ttft_ms"] for r in rounds if r.get(f"ttft:{n}")]
        out["ttft_ms"][n] = min(got) if got else None
    for c in CONCURRENCY:
        got = [r[f"decode:{c}"] for r in rounds if r.get(f"decode:{c}")]
        rates = [g["tok_s_per_seq"] for g in got if g["tok_s_per_seq"] is not None]
        out["decode_tok_s_per_seq"][str(c)] = max(rates) if rates else None
        if c == 8 and got:
            top = max(got, key=lambda g: g["output_tok_s"])
            out.update(output_tok_s_c8=top["output_tok_s"], served_c8=top["served"],
                       ttft_ms_c8_max=top["ttft_ms_max"])
    return out


def compare(children: dict[str, Child], rounds: int) -> dict[str, dict]:
    """``rounds`` alternating rounds over every live child (see the docstring)."""
    names = [n for n, c in children.items() if c.alive]
    per: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)] if names else []
        got: dict[str, dict] = {n: {} for n in order}
        for figure in FIGURES:
            for name in order:
                got[name][figure] = children[name].ask(figure)
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        for name in order:
            per[name].append({**got[name], "loadavg": load})
        print(f"round {r + 1}/{rounds}: " + json.dumps(got), file=sys.stderr, flush=True)
    out = {}
    for name in names:
        kid = children[name]
        mem = kid.ask("mem") or {}
        out[name] = {**kid.info, **best_of(per[name]), **mem, "rounds": per[name]}
    return out
