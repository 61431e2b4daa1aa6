"""Render docs/benchmarks.md from the committed benchmark JSON in bench/results/.

Every figure on that page comes from a file here, with the command, machine, load average,
date and commit that produced it (the file's ``meta``); none is typed by hand.  A benchmark
writes ``bench/results/<bench>.json`` holding:

- ``meta``: ``{"command", "machine", "loadavg", "date", "commit"}`` (required);
- ``title``: one line naming what was measured (optional; the file name otherwise);
- ``tables``: ``[{"title", "columns": [str], "rows": [[cell]], "notes"?}]``, the figures to
  show (optional: without it the page lists the JSON's scalar leaves by dotted key);
- ``headline``: ``[[label, value], ...]``, the one to three figures the README's results
  table shows (optional: else the first table's first rows).

The README's results table lies between :data:`README_BEGIN` and :data:`README_END` and is
rendered from the same files.

:data:`KNOWN` lists the benchmarks the page expects, in page order, with the command that
makes each; one without a file is listed as not run, so a reader sees what is missing.
Files not in :data:`KNOWN` follow in name order.

``python bench/render_docs.py`` writes docs/benchmarks.md; ``--check`` exits 1 when the file
differs from the render (tests/docs/test_benchmarks_page.py runs the same comparison).
A malformed result file raises :class:`ResultError` naming the file and the key.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PAGE = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
README_BEGIN = "<!-- results: rendered by bench/render_docs.py from bench/results/ -->"
README_END = "<!-- /results -->"
HEADLINE_ROWS = 3
META_KEYS = ("command", "machine", "loadavg", "date", "commit")
MAX_LEAVES = 60          # scalar leaves shown for a file without "tables"

KNOWN: tuple[tuple[str, str, str], ...] = (
    ("cold_start", "Cold-start ladder: boot to first token, per rung", "make bench-ladder"),
    ("restore_throughput", "Snapshot restore throughput against the peer loaders", "make bench"),
    ("trace_replay", "Live trace replay on the embedded stack, against the simulator",
     "python bench/trace_replay.py --trace CSV --json bench/results/trace_replay.json"),
    ("http_load", "The HTTP door beside the msgpack door; guidellm against a real replica",
     "make bench-http"),
    ("frontdoor_load", "Front-door CPU per request and added latency",
     "python bench/frontdoor_load.py --json bench/results/frontdoor_load.json"),
    ("engine_compare", "Engines compared on this machine", "make bench-engines"),
    ("engine_profile", "Engine profile (prefill and decode speed)",
     "python bench/engine_profile.py --json bench/results/engine_profile.json"),
    ("replay_shapes", "Admission on synthetic arrival shapes",
     "python bench/replay_shapes.py --json bench/results/replay_shapes.json"),
    ("cluster_e2e", "Cluster mode end to end (Nomad and Consul stand-ins)",
     "python bench/cluster_e2e.py --json bench/results/cluster_e2e.json"),
    ("prefill_burst", "A burst of prompts at one replica: chunked prefill against whole prompts",
     "python bench/prefill_burst.py --rounds 5 --shapes --json bench/results/prefill_burst.json"),
    ("device_check", "GPU paths on a GPU node", "bash bench/device_check.sh"),
)
"""(file stem, heading, the command that makes it), in page order."""


class ResultError(ValueError):
    """A result file that cannot be rendered: ``path`` and ``key`` name what is wrong."""

    def __init__(self, path: Path, key: str, why: str) -> None:
        super().__init__(f"{path.name}: {key}: {why}")
        self.path, self.key = path, key


def cell(value: Any) -> str:
    """One table cell: ints as they are (thousands separated from 10,000), floats rounded
    to 3 decimals below 1,000 and to whole numbers above, ``|`` escaped."""
    if isinstance(value, bool) or value is None:
        text = "" if value is None else ("yes" if value else "no")
    elif isinstance(value, int):
        text = f"{value:,}" if abs(value) >= 10_000 else str(value)
    elif isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            text = str(value)
        elif abs(value) >= 1000:
            text = f"{value:,.0f}"
        else:
            text = f"{round(value, 3):g}"
    elif isinstance(value, (list, tuple)):
        text = " ".join(cell(v) for v in value) if all(
            isinstance(v, (int, float)) for v in value) else ", ".join(cell(v) for v in value)
    elif isinstance(value, dict):
        text = "; ".join(f"{k} {cell(v)}" for k, v in value.items())
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def default_heading(stem: str) -> str:
    """The heading of a result without a ``title``: :data:`KNOWN`'s, else the file stem with
    spaces for underscores (the page's section and the README's link to it share it)."""
    return next((h for s, h, _c in KNOWN if s == stem), stem.replace("_", " "))


def anchor(heading: str) -> str:
    """The fragment GitHub gives a Markdown heading: lower case, punctuation dropped
    (hyphens and underscores kept), spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(cell(c) for c in columns) + " |",
           "|" + "---|" * len(columns)]
    for row in rows:
        out.append("| " + " | ".join(cell(c) for c in row) + " |")
    return out


