"""Operability check, as an operator would run it (bench/ops_check.sh is the entry point).

Three parts, each reported in a table and in ``--json``:

* ``units``: each jobs/systemd unit through ``systemd-analyze verify`` (on a copy whose
  ExecStart points at this checkout's ``rewarm``) and ``systemd-analyze security --offline``
  (exposure, target <= 5.0).
* ``metrics``: node agent, front door, replica and predictor started on loopback with a tiny
  synthetic model; two requests go through; each status port's ``/metrics`` is checked with
  ``promtool check metrics`` and parsed for ``model``/``path`` labels; ``/healthz``,
  ``/readyz`` and an unknown path are probed; a real Prometheus server scrapes all four and
  is queried with ``sum by (le, path, model)``.  Without promtool or prometheus (Debian's
  ``prometheus`` package) those steps are skipped and the JSON says so.
* ``fd_overload``: a front door under ``prlimit --nofile=64`` gets more connections than it
  has descriptors, each sending one request; counted: answered (by code), 429s, connections
  that hung (no answer and not closed within ``--hang-s``), and the front door's log lines.

Every process it starts is in its own session and is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from agent.protocol import Decoder, pack  # noqa: E402

REWARM = [sys.executable, "-m", "agent.cli"]
PROCS: list[subprocess.Popen] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], log: Path, prefix: list[str] = ()) -> subprocess.Popen:
    out = open(log, "ab")
    env = {**os.environ, "PYTHONPATH": str(REPO), "REWARM_PROGRESS": "0"}
    p = subprocess.Popen([*prefix, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                         env=env, start_new_session=True)
    PROCS.append(p)
    return p


def stop_all() -> None:
    for p in PROCS:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.time() + 15
    for p in PROCS:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_for(log: Path, pattern: str, timeout_s: float, proc: subprocess.Popen) -> re.Match:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        m = re.search(pattern, text)
        if m:
            return m
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[3:5]} exited {proc.returncode}: {text[-800:]}")
        time.sleep(0.2)
    raise TimeoutError(f"{pattern!r} not in {log} after {timeout_s} s")


def get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# --- units -----------------------------------------------------------------------------------

def check_units() -> dict:
    out: dict = {}
    analyze = shutil.which("systemd-analyze")
    rewarm_bin = Path(sys.executable).with_name("rewarm")
    with tempfile.TemporaryDirectory() as tmp:
        for unit in sorted((REPO / "jobs" / "systemd").glob("*.service")):
            if analyze is None:
                out[unit.name] = {"verify_ok": None, "exposure": None,
                                  "skipped": "systemd-analyze not installed"}
                continue
            copy = Path(tmp) / unit.name
            copy.write_text(unit.read_text()
                            .replace("/opt/rewarm/.venv/bin/rewarm", str(rewarm_bin))
                            .replace("EnvironmentFile=/", "EnvironmentFile=-/"))
            v = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True)
            s = subprocess.run([analyze, "security", "--offline=true", str(unit)],
                               capture_output=True, text=True)
            m = re.search(r"Overall exposure level for \S+: ([\d.]+)", s.stdout + s.stderr)
            out[unit.name] = {"verify_ok": v.returncode == 0 and not v.stderr.strip(),
                              "verify_output": (v.stdout + v.stderr).strip()[:2000],
                              "exposure": float(m.group(1)) if m else None}
    return out


# --- metrics ---------------------------------------------------------------------------------

def labels_of(text: str) -> tuple[bool, bool, int]:
    model = path = False
    n = 0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("rewarm_"):
                n += 1
                model |= bool(s.labels.get("model"))
                path |= bool(s.labels.get("path"))
    return model, path, n


def start_stack(tmp: Path) -> dict:
    model_dir = tmp / "tiny"
    subprocess.run([*REWARM, "model", "make-synthetic", "--preset", "tiny", str(model_dir)],
                   check=True, cwd=REPO, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024        # the replica's default KV length fits
    (model_dir / "config.json").write_text(json.dumps(cfg))
    ports = {k: free_port() for k in ("agent", "agent_m", "fd", "fd_m", "rep_m", "pred_m")}
    logs = {k: tmp / f"{k}.log" for k in ("agent", "frontdoor", "replica", "predictor")}
    agent = spawn([*REWARM, "agent", "run", "--state-dir", str(tmp / "state"), "--model-dir",
                   str(model_dir), "--zygotes", "0", "--threads", "1", "--buffer-mib", "64",
                   "--listen", f"127.0.0.1:{ports['agent']}",
                   "--metrics-listen", f"127.0.0.1:{ports['agent_m']}"], logs["agent"])
    wait_for(logs["agent"], r"listening on", 120, agent)
    name = "tiny"
    fd = spawn([*REWARM, "frontdoor", "--port", str(ports["fd"]), "--http-port", "0", "--metrics-port",
                str(ports["fd_m"]), "--node-agent", f"127.0.0.1:{ports['agent']}",
                "--model", name], logs["frontdoor"])
    wait_for(logs["frontdoor"], r"front door listening", 60, fd)
    rep = spawn([*REWARM, "replica", "--listen", "127.0.0.1:0", "--model-dir", str(model_dir),
                 "--metrics-listen", f"127.0.0.1:{ports['rep_m']}"], logs["replica"])
    wait_for(logs["replica"], r'"ready"', 120, rep)
    spawn([*REWARM, "predictor", "--model", name, "--frontdoor", f"127.0.0.1:{ports['fd']}",
           "--node-agent", f"127.0.0.1:{ports['agent']}", "--metrics-port",
           str(ports["pred_m"])], logs["predictor"])
    answers = []
    for _ in range(2):                          # a cold start, then a warm hit
        g = subprocess.run([*REWARM, "generate", "--model", name, "--tokens", "1,2,3",
                            "--max-tokens", "4", "--address", f"127.0.0.1:{ports['fd']}"],
                           capture_output=True, text=True, cwd=REPO, timeout=300,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        answers.append((g.returncode, g.stderr.strip()[-200:]))
    time.sleep(2)                               # the predictor's first ticks
    return {"ports": ports, "logs": logs, "model_dir": model_dir, "answers": answers,
            "model": name, "frontdoor": fd, "agent_addr": f"127.0.0.1:{ports['agent']}"}


def check_metrics(stack: dict, tmp: Path) -> tuple[dict, dict]:
    ports = stack["ports"]
    targets = {"node_agent": ports["agent_m"], "frontdoor": ports["fd_m"],
               "replica": ports["rep_m"], "predictor": ports["pred_m"]}
    promtool = shutil.which("promtool")
    out: dict = {}
    for name, port in targets.items():
        base = f"http://127.0.0.1:{port}"
        try:
            code, text = get(base + "/metrics")
        except OSError as exc:
            out[name] = {"valid": False, "error": str(exc)}
            continue
        model, path, n = labels_of(text)
        entry = {"valid": None, "has_model_label": model, "has_path_label": path,
                 "rewarm_samples": n, "healthz": get(base + "/healthz")[0],
                 "readyz": get(base + "/readyz")[0], "unknown_path": get(base + "/nope")[0],
                 "process_metrics": "process_resident_memory_bytes" in text}
        if promtool:
            p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                               text=True)
            entry["valid"] = p.returncode == 0
            entry["promtool"] = (p.stdout + p.stderr).strip()[:1000]
        else:
            entry["promtool"] = "skipped: promtool not installed (apt-get install prometheus)"
        out[name] = entry
    return out, scrape_with_prometheus(targets, tmp)


def scrape_with_prometheus(targets: dict, tmp: Path) -> dict:
    server = shutil.which("prometheus")
    if server is None:
        return {"skipped": "prometheus not installed (apt-get install prometheus)"}
    port = free_port()
    config = tmp / "prometheus.yml"
    jobs = "\n".join(f"  - job_name: rewarm-{name}\n    static_configs:\n"
                     f"      - targets: ['127.0.0.1:{p}']" for name, p in targets.items())
    config.write_text(f"global:\n  scrape_interval: 1s\nscrape_configs:\n{jobs}\n")
    log = tmp / "prometheus.log"
    proc = spawn([server, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                  f"--web.listen-address=127.0.0.1:{port}"], log)
    api = f"http://127.0.0.1:{port}/api/v1"
    health: dict = {}
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            _, body = get(api + "/targets")
            active = json.loads(body)["data"]["activeTargets"]
            health = {t["labels"]["job"]: t["health"] for t in active}
            if len(health) == len(targets) and all(h == "up" for h in health.values()):
                break
        except (OSError, ValueError, KeyError):
            pass
        if proc.poll() is not None:
            return {"error": log.read_text()[-800:]}
        time.sleep(1)
    time.sleep(2)

    def query(q: str) -> list[dict]:
        _, body = get(api + "/query?" + urllib.parse.urlencode({"query": q}))
        return [r["metric"] for r in json.loads(body)["data"]["result"]]

    ttft = query("sum by (le, path, model) (rewarm_ttft_seconds_bucket)")
    requests = query('rewarm_requests_total{model!=""}')
    node = query("sum by (tier, phase) (rewarm_node_restore_phase_seconds_count)")
    return {"targets": health,
            "ttft_series_model_path": sorted({(m.get("model", ""), m.get("path", ""))
                                              for m in ttft}),
            "requests_with_model": len(requests),
            "node_restore_phases": sorted({(m.get("tier", ""), m.get("phase", "")) for m in node})}


# --- fd overload -----------------------------------------------------------------------------

def fd_overload(stack: dict, tmp: Path, connections: int, hang_s: float, nofile: int) -> dict:
    prlimit = shutil.which("prlimit")
    if prlimit is None:
        return {"skipped": "prlimit not installed"}
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * connections)), hard))
    port = free_port()
    log = tmp / "fd_frontdoor.log"
    fd = spawn([*REWARM, "frontdoor", "--port", str(port), "--http-port", "0", "--node-agent", stack["agent_addr"],
                "--model", stack["model"]], log, prefix=[prlimit, f"--nofile={nofile}:{nofile}"])
    wait_for(log, r"front door listening", 60, fd)
    sel = selectors.DefaultSelector()
    socks, states, connect_failed = [], [], 0
    for i in range(connections):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        except OSError:
            connect_failed += 1
            s.close()
            continue
        socks.append(s)
        st = {"i": i, "sent": False, "dec": Decoder(), "answer": None, "closed": False}
        states.append(st)
        sel.register(s, selectors.EVENT_WRITE, st)
    deadline = time.time() + hang_s
    open_ = len(socks)
    while open_ and time.time() < deadline:
        for key, events in sel.select(timeout=0.2):
            s, st = key.fileobj, key.data
            if events & selectors.EVENT_WRITE and not st["sent"]:
                try:
                    s.send(pack({"op": "generate", "id": st["i"], "model": stack["model"],
                                 "tokens": [1, 2, 3], "max_tokens": 2}))
                    st["sent"] = True
                    sel.modify(s, selectors.EVENT_READ, st)
                except OSError:
                    st["closed"] = True
                    sel.unregister(s)
                    open_ -= 1
                continue
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:
                st["closed"] = True
            else:
                for msg in st["dec"].feed(data):
                    if msg.get("type") in ("done", "error") and st["answer"] is None:
                        st["answer"] = 200 if msg["type"] == "done" else msg.get("code")
            if st["closed"] or st["answer"] is not None:
                sel.unregister(s)
                open_ -= 1
    codes: dict[str, int] = {}
    hung = closed_unanswered = 0
    for st in states:
        if st["answer"] is not None:
            codes[str(st["answer"])] = codes.get(str(st["answer"]), 0) + 1
        elif st["closed"]:
            closed_unanswered += 1
        else:
            hung += 1                           # neither answered nor closed by the deadline
    for s_ in socks:
        s_.close()
    sel.close()
    return {"connections": connections, "nofile": nofile, "connect_failed": connect_failed,
            "answered_429": codes.get("429", 0), "hung": hung, "codes": codes,
            "closed_unanswered": closed_unanswered, "frontdoor_alive": fd.poll() is None,
            "log_lines": sum(1 for _ in open(log, errors="replace")),
            "log_bytes": log.stat().st_size}


# --- report ----------------------------------------------------------------------------------

def table(report: dict) -> str:
    rows = ["unit                          verify  exposure"]
    for name, u in report["units"].items():
        rows.append(f"{name:<29} {str(u.get('verify_ok')):<7} {u.get('exposure')}"
                    + (f"  ({u['skipped']})" if "skipped" in u else ""))
    rows += ["", "component     valid  model  path   healthz readyz 404  process"]
    for name, m in report["metrics"].items():
        rows.append(f"{name:<13} {str(m.get('valid')):<6} {str(m.get('has_model_label')):<6} "
                    f"{str(m.get('has_path_label')):<6} {m.get('healthz')!s:<7} "
                    f"{m.get('readyz')!s:<6} {m.get('unknown_path')!s:<4} "
                    f"{m.get('process_metrics')}")
    p = report["prometheus"]
    rows += ["", "prometheus    " + (p.get("skipped") or
                                     f"targets {p.get('targets')}; TTFT series (model, path): "
                                     f"{p.get('ttft_series_model_path')}")]
    f = report["fd_overload"]
    rows += ["", "fd overload   " + (f.get("skipped") or
             f"{f['connections']} connections at nofile={f['nofile']}: answered "
             f"{sum(f['codes'].values())} (429: {f['answered_429']}, codes {f['codes']}), "
             f"hung {f['hung']}, closed unanswered {f['closed_unanswered']}, connect failed "
             f"{f['connect_failed']}; front door alive {f['frontdoor_alive']}; log "
             f"{f['log_lines']} lines / {f['log_bytes']} bytes")]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--nofile", type=int, default=64)
    ap.add_argument("--hang-s", type=float, default=15.0)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="rewarm-ops-"))
    report: dict = {"units": check_units(), "metrics": {}, "prometheus": {}, "fd_overload": {}}
    try:
        stack = start_stack(tmp)
        report["requests"] = stack["answers"]
        report["metrics"], report["prometheus"] = check_metrics(stack, tmp)
        report["fd_overload"] = fd_overload(stack, tmp, args.connections, args.hang_s,
                                            args.nofile)
    finally:
        stop_all()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    report["load_average"] = os.getloadavg()
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
