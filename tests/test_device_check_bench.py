"""bench/device_check.sh on a machine without a GPU, its driver's planning, phases, limits,
errors and table (step processes stood in by small Python programs), and the carry it installs
from."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import device_check  # noqa: E402

GPU_INFO = {"why_not": None, "gpu": "NVIDIA H200", "kvikio": "26.10.00 (compat)"}


@pytest.mark.skipif(device_check.probe()["why_not"] is None, reason="a GPU is here")
def test_without_a_gpu_it_prints_its_skip_table_and_exits_0(tmp_path):
    env = {**os.environ, "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"),
           "CARRY": str(tmp_path / "no-carry"), "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(REPO / "bench" / "device_check.sh")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    why = device_check.probe()["why_not"]
    for step in device_check.STEPS:
        assert f"{step:<16}skipped  {why}" in p.stdout
    assert "skipped: aot_build (" in p.stdout
    doc = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert {r["status"] for r in doc["steps"].values()} == {"skipped"}
    assert set(doc["meta"]) == {"command", "machine", "loadavg", "date", "commit"}


def test_every_step_is_planned_once_and_the_plan_fits_the_check():
    planned = [name for phase in device_check.PHASES for name in phase]
    assert sorted(planned) == sorted(device_check.STEPS) and len(set(planned)) == len(planned)
    # the steps that hold the targets never share the node: only phase 1 runs side by side
    assert all(len(phase) == 1 for phase in device_check.PHASES[1:])
    setup_s = 30
    walls = [max(device_check.STEPS[n][0] for n in phase) for phase in device_check.PHASES[:3]]
    assert setup_s + sum(walls) <= device_check.CHECK_BUDGET_S - device_check.MARGIN_S
    for name, need in device_check.NEEDS.items():
        assert planned.index(need) < planned.index(name)


@pytest.fixture
def fake_steps(tmp_path, monkeypatch):
    """Steps stood in by ``python -c PROGRAM`` (``programs[name]``), in WORK=tmp_path."""
    monkeypatch.setattr(device_check, "WORK", tmp_path)
    programs: dict[str, str] = {}

    def argv(name, limit):
        prelude = (f"import sys, time, json, pathlib; sys.path[:0] = {[str(REPO), str(REPO / 'bench')]!r}; "
                   f"import os; os.environ['WORK'] = {str(tmp_path)!r}; import device_check; ")
        return [sys.executable, "-c", prelude + programs.get(name, "pass")]
    monkeypatch.setattr(device_check, "step_argv", argv)
    return programs


def test_steps_that_the_budget_cannot_hold_are_skipped_and_say_why(fake_steps, monkeypatch):
    started = []
    monkeypatch.setattr(device_check, "run_phase", lambda names, limits: started.append(names))
    late = time.time() - (device_check.CHECK_BUDGET_S - device_check.MARGIN_S - 10)
    results = device_check.drive(GPU_INFO, late)
    assert started == []            # 10 s left: no step's least fits
    for name, (_, least) in device_check.STEPS.items():
        if name in device_check.NEEDS:
            assert results[name]["reason"].startswith(f"needs {device_check.NEEDS[name]}")
        else:
            assert results[name]["status"] == "skipped"
            assert f"it needs at least {least} s" in results[name]["reason"]


def test_a_failed_step_keeps_what_it_measured_and_its_traceback(fake_steps, monkeypatch):
    monkeypatch.setattr(device_check, "PHASES", [("throughput_8gib",)])
    fake_steps["throughput_8gib"] = (
        "\ndef fail(figs, size):\n"
        "    figs.fig('h2d_pinned', 21.5, 'GB/s', path='host')\n"
        "    raise RuntimeError('kvikio EOF at chunk 3')\n"
        "device_check.step_throughput = fail\n"
        "sys.exit(device_check.run_step('throughput_8gib', 60))")
    results = device_check.drive(GPU_INFO, time.time())
    res = results["throughput_8gib"]
    assert res["status"] == "failed" and res["reason"] == "RuntimeError: kvikio EOF at chunk 3"
    assert res["error"]["type"] == "RuntimeError"
    assert res["error"]["traceback"][0] == "Traceback (most recent call last):"
    assert res["error"]["traceback"][-1] == "RuntimeError: kvikio EOF at chunk 3"
    assert res["figures"]["h2d_pinned"]["value"] == 21.5      # measured before it failed
    text = device_check.table({**GPU_INFO, "torch": "2.11"}, results)
    assert "reason: RuntimeError: kvikio EOF at chunk 3" in text and "h2d_pinned" in text
    assert "| RuntimeError: kvikio EOF at chunk 3" in text and "took " in text


def test_a_crashed_step_reports_its_last_traceback_not_its_last_line(fake_steps, monkeypatch):
    monkeypatch.setattr(device_check, "PHASES", [("aot_build",)])
    fake_steps["aot_build"] = (
        "print('Traceback (most recent call last):\\n  File \"x\"\\nValueError: first'); "
        "print('Traceback (most recent call last):\\n  File \"inductor.py\", line 9\\n"
        "torch._inductor.exc.InductorError: CompilationError: ptxas fatal', flush=True); "
        "print('autotune: 12 choices benchmarked', flush=True); os._exit(3)")
    res = device_check.drive(GPU_INFO, time.time())["aot_build"]
    assert res["status"] == "failed"
    assert res["error"]["traceback"][0] == "Traceback (most recent call last):"
    assert "InductorError: CompilationError: ptxas fatal" in "\n".join(res["error"]["traceback"])
    assert "ValueError: first" not in "\n".join(res["error"]["traceback"])
    assert res["reason"].startswith("StepProcess: exit status 3")


def test_a_step_over_its_limit_is_stopped_and_says_where_it_was(fake_steps, monkeypatch):
    monkeypatch.setattr(device_check, "PHASES", [("stack",)])
    monkeypatch.setattr(device_check, "STEPS", {**device_check.STEPS, "stack": (1, 1)})
    monkeypatch.setattr(device_check, "TERM_GRACE_S", 10.0)
    fake_steps["stack"] = ("device_check.step_stack = lambda f, b: time.sleep(60); "
                           "sys.exit(device_check.run_step('stack', 1))")
    t = time.time()
    res = device_check.drive(GPU_INFO, time.time())["stack"]
    assert time.time() - t < 10            # SIGTERM ended it: no wait for the 60 s
    assert res["status"] == "failed" and res["reason"] == "over its 1 s limit"
    assert res["error"]["type"] == "StepStopped"
    assert any("time.sleep(60)" in line or "<lambda>" in line for line in res["error"]["traceback"])


def test_a_step_that_ignores_sigterm_is_killed_after_the_grace(fake_steps, monkeypatch):
    monkeypatch.setattr(device_check, "PHASES", [("stack",)])
    monkeypatch.setattr(device_check, "STEPS", {**device_check.STEPS, "stack": (1, 1)})
    monkeypatch.setattr(device_check, "TERM_GRACE_S", 1.0)
    fake_steps["stack"] = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                           "time.sleep(60)")
    res = device_check.drive(GPU_INFO, time.time())["stack"]
    assert res["status"] == "failed" and res["error"]["message"].startswith(
        "over its 1 s limit; killed by SIGKILL")


def test_phase_one_runs_side_by_side_and_a_step_without_its_input_is_skipped(
        fake_steps, monkeypatch, tmp_path):
    monkeypatch.setattr(device_check, "PHASES", [("aot_build", "prep_8b", "gpu_tests"),
                                                 ("stack_8b",)])
    for name in ("aot_build", "gpu_tests"):
        fake_steps[name] = f"time.sleep(1.5); device_check.Figures({name!r})"
    fake_steps["prep_8b"] = "time.sleep(1.5); sys.exit(1)"
    t = time.time()
    results = device_check.drive(GPU_INFO, time.time())
    assert time.time() - t < 4.0            # together, not 4.5 s one after another
    assert results["aot_build"]["status"] == results["gpu_tests"]["status"] == "ok"
    assert results["aot_build"]["beside"] == ["prep_8b", "gpu_tests"]
    assert results["stack_8b"] == {"status": "skipped",
                                   "reason": "needs prep_8b, which did not finish (failed)"}


def test_what_a_step_leaves_for_no_one_is_removed_before_the_next_phase(fake_steps, monkeypatch,
                                                                       tmp_path):
    monkeypatch.setattr(device_check, "PHASES", [("stack_8b",), ("throughput_8b",)])
    monkeypatch.setattr(device_check, "NEEDS", {})
    for keep, gone in (("stack-8b-state/run", "stack-8b-state/snapshots"),
                       ("smollm2-shaped", "llama3-8b-shaped")):
        (tmp_path / keep).mkdir(parents=True)
        (tmp_path / gone).mkdir(parents=True)
    fake_steps["throughput_8b"] = ("assert not (pathlib.Path(os.environ['WORK']) / "
                                   "'llama3-8b-shaped').exists(); "
                                   "pathlib.Path(os.environ['WORK'], 'tp-1').mkdir()")
    results = device_check.drive(GPU_INFO, time.time())
    assert results["throughput_8b"]["status"] == "ok"
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["smollm2-shaped",
                                                                         "stack-8b-state"]
    assert [p.name for p in (tmp_path / "stack-8b-state").iterdir()] == ["run"]


def test_failure_of_a_killed_process_without_a_traceback_keeps_its_last_lines():
    err = device_check.failure_of("building...\nstep 2 of 2\n", -9)
    assert err["message"] == "killed by SIGKILL: step 2 of 2"
    assert err["traceback"] == ["building...", "step 2 of 2"]


# --- the carry (bench/device_prep.sh) holds every import of the serving path ----------------------

TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "implementation_name": "cpython", "platform_python_implementation": "CPython"}
"""The GPU node's interpreter, for requirement markers (bench/device_prep.sh downloads for it)."""