def leaves(obj: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """The scalar leaves of ``obj`` by dotted key (lists of scalars kept whole)."""
    if isinstance(obj, dict):
        out: list[tuple[str, Any]] = []
        for key, value in obj.items():
            out += leaves(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    if isinstance(obj, list) and obj and all(isinstance(v, dict) for v in obj):
        return [(f"{prefix}[{len(obj)} entries]", "")]
    return [(prefix, obj)]


def load(path: Path) -> dict:
    """A result file, checked: a JSON object with every :data:`META_KEYS` in ``meta``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ResultError(path, "file", f"not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ResultError(path, "file", "not a JSON object")
    meta = data.get("meta")
    if not isinstance(meta, dict):
        raise ResultError(path, "meta", "missing: {command, machine, loadavg, date, commit}")
    for key in META_KEYS:
        if key not in meta:
            raise ResultError(path, f"meta.{key}", "missing")
    tables = data.get("tables")
    if tables is not None:
        if not isinstance(tables, list):
            raise ResultError(path, "tables", "a list of {title, columns, rows}")
        for i, t in enumerate(tables):
            if not isinstance(t, dict) or not isinstance(t.get("columns"), list) \
                    or not isinstance(t.get("rows"), list):
                raise ResultError(path, f"tables[{i}]", "needs columns: [..] and rows: [[..]]")
            for j, row in enumerate(t["rows"]):
                if not isinstance(row, list) or len(row) != len(t["columns"]):
                    raise ResultError(path, f"tables[{i}].rows[{j}]",
                                      f"{len(t['columns'])} cells expected")
    return data


def _section(stem: str, heading: str, path: Path, data: dict) -> list[str]:
    meta = data["meta"]
    out = [f"## {data.get('title') or heading}", "",
           f"`{cell(meta['command'])}` on {cell(meta['machine'])}, load average "
           f"{cell(meta['loadavg'])}, {cell(meta['date'])}, commit `{cell(meta['commit'])}` "
           f"([{path.name}](../bench/results/{path.name})).", ""]
    tables = data.get("tables")
    if tables:
        for t in tables:
            if t.get("title"):
                out += [f"**{cell(t['title'])}**", ""]
            out += _table(t["columns"], t["rows"]) + [""]
            if t.get("notes"):
                out += [str(t["notes"]), ""]
        return out
    rows = [(k, v) for k, v in leaves({k: v for k, v in data.items()
                                        if k not in ("meta", "title")}) if k]
    shown = rows[:MAX_LEAVES]
    out += _table(["key", "value"], [list(r) for r in shown]) + [""]
    if len(rows) > len(shown):
        out += [f"({len(rows) - len(shown)} more keys in the file.)", ""]
    return out


def render(results: Path = RESULTS) -> str:
    """The page for the files in ``results`` (module docstring)."""
    files = {p.stem: p for p in sorted(results.glob("*.json"))} if results.is_dir() else {}
    out = ["# Benchmarks", "",
           "Rendered by `python bench/render_docs.py` from the JSON in "
           "[bench/results/](../bench/results/README.md); do not edit by hand. Each section names the "
           "command, the machine, its load average and the date of the run that produced "
           "it. Rerun a command, then the renderer, to reproduce a figure.", ""]
    missing = []
    for stem, heading, command in KNOWN:
        path = files.pop(stem, None)
        if path is None:
            missing.append((stem, heading, command))
            continue
        out += _section(stem, heading, path, load(path))
    for stem, path in sorted(files.items()):
        out += _section(stem, default_heading(stem), path, load(path))
    if missing:
        out += ["## Not run yet", "",
                "No result file is committed for these; the command makes one.", ""]
        out += _table(["benchmark", "result file", "command"],
                      [[heading, f"`{stem}.json`", f"`{command}`"]
                       for stem, heading, command in missing]) + [""]
    return "\n".join(out).rstrip() + "\n"


def headline(data: dict) -> list[tuple[str, Any]]:
    """A result's figures for the README: its ``headline``, else its first table's first
    :data:`HEADLINE_ROWS` rows (first cell the label, last the value)."""
    if isinstance(data.get("headline"), list):
        return [(str(row[0]), row[-1]) for row in data["headline"][:HEADLINE_ROWS]
                if isinstance(row, list) and row]
    for t in data.get("tables") or ():
        return [(str(row[0]), row[-1]) for row in t["rows"][:HEADLINE_ROWS] if row]
    return [(k, v) for k, v in leaves({k: v for k, v in data.items()
                                       if k not in ("meta", "title")}) if k][:HEADLINE_ROWS]


def readme_table(results: Path = RESULTS) -> str:
    """The README's results table: one row per committed result (known ones first), its
    headline figures, the machine, load average and date, a link to its section."""
    files = {p.stem: p for p in sorted(results.glob("*.json"))} if results.is_dir() else {}
    order = [stem for stem, _h, _c in KNOWN if stem in files]
    order += sorted(set(files) - set(order))
    rows = []
    for stem in order:
        data = load(files[stem])
        meta = data["meta"]
        figures = "; ".join(f"{label}: {cell(value)}" for label, value in headline(data))
        title = data.get("title") or default_heading(stem)
        rows.append([f"[{title}](docs/benchmarks.md#{anchor(title)})",
                     figures, f"{meta['machine']}, load {meta['loadavg']}, {meta['date']}"])
    if not rows:
        return "No benchmark result is committed yet: see docs/benchmarks.md for the commands.\n"
    return "\n".join(_table(["benchmark", "figures", "measured on"], rows)) + "\n"


def with_readme_table(text: str, table: str) -> str:
    """``text`` (the README) with the block between the markers replaced by ``table``;
    unchanged when the markers are absent."""
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        return text
    return text[:start + len(README_BEGIN)] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/benchmarks.md differs from the render")
    args = parser.parse_args(argv)
    text = render()
    readme = README.read_text() if README.exists() else ""
    new_readme = with_readme_table(readme, readme_table())
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        stale = [str(p.relative_to(REPO)) for p, ok in ((PAGE, current == text),
                                                        (README, readme == new_readme)) if not ok]
        if stale:
            print(f"{', '.join(stale)} differ from the render of bench/results/; run "
                  "python bench/render_docs.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    if new_readme != readme:
        README.write_text(new_readme)
    print(f"wrote {PAGE.relative_to(REPO)}" + (" and the README's results table"
                                                if new_readme != readme else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
