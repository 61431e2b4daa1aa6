"""Fault matrix: inject each fault into a running node agent and record what happened.

    python bench/fault_matrix.py --json var/bench/fault_matrix.json          # imported SmolLM2
    python bench/fault_matrix.py --preset tiny --json var/bench/fm_tiny.json # quick, synthetic

One NodeAgent runs with replicas in their own processes (``rewarm replica``), a remote tier in
a directory, and registration through py-consul against the Consul HTTP stand-in of
tests/cluster (this benchmark's only use of tests/).  A traffic thread sends generate requests
all the time to every warm replica (retrying on another replica when one fails, as the front
door does) and compares every token with the reference recorded from the first cold boot.

Faults: one flipped byte in a chunk; truncated data file; manifest digest wrong (the agent runs
without a node key, so the envelope's SHA-256 is what a tamperer must forge); each pin
mismatched; golden tokens mismatched; kill -9 during snapshot capture; disk full during capture
(RLIMIT_FSIZE on the capturing replica); remote tier unavailable during staging; Consul
stand-in down at start and mid-run; zygote killed mid-restore.

Per fault: ``outcome`` (the path that served and the failed steps), ``recovered`` (a warm
replica serving the reference tokens afterwards, and no corrupt snapshot left ready),
``wrong_tokens_served`` and ``requests_lost`` (from the traffic thread and the checks on the
new replica).  Target: every fault recovered, zero wrong tokens, zero requests lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent.cluster.consul_registry import ConsulRegistry, consul_client  # noqa: E402
from agent.node import capture as cap  # noqa: E402
from agent.node.agent import AgentConfig, NodeAgent  # noqa: E402
from agent.node.backend import ModelSpec  # noqa: E402
from agent.node.inventory import Inventory  # noqa: E402
from agent.node.lifecycle import ReplicaState  # noqa: E402
from agent.node.processes import ProcessBackend  # noqa: E402
from agent.snapshot.catalog import Catalog  # noqa: E402
from agent.snapshot.format import MANIFEST_NAME, Pins  # noqa: E402
from agent.snapshot.manifest import encode_manifest, read_manifest  # noqa: E402
from agent.snapshot.store import LocalStore  # noqa: E402

# Every fault, in the order they run (``--faults`` picks a subset by these names).
FAULT_NAMES = ("consul_down_at_start", "flipped_byte_in_chunk", "truncated_data_file",
               "manifest_digest_wrong",
               *(f"pin_mismatch_{f.name}" for f in dataclasses.fields(Pins)),
               "golden_tokens_mismatch", "kill9_during_capture", "disk_full_during_capture",
               "remote_unavailable_during_staging", "consul_down_mid_run",
               "zygote_killed_mid_restore")

PROMPTS = [[1, 40, 31, 179, 28], [50, 34, 28, 46, 30], [12, 34, 56, 78]]  # < 256: any vocab here
MAX_TOKENS, SEED = 6, 7


class Consul:
    """The Consul stand-in on one fixed port that can go down and come back (empty)."""

    def __init__(self) -> None:
        from tests.cluster.consul_standin import ConsulStandIn

        self._cls = ConsulStandIn
        probe = ConsulStandIn()
        self.port = probe.port
        probe.server.server_close()
        self.standin = None

    def up(self) -> None:
        s = self._cls()
        s.server.server_close()
        s.server = ThreadingHTTPServer(("127.0.0.1", self.port), s.server.RequestHandlerClass)
        s.server.daemon_threads = True
        s._thread = threading.Thread(target=s.server.serve_forever, kwargs={"poll_interval": 0.05},
                                     daemon=True)
        self.standin = s.start()

    def down(self) -> None:
        if self.standin is not None:
            self.standin.stop()
            self.standin = None


class Traffic:
    """Requests to every warm replica, all the time; tokens compared with the reference."""

    def __init__(self, agent: NodeAgent, model: str, reference: list[list[int]]) -> None:
        self.agent, self.model, self.reference = agent, model, reference
        self.stop = threading.Event()
        self.sent = self.lost = self.wrong = 0
        self._n = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def counts(self) -> tuple[int, int, int]:
        return self.sent, self.lost, self.wrong

    def one(self, handle=None) -> None:
        i = self._n % len(PROMPTS)
        self._n += 1
        self.sent += 1
        for attempt in range(4):
            target = handle
            if target is None:
                warm = [r.handle for r in self.agent.live_replicas(self.model)
                        if r.lifecycle.state is ReplicaState.WARM and r.handle is not None]
                if not warm:
                    time.sleep(0.2)
                    continue
                target = warm[(self._n + attempt) % len(warm)]
            try:
                got = target.generate([PROMPTS[i]], MAX_TOKENS, seed=SEED)[0]
            except Exception:
                handle = None          # that replica failed: the next try goes elsewhere
                continue
            want = self.reference[i]
            self.wrong += sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))
            return
        self.lost += 1

    def _run(self) -> None:
        while not self.stop.is_set():
            self.one()
            time.sleep(0.05)


def build(work: Path, model_dir: Path, consul: Consul, threads: int) -> NodeAgent:
    size_mib = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) >> 20
    backend = ProcessBackend(work / "run", buffer_mib=size_mib + 64, threads=threads,
                             ready_timeout_s=600, request_timeout_s=600)
    agent = NodeAgent(AgentConfig(node_id="bench", zygotes_per_device=1, remote_root=work / "remote",
                                  restore_timeout_s=300),
                      models=[ModelSpec(model_dir)], backend=backend,
                      catalog=Catalog(work / "catalog.db"),
                      store=LocalStore(work / "nvme", 64 << 30),
                      registry=ConsulRegistry(consul_client(f"127.0.0.1:{consul.port}")),
                      inventory=Inventory.detect(announce=False))
    agent.registrar.backoff_s, agent.registrar.max_backoff_s = 0.1, 0.5
    return agent


class Matrix:
    def __init__(self, agent: NodeAgent, consul: Consul, work: Path) -> None:
        self.agent, self.consul, self.work = agent, consul, work
        self.model = next(iter(agent.models))
        self.spec = agent.models[self.model]
        self.results: list[dict] = []
        self.pristine: Path | None = None
        self.remote_uri: str | None = None
        self.n = 0

    # -- state helpers ---------------------------------------------------------------------
    def ready_rows(self):
        return self.agent.catalog.snapshots(self.model, status="ready")

    def retire_ready(self) -> None:
        for row in self.ready_rows():
            self.agent.catalog.set_status(row.snapshot_id, "stale", "fault matrix: reset")
            self.agent.store.remove(row.snapshot_id, force=True)

    def fresh_local(self) -> Path:
        """A known-good ready local copy (from the first capture) as the newest snapshot."""
        self.retire_ready()
        self.n += 1
        sid = f"{self.model}-good-{self.n}"
        shutil.copytree(self.pristine, self.agent.store.path(sid))
        cap.register_snapshot(self.agent.catalog, self.agent.store, sid, self.spec,
                              remote_uri=self.remote_uri)
        self.agent.catalog.set_status(sid, "ready", "fault matrix: known good")
        return self.agent.store.path(sid)

    def wait_capture(self):
        future = self.agent.captures.get(self.spec.key)
        return future.result(timeout=900) if future is not None else None

    def check(self, info: dict, traffic: Traffic, k: int = 3) -> tuple[bool, int, int]:
        """Requests straight to the replica the fault produced."""
        before_lost, before_wrong = traffic.lost, traffic.wrong
        handle = self.agent.replicas[info["replica"]].handle
        for _ in range(k):
            traffic.one(handle)
        ok = traffic.lost == before_lost and traffic.wrong == before_wrong
        return ok, traffic.lost - before_lost, traffic.wrong - before_wrong

    def retire_replica(self, info: dict) -> None:
        rec = self.agent.replicas.get(info["replica"])
        if rec is not None and rec.lifecycle.state in (ReplicaState.WARM, ReplicaState.SUSPENDED):
            self.agent.drain(info["replica"], timeout_s=30, force=True)

    def run(self, name: str, fn, traffic: Traffic) -> None:
        sent0, lost0, wrong0 = traffic.counts()
        start = time.perf_counter()
        try:
            outcome, recovered = fn(traffic)
        except Exception as exc:  # a fault the agent did not survive is a result, not a crash
            logging.exception("fault %s", name)
            outcome, recovered = f"bench error: {type(exc).__name__}: {exc}", False
        sent, lost, wrong = traffic.counts()
        no_bad_ready = all(r.status == "ready" for r in self.ready_rows())
        self.results.append({"name": name, "outcome": outcome, "recovered": bool(recovered),
                             "wrong_tokens_served": wrong - wrong0, "requests_lost": lost - lost0,
                             "requests": sent - sent0, "seconds": round(time.perf_counter() - start, 2),
                             "no_corrupt_ready": no_bad_ready})
        print(f"  {name}: {outcome} recovered={recovered} ({time.perf_counter() - start:.1f} s)",
              flush=True)

    @staticmethod
    def describe(info: dict) -> str:
        steps = [f"{a['path']}:{a.get('error')}" for a in info.get("attempts", [])]
        return " -> ".join(steps + [info["path"]])

    def restore_fault(self, inject, traffic: Traffic) -> tuple[str, bool]:
        path = self.fresh_local()
        inject(path)
        info = self.agent.restore(self.model)
        self.wait_capture()
        ok, _, _ = self.check(info, traffic)
        self.retire_replica(info)
        return self.describe(info), ok and bool(info.get("attempts"))

    # -- the faults --------------------------------------------------------------------------
    def faults(self) -> list[tuple[str, object]]:
        def flip(path: Path) -> None:
            data = path / "data-00000.bin"
            with open(data, "r+b") as f:
                f.seek(4096 + 123)
                b = f.read(1)
                f.seek(4096 + 123)
                f.write(bytes([b[0] ^ 0x10]))

        def truncate(path: Path) -> None:
            data = path / "data-00000.bin"
            os.truncate(data, data.stat().st_size // 2)

        def digest(path: Path) -> None:
            import msgpack

            env = msgpack.unpackb((path / MANIFEST_NAME).read_bytes(), raw=False)
            env["sha256"] = bytes(32)
            (path / MANIFEST_NAME).write_bytes(msgpack.packb(env, use_bin_type=True))

        def rewrite(path: Path, **changes) -> None:
            m = read_manifest(path)
            (path / MANIFEST_NAME).write_bytes(encode_manifest(dataclasses.replace(m, **changes)))

        def pin(name: str):
            def inject(path: Path) -> None:
                pins = read_manifest(path).pins
                other = {"format_version": pins.format_version + 1, "torch": "2.0.0",
                         "cuda_driver": "570.86.15", "gpu_name": "NVIDIA H200", "gpu_cc": "9.0",
                         "cpu_isa": "AVX512_BF16" if pins.cpu_isa != "AVX512_BF16" else "AVX2",
                         "python_abi": "cpython-312-x86_64-linux-gnu", "rewarm": "0.0.0"}[name]
                rewrite(path, pins=dataclasses.replace(pins, **{name: other}))
            return inject

        def golden(path: Path) -> None:
            g = read_manifest(path).golden
            expected = [list(t) for t in g.expected]
            expected[0][0] = (expected[0][0] + 1) % 1000
            rewrite(path, golden=dataclasses.replace(g, expected=expected))

        out = [("flipped_byte_in_chunk", lambda t: self.restore_fault(flip, t)),
               ("truncated_data_file", lambda t: self.restore_fault(truncate, t)),
               ("manifest_digest_wrong", lambda t: self.restore_fault(digest, t))]
        out += [(f"pin_mismatch_{f.name}", (lambda inj: lambda t: self.restore_fault(inj, t))(pin(f.name)))
                for f in dataclasses.fields(Pins)]
        out += [("golden_tokens_mismatch", lambda t: self.restore_fault(golden, t)),
                ("kill9_during_capture", self.kill9_capture),
                ("disk_full_during_capture", self.disk_full_capture),
                ("remote_unavailable_during_staging", self.remote_unavailable),
                ("consul_down_mid_run", self.consul_mid_run),
                ("zygote_killed_mid_restore", self.zygote_killed)]
        assert tuple(n for n, _ in out) == FAULT_NAMES[1:], "FAULT_NAMES is out of date"
        return out

    def _partial_seen(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(p.name.endswith(".partial") for p in self.agent.store.root.iterdir()):
                return True
            time.sleep(0.005)
        return False

    def _no_partials(self) -> bool:
        return not any(p.name.endswith(".partial") for p in self.agent.store.root.iterdir())

    def kill9_capture(self, traffic: Traffic) -> tuple[str, bool]:
        self.retire_ready()
        info = self.agent.restore(self.model)
        handle = self.agent.replicas[info["replica"]].handle
        seen = self._partial_seen(120)
        os.kill(handle.pid, signal.SIGKILL)
        killed_row = self.wait_capture()
        time.sleep(0.5)  # the agent loop notices the dead process and deregisters it
        dead = self.agent.replicas[info["replica"]].lifecycle.state is ReplicaState.DEAD
        again = self.agent.restore(self.model)
        row = self.wait_capture()
        ok, _, _ = self.check(again, traffic)
        self.retire_replica(again)
        good = (ok and dead and killed_row is None and row is not None and row.status == "ready"
                and self._no_partials())
        return (f"killed mid-write={seen}; capture failed closed={killed_row is None}; replica "
                f"marked dead={dead}; next: {self.describe(again)}, new snapshot "
                f"{row.status if row else None}"), good

    def disk_full_capture(self, traffic: Traffic) -> tuple[str, bool]:
        self.retire_ready()
        backend = self.agent.backend
        backend.fsize_limit_bytes = max(4096, self.pristine_bytes // 3)
        try:
            info = self.agent.restore(self.model)
        finally:
            backend.fsize_limit_bytes = None
        row = self.wait_capture()
        ok, _, _ = self.check(info, traffic)
        self.retire_replica(info)
        good = ok and row is None and not self.ready_rows() and self._no_partials()
        return (f"{self.describe(info)}; capture under RLIMIT_FSIZE failed closed="
                f"{row is None}; replica kept serving={ok}"), good

    def remote_unavailable(self, traffic: Traffic) -> tuple[str, bool]:
        remote = self.agent.config.remote_root
        away = remote.with_name(remote.name + ".away")
        path = self.fresh_local()
        with open(path / "data-00000.bin", "r+b") as f:
            f.seek(4096)
            f.write(b"\xff\xfe")
        os.rename(remote, away)
        try:
            info = self.agent.restore(self.model)
            self.wait_capture()
        finally:
            shutil.rmtree(remote, ignore_errors=True)
            os.rename(away, remote)
        ok, _, _ = self.check(info, traffic)
        self.retire_replica(info)
        return self.describe(info), ok and info["path"] == "cold_boot"

    def wait_registered(self, ids: list[str], timeout_s: float = 20.0) -> float | None:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            try:
                have = {i.id for i in self.agent.registrar.registry.healthy("rewarm-replica")}
            except Exception:
                have = set()
            if set(ids) <= have:
                return time.monotonic() - start
            time.sleep(0.1)
        return None

    def consul_at_start(self, baseline: dict, traffic: Traffic) -> tuple[str, bool]:
        down = not self.agent.registrar.state.healthy
        self.consul.up()
        took = self.wait_registered([baseline["replica"]])
        return (f"served while Consul was down={down}; registered {took:.1f} s after it came up"
                if took is not None else "never registered"), down and took is not None

    def consul_mid_run(self, traffic: Traffic) -> tuple[str, bool]:
        self.consul.down()
        self.fresh_local()
        info = self.agent.restore(self.model)
        ok, _, _ = self.check(info, traffic)
        self.consul.up()   # a fresh Consul: everything must be registered again
        took = self.wait_registered([self.baseline["replica"], info["replica"]])
        self.retire_replica(info)
        return (f"{self.describe(info)} while down; served={ok}; all re-registered "
                f"{took:.1f} s after Consul returned" if took is not None
                else "not re-registered"), ok and took is not None

    def zygote_killed(self, traffic: Traffic) -> tuple[str, bool]:
        self.fresh_local()
        self.agent.refill_pool()
        zygote = self.agent.pool[self.agent.inventory.devices[0]][0]
        original = zygote.restore

        def dying(snapshot, replica_id):
            threading.Timer(0.05, os.kill, (zygote.pid, signal.SIGKILL)).start()
            return original(snapshot, replica_id)

        zygote.restore = dying
        info = self.agent.restore(self.model)
        self.wait_capture()
        ok, _, _ = self.check(info, traffic)
        self.retire_replica(info)
        return self.describe(info), ok and bool(info["attempts"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where to write the results")
    parser.add_argument("--model-dir", default=None, help="default: the imported SmolLM2-135M")
    parser.add_argument("--preset", default=None, help="a synthetic model instead (tiny, small)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--faults", default=None,
                        help="comma-separated subset of: " + ", ".join(FAULT_NAMES))
    parser.add_argument("--work", default=str(REPO / "var" / "bench" / "fault_matrix"))
    args = parser.parse_args(argv)
    unknown = sorted(set(args.faults.split(",")) - set(FAULT_NAMES)) if args.faults else []
    if unknown:
        parser.error(f"unknown fault(s) {', '.join(unknown)}; known: {', '.join(FAULT_NAMES)}")
    logging.basicConfig(level=logging.CRITICAL)   # the faults log errors on purpose

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if args.preset:
        from agent.replica.synthetic import make_synthetic

        model_dir = make_synthetic(work / "models" / args.preset, args.preset, seed=1)
        # The replica's default KV length (512) must fit the model's context; the tiny preset
        # has 256 positions.  RoPE is computed per position, so widening it keeps the weights.
        config = json.loads((model_dir / "config.json").read_text())
        config["max_position_embeddings"] = max(1024, config["max_position_embeddings"])
        (model_dir / "config.json").write_text(json.dumps(config))
    elif args.model_dir:
        model_dir = Path(args.model_dir)
    else:
        from agent.replica.smollm2 import ensure_smollm2

        model_dir = ensure_smollm2()

    consul = Consul()                      # down at start
    agent = build(work, model_dir, consul, args.threads)
    stop = threading.Event()
    loop = threading.Thread(target=agent.run, args=(stop, 0.2), daemon=True)
    loop.start()
    matrix = Matrix(agent, consul, work)
    print(f"model {matrix.spec.key} from {model_dir}; first boot and capture ...", flush=True)
    baseline = agent.restore(matrix.model)
    row0 = matrix.wait_capture()
    if row0 is None or row0.status != "ready" or row0.remote_uri is None:
        print(f"error: the first capture did not become ready and durable: {row0}", file=sys.stderr)
        return 1
    matrix.baseline = baseline
    matrix.pristine = work / "pristine"
    shutil.copytree(row0.path, matrix.pristine)
    matrix.pristine_bytes = row0.size_bytes
    matrix.remote_uri = row0.remote_uri
    handle = agent.replicas[baseline["replica"]].handle
    reference = [handle.generate([p], MAX_TOKENS, seed=SEED)[0] for p in PROMPTS]
    traffic = Traffic(agent, matrix.model, reference)
    traffic.thread.start()
    wanted = set(args.faults.split(",")) if args.faults else None
    try:
        if wanted is None or "consul_down_at_start" in wanted:
            matrix.run("consul_down_at_start", lambda t: matrix.consul_at_start(baseline, t), traffic)
        else:
            consul.up()
        for name, fn in matrix.faults():
            if wanted is None or name in wanted:
                matrix.run(name, fn, traffic)
    finally:
        traffic.stop.set()
        traffic.thread.join(60)
        stop.set()
        agent.close()
        consul.down()

    rows = matrix.results
    print(f"\n{'fault':38} {'recovered':>9} {'wrong_tok':>9} {'lost':>5} {'reqs':>5} {'s':>7}")
    for r in rows:
        print(f"{r['name']:38} {str(r['recovered']):>9} {r['wrong_tokens_served']:>9} "
              f"{r['requests_lost']:>5} {r['requests']:>5} {r['seconds']:>7.1f}")
    passed = all(r["recovered"] and r["wrong_tokens_served"] == 0 and r["requests_lost"] == 0
                 for r in rows)
    print(f"\nall faults recovered with zero wrong tokens and zero lost requests: {passed}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": matrix.spec.key, "model_dir": str(model_dir),
                               "traffic_requests": traffic.sent, "passed": passed,
                               "faults": rows}, indent=2))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