NOT_CARRIED = {
    "rewarm": "this repository itself (the check runs from the working tree)",
    "torch": "the image's own, built for its CUDA; what torch requires is the image's too",
    "matplotlib": "imported only by agent/sim/plots.py (`rewarm simulate --plot`)",
    "cupy-cuda13x": "kvikio-cu13 declares it; `import kvikio` and CuFile never import cupy",
    "huggingface-hub": "tokenizers declares it; Tokenizer.from_file, which agent uses, never "
                       "imports it",
    "cuda-toolkit": "libkvikio's cuda-toolkit[cufile] is a metapackage: its cufile part, "
                    "nvidia-cufile, is carried by name",
}
"""Distributions the closure reaches that the carry leaves out, each checked below."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def serving_sources() -> list[Path]:
    """agent/, bench/device_check.py with the bench modules it imports, and the files its
    ``pytest -m gpu`` step collects (gpu-marked test files, their conftests, the tests.*
    modules they import), followed through local imports."""
    todo = sorted((REPO / "agent").rglob("*.py")) + [REPO / "bench" / "device_check.py"]
    gpu_tests = [f for f in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in f.read_text()]
    for f in gpu_tests:
        todo += [f] + [d / "conftest.py" for d in f.parents if d.is_relative_to(REPO / "tests")
                       and (d / "conftest.py").is_file()]
    seen: list[Path] = []
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.append(f)
        for name in _imports(f):
            parts = name.split(".")
            if parts[0] == "tests":
                local = REPO.joinpath(*parts).with_suffix(".py")
            elif f.parent == REPO / "bench":
                local = REPO / "bench" / f"{parts[0]}.py"
            else:
                continue
            if local.is_file():
                todo.append(local)
    return seen


def needed_distributions() -> tuple[dict[str, str], set[str]]:
    """{distribution: why} for the serving path's third-party imports and the transitive
    closure of their requirements (markers for TARGET_ENV, extras as requested), and the
    distributions torch's own closure holds (the image's)."""
    from packaging.requirements import Requirement

    dists = importlib.metadata.packages_distributions()
    need: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str], str]] = []
    for f in serving_sources():
        for name in _imports(f):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in ("agent", "tests"):
                continue
            for dist in dists.get(top, []):
                todo.append((_norm(dist), frozenset(), f"{f.relative_to(REPO)} imports {top}"))

    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    if "timeout" in ini:                     # the gpu_tests step's pytest reads it
        todo.append(("pytest-timeout", frozenset(), "pyproject.toml's pytest option `timeout`"))

    def closure(start: list[tuple[str, frozenset[str], str]], out: dict[str, str]) -> None:
        while start:
            dist, extras, why = start.pop()
            if dist in out:
                continue
            out[dist] = why
            if dist in NOT_CARRIED and out is need:
                continue                     # left out, and so is what only it requires
            try:
                requires = importlib.metadata.requires(dist) or []
            except importlib.metadata.PackageNotFoundError:
                continue                     # not installed here: NOT_CARRIED says why
            for text in requires:
                req = Requirement(text)
                if req.marker is None or any(req.marker.evaluate({**TARGET_ENV, "extra": e})
                                             for e in (extras or {""})):
                    start.append((_norm(req.name), frozenset(req.extras), f"{dist} requires {text}"))

    closure(todo, need)
    image: dict[str, str] = {}
    closure([("torch", frozenset(), "the image")], image)
    return need, set(image)


def carried_names(script: Path = REPO / "bench" / "device_prep.sh") -> set[str]:
    """The distributions bench/device_prep.sh's WHEELS array names (literal requirements and
    ``$(pin NAME ...)``)."""
    block = re.search(r"^WHEELS=\((.*?)^\)", script.read_text(), re.S | re.M)
    assert block, f"{script}: no WHEELS=( ... ) array"
    body = re.sub(r"#[^\n]*", "", block.group(1))
    names = set(re.findall(r"\$\(pin\s+([A-Za-z0-9][A-Za-z0-9._-]*)", body))
    names |= set(re.findall(r'"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^]]*\])?(?:[=<>!~][^"]*)?"', body))
    return {_norm(n) for n in names}


def test_the_carry_names_every_distribution_the_serving_path_imports():
    need, image = needed_distributions()
    carried = carried_names()
    missing = {d: why for d, why in need.items()
               if d not in carried and d not in image and d not in NOT_CARRIED}
    assert missing == {}
    # what the walk reaches (a walk that found nothing would pass): the HTTP entrance's stack,
    # kvikio and what libkvikio loads, the gpu tests' runner
    assert {"aiohttp", "aiohttp-cors", "multidict", "yarl", "uvloop", "kvikio-cu13",
            "libkvikio-cu13", "rapids-logger", "cuda-pathfinder", "pytest", "pytest-timeout"} <= set(need)
    assert {"jinja2", "markupsafe", "typing-extensions"} <= image
    assert "nvidia-cufile" in carried


def test_what_the_carry_leaves_out_is_never_imported_on_the_serving_path():
    need, _ = needed_distributions()
    assert set(NOT_CARRIED) - {"rewarm", "torch"} <= set(need)     # each is reached, and excused
    importers = {str(f.relative_to(REPO)) for f in serving_sources() if any(
        n.split(".")[0] == "matplotlib" for n in _imports(f))}
    assert importers == {"agent/sim/plots.py"}
    code = ("import sys, tokenizers, kvikio, kvikio.defaults\n"
            "from agent.replica.tokenizer import Tokenizer\n"
            "print(sorted(m for m in ('cupy', 'huggingface_hub') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]"


def test_the_carry_parser_reads_both_spellings(tmp_path):
    script = tmp_path / "prep.sh"
    script.write_text('X=1\nWHEELS=(\n  # a comment "not-a-wheel==1"\n  "kvikio-cu13==26.10.*" '
                      '"$(pin Aiohttp_Cors \'>=0.8\')"\n  "pkg[extra]>=1"\n)\nWHEELS+=("late==1")\n')
    assert carried_names(script) == {"kvikio-cu13", "aiohttp-cors", "pkg"}


def test_the_carrys_kvikio_is_the_version_the_suite_checks():
    """One kvikio version everywhere: the carry, the development venv, the gpu extras."""
    text = (REPO / "bench" / "device_prep.sh").read_text()
    makefile = (REPO / "Makefile").read_text()
    for pin in ("kvikio-cu13==26.10.*", "libkvikio-cu13==26.10.*"):
        assert f'"{pin}"' in text and f"'{pin}'" in makefile, pin
    assert importlib.metadata.version("kvikio-cu13").startswith("26.10.")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["gpu"] == ["kvikio-cu13==26.10.*"] and extras["gpu-cu12"] == ["kvikio-cu12==26.10.*"]


# --- bench/device_check.sh's setup: only what the image lacks, every failure in setup.txt ------------

def _wheel(folder: Path, dist: str, version: str, module: str | None = None) -> Path:
    """A minimal valid wheel (PEP 427: METADATA, WHEEL, RECORD) holding ``module``."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    files = {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    if module:
        files[f"{module}/__init__.py"] = "ANSWER = 42\n"
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def _script(tmp_path: Path, carry: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"),
           "CARRY": str(carry), "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(REPO / "bench" / "device_check.sh"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_selection_installs_only_distributions_the_python_lacks(tmp_path):
    numpy = importlib.metadata.version("numpy")
    wheels = tmp_path / "carry" / "wheels"
    _wheel(wheels, "numpy", "0.0.1")                       # the image's, at another version
    _wheel(wheels, "Typing_Extensions", importlib.metadata.version("typing-extensions"))
    absent = _wheel(wheels, "rewarm_absent_probe", "1.0")
    p = _script(tmp_path, tmp_path / "carry", "--select")
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if not line.startswith("setup:")]
    assert sorted(lines) == sorted([f"have numpy {numpy} (carried 0.0.1)",
                                    f"have typing-extensions {importlib.metadata.version('typing-extensions')}",
                                    f"install {absent}"])
    assert not (tmp_path / "work" / "site").exists()      # --select installs nothing


