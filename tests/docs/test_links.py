"""Every relative link and file reference in README.md, CHANGELOG.md, docs/ and the code's
comments and docstrings resolves to a file or folder of the repository; none points outside
it (a reader of a clone has nothing beside it)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("agent", "bench", "docs", "ext", "jobs", "tests")
SUFFIXES = ("py", "pyx", "pxd", "h", "md", "json", "hcl", "sh", "service", "example", "png",
            "toml", "txt", "csv", "cfg")
# a path of the repository named in prose: agent/frontdoor/router.py, docs/metrics.md, jobs/
FILE_REF = re.compile(r"(?<![\w./-])((?:%s)/(?:[\w./-]*[\w/])?)" % "|".join(ROOTS))
MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# outside the repository: the folder beside the checkout, or this checkout's absolute path
# (a file naming it works on one machine only)
OUTSIDE = re.compile(r"\.\./shared|seeds/0\d\d|" + re.escape(f"{REPO}/"))


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.split()
    return [REPO / p for p in out]


def documents() -> list[Path]:
    return [p for p in tracked() if p.suffix == ".md" and p.exists()]


def sources() -> list[Path]:
    return [p for p in tracked() if p.suffix in (".py", ".pyx", ".h", ".sh", ".hcl", ".service")
            and p.exists() and not str(p.relative_to(REPO)).startswith("tests/docs/")]


def _exists(ref: str, base: Path) -> bool:
    ref = ref.split("#", 1)[0].rstrip(".,:;")
    if not ref:
        return True
    for root in (base, REPO):
        if (root / ref).exists():
            return True
    # a module path with its object: agent/frontdoor/router.py:Router or a glob-like tail
    return False


def _anchors(doc: Path) -> set[str]:
    """The fragments of ``doc``'s headings, as GitHub makes them (lower case, punctuation
    dropped, spaces as hyphens)."""
    if not doc.exists():
        return set()
    out = set()
    for line in doc.read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", heading).replace(" ", "-"))
    return out


def _file_refs(text: str) -> list[str]:
    """Paths of the repository named in ``text``: under one of :data:`ROOTS`, ending in a
    file suffix of :data:`SUFFIXES` (``agent/frontdoor/router.py``) or in ``/`` (a folder).
    Not: a name without a suffix (an outside system's page, ``docs/drivers/raw_exec``, or a
    module, ``agent/_restore``), a path a command writes (after ``--json``, ``--out``)."""
    refs = []
    for m in FILE_REF.finditer(text):
        ref = m.group(1)
        end = text[m.end(1):m.end(1) + 1]
        last = ref.rsplit("/", 1)[-1]
        if "." in last:
            if last.rsplit(".", 1)[-1] not in SUFFIXES:
                continue                  # agent/frontdoor/router.Router: not a file name
        elif end != "/" and not ref.endswith("/"):
            continue
        if re.search(r"--(?:json|out|records|events)[ =]$", text[max(0, m.start(1) - 12):m.start(1)]):
            continue
        refs.append(ref)
    return refs


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_markdown_links_and_references_resolve(doc):
    text = doc.read_text()
    bad = []
    for target in MD_LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue                      # http:, https:, mailto:, an anchor
        if not _exists(target, doc.parent):
            bad.append(target)
        elif "#" in target and target.split("#", 1)[0].endswith(".md"):
            path, fragment = target.split("#", 1)
            if fragment not in _anchors((doc.parent / path) if path else doc):
                bad.append(target)
    bad += [ref for ref in _file_refs(text) if not _exists(ref, doc.parent)]
    bad += [m.group(0) for m in OUTSIDE.finditer(text)]
    assert not bad, f"{doc.relative_to(REPO)}: {sorted(set(bad))}"


def test_source_comments_name_files_that_exist():
    bad = []
    for src in sources():
        text = src.read_text(errors="replace")
        rel = src.relative_to(REPO)
        bad += [f"{rel}: {ref}" for ref in _file_refs(text) if not _exists(ref, src.parent)]
        bad += [f"{rel}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not bad, "\n".join(sorted(set(bad)))


def test_the_checker_catches_a_missing_file():
    assert _file_refs("see agent/frontdoor/nope.py and docs/x.md., jobs/ and docs/drivers/x, "
                      "bench/a.py --json bench/results/a.json") == [
        "agent/frontdoor/nope.py", "docs/x.md", "jobs/", "bench/a.py"]
    assert not _exists("agent/frontdoor/nope.py", REPO)
    assert _exists("agent/frontdoor/router.py", REPO)
    assert OUTSIDE.search("(../shared/seeds/002)")
