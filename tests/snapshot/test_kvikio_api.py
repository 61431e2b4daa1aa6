"""Every kvikio name, call and setting agent/ uses, checked against the installed kvikio wheel
(tests/snapshot/kvikio_uses.py, in a fresh interpreter: only the imports agent performs)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.fake_kvikio import VERSION

REPO = Path(__file__).resolve().parents[2]


def _check(*roots: Path) -> dict:
    p = subprocess.run([sys.executable, str(REPO / "tests" / "snapshot" / "kvikio_uses.py"),
                        *map(str, roots)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def _snippet(tmp_path: Path, name: str, code: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "mod.py").write_text(textwrap.dedent(code))
    return path


def _problems(doc: dict) -> list[str]:
    return [f"{line}: {text}" for _, line, text in doc["problems"]]


def test_every_kvikio_use_in_agent_resolves_in_the_installed_wheel():
    doc = _check(REPO / "agent")
    assert doc["version"] == VERSION
    assert _problems(doc) == []
    assert "import kvikio.defaults" in doc["imports"]
    uses = {text for _, _, text in doc["uses"]}
    # the walk follows what the restore path calls (a blind walk would pass anything)
    for call in ("kvikio.CuFile(", "kvikio.CuFile().pread(", "kvikio.CuFile().pread().get(",
                 "kvikio.CuFile().close(", "kvikio.defaults.is_compat_mode_preferred("):
        assert any(u.startswith(call) for u in uses), (call, sorted(uses))


def test_a_submodule_that_is_never_imported_is_found(tmp_path):
    code = """
        import kvikio

        def io_path(kvikio):
            return kvikio.defaults.is_compat_mode_preferred()
    """
    doc = _check(_snippet(tmp_path, "bare", code))
    assert len(doc["problems"]) == 1
    assert "kvikio.defaults: no such attribute" in doc["problems"][0][2]
    assert "submodule that is never imported" in doc["problems"][0][2]
    fixed = _check(_snippet(tmp_path, "fixed", code.replace("import kvikio\n", "import kvikio.defaults\n")))
    assert _problems(fixed) == [] and any("is_compat_mode_preferred()" in u[2] for u in fixed["uses"])


def test_keywords_arity_and_methods_are_bound_to_the_real_signatures(tmp_path):
    doc = _check(_snippet(tmp_path, "calls", """
        import kvikio

        def restore(kvikio, path, buf, chunks):
            handles = {c: kvikio.CuFile(path / c, "r") for c in chunks}
            futures = []
            for c in chunks:
                futures.append(handles[c].pread(buf, nbytes=4, file_offset=0))
                futures.append(handles[c].pread(buf, 4, 0, 1 << 20, 7))
                handles[c].pread(buf, 4, 0, task_size=1 << 20)
            for f in futures:
                f.result()
            _wait(futures[0])
            with kvikio.CuFile(path, "r") as f:
                f.read(buf).bit_length()
                f.pread_async(buf)
            opened = {}
            for c in chunks:
                opened[c] = kvikio.CuFile(path / c, "r")
            opened[chunks[0]].pread(buf, 4, 0, tasks=2)

        def _wait(future):
            future.get(timeout=1)
    """))
    problems = _problems(doc)
    assert any("pread(_, nbytes=, file_offset=)" in p and "nbytes" in p for p in problems), problems
    assert any("pread(_, _, _, _, _)" in p and "too many positional" in p for p in problems), problems
    assert any("IOFuture has no attribute 'result'" in p for p in problems), problems
    assert any("get(timeout=)" in p for p in problems), problems
    assert any("CuFile has no attribute 'pread_async'" in p for p in problems), problems
    assert any("pread(_, _, _, tasks=)" in p for p in problems), problems
    assert len(problems) == 6, problems
    uses = {u[2] for u in doc["uses"]}
    assert "kvikio.CuFile().pread(_, _, _, task_size=)" in uses
    assert "kvikio.CuFile().__enter__().read().bit_length()" in uses


def test_settings_are_checked_by_kvikio_itself(tmp_path):
    doc = _check(_snippet(tmp_path, "settings", """
        import kvikio.defaults

        def tune(n, size):
            kvikio.defaults.set("num_thread", n)
            kvikio.defaults.set({"task_size": 0})
            kvikio.defaults.set({"num_threads": n, "remote_io_num_reactors": 2})
            kvikio.defaults.set({"num_threads": n, "task_size": size, "bounce_buffer_size": 1 << 24})
            kvikio.defaults.get("bounce_buffer_size")
            kvikio.defaults.get("bounce_buffer")
            with kvikio.defaults.set("task_size", size):
                pass
            kvikio.defaults.set(key="task_size", value=size)

        def settings(n):
            return {"num_threads": n, "task_size": 0}

        def tune_through_a_helper(kvikio, n):
            chosen = settings(n)
            with kvikio.defaults.set(chosen):
                pass
    """))
    problems = _problems(doc)
    assert any("set('num_thread'" in p and "KeyError" in p for p in problems), problems
    assert any("set({'task_size': 0})" in p and "ValueError" in p for p in problems), problems
    assert any("remote_io_num_reactors" in p and "ValueError" in p for p in problems), problems
    assert any("get('bounce_buffer')" in p and "KeyError" in p for p in problems), problems
    assert any("set(key=, value=)" in p for p in problems), problems
    assert any(p.startswith("20: ") and "'task_size': 0" in p and "ValueError" in p for p in problems), problems
    assert len(problems) == 6, problems


def test_a_version_guard_checks_its_own_name_and_follows_the_other_branch_as_a_fallback(tmp_path):
    doc = _check(_snippet(tmp_path, "guards", """
        import kvikio.defaults

        def mode(kvikio):
            d = kvikio.defaults
            if hasattr(d, "is_compat_mode_preferred"):
                return d.is_compat_mode_preferred()
            return d.compat_mode()

        def old(kvikio):
            if not hasattr(kvikio.defaults, "no_such_name"):
                return 0
            return kvikio.defaults.no_such_name()
    """))
    problems = _problems(doc)
    assert len(problems) == 1 and "hasattr(kvikio.defaults, 'no_such_name') is False" in problems[0]
    fallbacks = [f"{line}: {text}" for _, line, text in doc["fallbacks"]]
    assert any(f.startswith("8: kvikio.defaults.compat_mode: no such attribute") for f in fallbacks), fallbacks
    assert any(f.startswith("13: kvikio.defaults.no_such_name") for f in fallbacks), fallbacks