def test_a_file_in_the_carry_without_a_wheels_name_is_skipped_and_the_rest_chosen(tmp_path):
    """A corrupt carry (a file named like no wheel: ``junk.whl``, ``x-1.whl``) is skipped with
    the reason, and the wheels sorted after it are still chosen: its name used to end the
    selection with a traceback, so every wheel after it went uninstalled."""
    wheels = tmp_path / "carry" / "wheels"
    first = _wheel(wheels, "aaa_probe", "1.0")
    last = _wheel(wheels, "zzz_probe", "1.0")
    for name in ("junk.whl", "x-1.whl", "y--1-py3-none-any.whl"):
        (wheels / name).write_bytes(b"not a wheel")
    p = _script(tmp_path, tmp_path / "carry", "--select")
    assert p.returncode == 0, p.stderr
    lines = [line for line in p.stdout.splitlines() if not line.startswith("setup:")]
    assert [line for line in lines if line.startswith("install ")] == \
        [f"install {first}", f"install {last}"]
    skipped = [line for line in lines if line.startswith("skip ")]
    assert [line.split()[1] for line in skipped] == \
        [str(wheels / n) for n in ("junk.whl", "x-1.whl", "y--1-py3-none-any.whl")]
    assert all("not a wheel file name" in line for line in skipped)
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.skipif(device_check.probe()["why_not"] is None, reason="a GPU is here")
def test_setup_installs_the_missing_wheels_into_work_site_and_reports_each_failure(tmp_path):
    wheels = tmp_path / "carry" / "wheels"
    _wheel(wheels, "rewarm_probe_a", "1.0", module="rewarm_probe_a")
    _wheel(wheels, "numpy", "0.0.1", module="numpy_shadow")   # would shadow the image's numpy
    (wheels / "rewarm_broken-1.0-py3-none-any.whl").write_bytes(b"not a zip file")
    p = _script(tmp_path, tmp_path / "carry")
    assert p.returncode == 0, p.stderr
    site = tmp_path / "work" / "site"
    setup = (tmp_path / "work" / "setup.txt").read_text()
    assert (site / "rewarm_probe_a" / "__init__.py").is_file()
    assert not (site / "numpy_shadow").exists() and not list(site.glob("numpy-*"))
    assert f"setup: python {sys.executable} (PYTHON)" in setup
    assert "failed" in setup and "rewarm_broken-1.0-py3-none-any.whl failed:" in setup
    # pip's own words about the broken wheel are quoted, not only that it failed
    broken = setup.split("rewarm_broken-1.0-py3-none-any.whl failed:", 1)[1]
    assert "zip" in broken.lower() or "wheel" in broken.lower(), broken
    assert "setup: installed 1 of 2 wheels" in setup
    assert f"PYTHONPATH={site}:{REPO}" in setup
    imports = next(line for line in setup.splitlines() if line.startswith("setup: imports ok: "))
    assert f"numpy {importlib.metadata.version('numpy')} (image)" in imports
    assert "aiohttp_cors" in imports and "kvikio.defaults" in imports and "import " not in setup
    doc = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert doc["setup"] == setup.splitlines()


