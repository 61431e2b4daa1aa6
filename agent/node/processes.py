"""Replicas and zygotes in their own processes (``rewarm replica``), driven over the wire.

Each process is started with ``python -m agent.cli replica --listen unix:PATH ...`` and is
ready when it prints its JSON ready line (agent/replica/worker.py).  Requests use the worker's
one-request client ``call``.  A failed ``restore`` leaves the worker a zygote; the agent still
kills it (a zygote that saw a bad snapshot is not reused).  A process that dies mid-restore
answers with ConnectionError, which the agent treats like any other failed restore.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.errors import GoldenMismatch, RewarmError
from agent.node import priority
from agent.node.backend import ModelSpec

log = logging.getLogger(__name__)
_seq = itertools.count(1)
EXIT_GRACE_S = 10.0   # how long a worker that stopped answering may take to exit


class WorkerError(RewarmError, RuntimeError):
    """A worker answered an error. Attributes: ``op``, ``status`` (the wire code), ``reason``."""


def _raise_for(op: str, answer: dict) -> None:
    reason = str(answer.get("reason", ""))
    if reason.startswith("golden check failed"):
        raise GoldenMismatch(reason, prompt_index=None, position=None, expected=None, actual=None)
    raise WorkerError(f"{op} failed in the worker: {reason}", op=op, status=answer.get("code"),
                      reason=reason)


class WorkerProcess:
    """One ``rewarm replica`` process; ``argv_extra`` picks its mode."""

    def __init__(self, run_dir: Path, argv_extra: list[str], *, ready_timeout_s: float,
                 threads: int | None = None, env: dict[str, str] | None = None,
                 fsize_limit_bytes: int | None = None, data_host: str | None = None,
                 nice: int = 0) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        n = next(_seq)
        self.socket_path = run_dir / f"w{os.getpid()}-{n}.sock"
        self.log_path = run_dir / f"w{os.getpid()}-{n}.log"
        argv = [sys.executable, "-m", "agent.cli", "replica", "--listen",
                f"unix:{self.socket_path}", *argv_extra]
        if threads:
            argv += ["--threads", str(threads)]
        if data_host:
            argv += ["--data-listen", f"{data_host}:0"]
        with open(self.log_path, "ab") as log:
            # Its own process group: a terminal's Ctrl-C reaches the agent only, which drains
            # its replicas in order (in-flight requests finish); PDEATHSIG still ends the worker
            # if the agent dies (agent/replica/worker.py die_with_parent).
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log,
                                         env={**os.environ, **(env or {})},
                                         preexec_fn=_limits(fsize_limit_bytes, nice),
                                         process_group=0)
        self.pid, self.nice = self.proc.pid, nice
        self.ready = self._wait_ready(ready_timeout_s)
        self.address = self.ready["ready"]
        self.data_address = self.ready.get("data")   # TCP, for other hosts (None: unix only)

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        stdout = self.proc.stdout
        assert stdout is not None, "started with stdout=PIPE"
        sel = selectors.DefaultSelector()
        sel.register(stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                self.kill()
                raise TimeoutError(f"worker pid {self.pid} not ready within {timeout_s} s "
                                   f"(log: {self.log_path})")
            chunk = os.read(stdout.fileno(), 4096)
            if not chunk:
                self.proc.wait()
                raise RuntimeError(f"worker pid {self.pid} exited with {self.proc.returncode} "
                                   f"before it was ready; log: {self.log_path}")
            line += chunk
        sel.close()
        return json.loads(line.splitlines()[0])

    def call(self, message: dict, timeout_s: float) -> dict[str, Any]:
        """One request; returns the final answer's result. Raises WorkerError, GoldenMismatch,
        ConnectionError, TimeoutError."""
        from agent.replica.worker import call

        answers = call(self.address, {"id": next(_seq), **message}, timeout_s=timeout_s)
        final = answers[-1]
        if final.get("type") == "error":
            _raise_for(message.get("op", "?"), final)
        return {"answers": answers, **(final.get("result") or {})}

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self.socket_path.unlink(missing_ok=True)
        try:
            if self.log_path.stat().st_size == 0:   # nothing said: nothing worth keeping
                self.log_path.unlink()
        except FileNotFoundError:
            pass

    def alive(self) -> bool:
        return self.proc.poll() is None


def device_env(device: str) -> dict[str, str]:
    """``cuda:N`` → the worker sees only GPU N (as its cuda:0); ``cpu`` → it sees none."""
    if device.startswith("cuda"):
        _, _, index = device.partition(":")
        return {"CUDA_VISIBLE_DEVICES": index or "0"}
    return {"CUDA_VISIBLE_DEVICES": ""}


def device_args(device: str) -> list[str]:
    """The worker's ``--device``: ``cuda`` for any GPU (it sees only its own, as cuda:0,
    through :func:`device_env`), ``cpu`` otherwise."""
    return ["--device", "cuda" if device.startswith("cuda") else "cpu"]


def _limits(fsize_limit_bytes: int | None, nice: int):
    """preexec_fn capping the files a worker may write (RLIMIT_FSIZE) and lowering its CPU
    priority by ``nice`` (agent/node/priority.py), or None when neither applies."""
    if fsize_limit_bytes is None and nice <= 0:
        return None

    def apply() -> None:
        import resource

        if fsize_limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit_bytes, fsize_limit_bytes))
        if nice > 0:
            os.nice(nice)
    return apply


class ProcessReplica:
    """``restore_io`` (gds | compat | host) and ``fallback`` (why a device restore read
    through host memory) as the worker's restore answer gave them; None after a boot."""

    def __init__(self, replica_id: str, worker: WorkerProcess, timeout_s: float,
                 restored: dict[str, Any] | None = None) -> None:
        self.replica_id, self.worker, self.timeout_s = replica_id, worker, timeout_s
        self.address, self.pid = worker.address, worker.pid
        self.data_address = worker.data_address
        self.restore_io = (restored or {}).get("restore_io")
        self.fallback = (restored or {}).get("fallback")

    def generate(self, prompts: list[list[int]], max_tokens: int,
                 seed: int | None = None) -> list[list[int]]:
        out = []
        for prompt in prompts:
            res = self.worker.call({"op": "generate", "tokens": list(prompt),
                                    "max_tokens": max_tokens, "seed": seed}, self.timeout_s)
            out.append([t for a in res["answers"] if a.get("type") == "tokens" for t in a["tokens"]])
        return out

    def stats(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The worker's stats, waiting at most ``timeout_s`` (default: the request timeout);
        OSError (a socket timeout) when it does not answer in time."""
        res = self.worker.call({"op": "stats"}, self.timeout_s if timeout_s is None else timeout_s)
        res.pop("answers", None)
        return res

    def alive(self) -> bool:
        return self.worker.alive()

    def in_flight(self) -> int:
        """Sequences the worker is serving or holds waiting; 0 once it has exited.  Raises
        ConnectionError/FileNotFoundError when its socket cannot be reached but the process
        still runs ``EXIT_GRACE_S`` later (it is stuck, not exiting)."""
        if not self.worker.alive():
            return 0
        try:
            st = self.stats()
        except (ConnectionError, FileNotFoundError) as exc:
            # An exiting worker stops answering and removes its socket before it is gone.
            try:
                self.worker.proc.wait(timeout=EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                raise exc from None
            return 0
        return int(st.get("active_seqs", 0)) + int(st.get("waiting_seqs", 0))

    def capture(self, dest: Path) -> None:
        self.worker.call({"op": "capture", "dest": str(dest)}, self.timeout_s)

    def shutdown(self) -> None:
        try:
            if self.worker.alive():
                self.worker.call({"op": "shutdown"}, 10.0)
                self.worker.proc.wait(timeout=10.0)
        except (OSError, RewarmError, subprocess.TimeoutExpired):
            pass
        finally:
            self.worker.kill()


class ProcessZygote:
    def __init__(self, device: str, worker: WorkerProcess, timeout_s: float,
                 warm: Path | None = None) -> None:
        self.device, self.worker, self.timeout_s = device, worker, timeout_s
        self.pid, self.warm = worker.pid, warm

    def restore(self, snapshot: Path, replica_id: str) -> ProcessReplica:
        """Back to normal priority if it waited at background priority (agent/node/priority.py),
        then restore.  Raises GoldenMismatch, WorkerError, ConnectionError (the process died),
        TimeoutError."""
        if self.worker.nice:
            try:
                priority.to_normal(self.pid)
            except PermissionError as exc:   # slower at nice 10, but the snapshot is sound
                log.warning("zygote %s stays at nice %d for its restore: setting it back to "
                            "nice 0 was refused (%s)", self.pid, self.worker.nice, exc)
        answer = self.worker.call({"op": "restore", "snapshot": str(snapshot)}, self.timeout_s)
        return ProcessReplica(replica_id, self.worker, self.timeout_s, answer)

    def alive(self) -> bool:
        return self.worker.alive()

    def kill(self) -> None:
        self.worker.kill()


@dataclass
class ProcessBackend:
    """Workers as child processes; sockets and logs under ``run_dir``."""

    run_dir: Path
    buffer_mib: int = 1024
    threads: int | None = None
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    fsize_limit_bytes: int | None = None   # RLIMIT_FSIZE for new workers (fault injection)
    data_host: str | None = None   # workers also listen on DATA_HOST:0 (TCP) for other hosts
    # a waiting zygote's nice value (agent/node/priority.py); 0 where it could not be undone
    zygote_nice: int = priority.ZYGOTE_NICE

    def __post_init__(self) -> None:
        if self.zygote_nice > 0 and not priority.can_restore_normal():
            log.info("zygotes start at normal priority: setting a zygote back to nice 0 for "
                     "its restore needs CAP_SYS_NICE or RLIMIT_NICE >= 20")
            self.zygote_nice = 0

    def zygote(self, device: str, *, warm: Path | None = None,
               background: bool = True) -> ProcessZygote:
        """A ``rewarm replica --zygote`` process; ``warm``: ``--warm SNAPSHOT`` (its first-call
        costs paid before it is ready); ``background``: at nice ``zygote_nice``."""
        extra = ["--zygote", "--buffer-mib", str(self.buffer_mib), *device_args(device)]
        if warm is not None:
            extra += ["--warm", str(warm)]
        worker = WorkerProcess(Path(self.run_dir), extra,
                               ready_timeout_s=self.ready_timeout_s, threads=self.threads,
                               env=device_env(device), fsize_limit_bytes=self.fsize_limit_bytes,
                               data_host=self.data_host,
                               nice=max(0, self.zygote_nice) if background else 0)
        return ProcessZygote(device, worker, self.request_timeout_s, warm)

    def cold_boot(self, spec: ModelSpec, device: str, replica_id: str) -> ProcessReplica:
        extra = ["--model-dir", str(spec.model_dir), "--replica-id", replica_id,
                 *device_args(device)]
        if spec.release is not None:
            extra += ["--release", str(spec.release)]
        worker = WorkerProcess(Path(self.run_dir), extra, ready_timeout_s=self.ready_timeout_s,
                               threads=self.threads, env=device_env(device),
                               fsize_limit_bytes=self.fsize_limit_bytes, data_host=self.data_host)
        return ProcessReplica(replica_id, worker, self.request_timeout_s)