@pytest.mark.skipif(device_check.probe()["why_not"] is None, reason="a GPU is here")
def test_on_a_bare_python_every_failure_reaches_setup_txt_with_its_message(tmp_path):
    """A python with nothing installed, not even pip, and a carry without a pip wheel: pip,
    the imports and the ext/ build each fail, and setup.txt quotes why."""
    bare = tmp_path / "bare"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip",
                    str(bare)], check=True, timeout=120)
    _wheel(tmp_path / "carry" / "wheels", "rewarm_probe_b", "1.0", module="rewarm_probe_b")
    env = {**os.environ, "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"),
           "CARRY": str(tmp_path / "carry"), "PYTHON": str(bare / "bin" / "python")}
    env.pop("PYTHONPATH", None)
    p = subprocess.run(["bash", str(REPO / "bench" / "device_check.sh")], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    setup = (tmp_path / "work" / "setup.txt").read_text()
    assert "torch not importable" in setup.splitlines()[0]
    assert "failed with no pip (the python has no pip module, the carry no pip wheel)" in setup
    assert "rewarm_probe_b-1.0-py3-none-any.whl failed:" in setup and "setup: imports ok: none" in setup
    assert "setup: import aiohttp_cors FAILED: ModuleNotFoundError: No module named 'aiohttp_cors'" in setup
    assert "setup: import kvikio FAILED: ModuleNotFoundError: No module named 'kvikio'" in setup
    assert "setuptools MISSING (ModuleNotFoundError: No module named 'setuptools')" in setup
    assert "setup: ext/ build FAILED" in setup and "ModuleNotFoundError" in setup.split("ext/ build FAILED", 1)[1]
