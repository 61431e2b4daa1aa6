"""Fixtures of the node agent tests: a fake CUDA driver built with gcc, the cffi declarations."""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

from concurrent.futures import ThreadPoolExecutor

from agent.clock import ManualClock
from agent.cluster.local import LocalRegistry
from agent.node.agent import AgentConfig, NodeAgent
from agent.node.backend import InProcessBackend, ModelSpec
from agent.node.inventory import Inventory
from agent.snapshot.catalog import Catalog
from agent.snapshot.store import LocalStore
from tests.standins import consul_clock, consul_standin, nomad_standin  # noqa: F401  (fixtures)

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent


def _compile(tmp: pathlib.Path, name: str, *defines: str) -> pathlib.Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the fake libcuda")
    out = tmp / name
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", *defines, "-o", str(out),
                    str(HERE / "fake_libcuda.c")], check=True)
    return out


@pytest.fixture(scope="session")
def fake_libcuda_path(tmp_path_factory) -> pathlib.Path:
    """A driver with the r570 checkpoint API."""
    return _compile(tmp_path_factory.mktemp("fakecuda"), "libcuda_fake.so")


@pytest.fixture(scope="session")
def old_libcuda_path(tmp_path_factory) -> pathlib.Path:
    """A driver without the cuCheckpointProcess* symbols (older than r570)."""
    return _compile(tmp_path_factory.mktemp("fakecuda_old"), "libcuda_old.so", "-DOLD_DRIVER")


@pytest.fixture(scope="session")
def cuda_ffi():
    """The cffi declarations from ext/cuda_checkpoint_build.py (an FFI that can dlopen)."""
    spec = importlib.util.spec_from_file_location(
        "cuda_checkpoint_build", REPO / "ext" / "cuda_checkpoint_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffibuilder


@pytest.fixture
def fake(fake_libcuda_path):
    """ctypes handle on the fake driver's controls (same loaded library as cffi's dlopen)."""
    lib = ctypes.CDLL(str(fake_libcuda_path))
    lib.fake_last_new_uuid.restype = ctypes.c_char_p
    lib.fake_last_timeout_ms.restype = ctypes.c_uint
    lib.fake_reset()
    yield lib
    lib.fake_reset()


# call indices of fake_set_result / fake_calls
C_STATE, C_TID, C_LOCK, C_CHECKPOINT, C_RESTORE, C_UNLOCK = range(6)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> pathlib.Path:
    from agent.replica.synthetic import make_synthetic

    model = make_synthetic(tmp_path_factory.mktemp("models") / "tiny", "tiny", seed=3)
    return widen_context(model)


def widen_context(model_dir: pathlib.Path, positions: int = 1024) -> pathlib.Path:
    """Raise max_position_embeddings (RoPE is computed per position, the weights do not change)
    so the replica's default KV length (512) fits the tiny preset's 256-token context."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


class DownableRegistry(LocalRegistry):
    """The embedded registry with an off switch (stands in for Consul going away)."""

    def __init__(self, clock):
        super().__init__(clock)
        self.down = False
        self.calls = 0

    def _gate(self):
        self.calls += 1
        if self.down:
            raise ConnectionError("registry unreachable")

    def register(self, instance, ttl_s):
        self._gate()
        super().register(instance, ttl_s)

    def pass_ttl(self, instance_id, meta=None):
        self._gate()
        super().pass_ttl(instance_id, meta)

    def deregister(self, instance_id):
        self._gate()
        super().deregister(instance_id)


@pytest.fixture
def make_agent(tmp_path, tiny_dir):
    made = []

    def make(remote: bool = False, registry=None, capacity_bytes: int = 1 << 30, summary=None,
             clock=None, node_meta=None, **cfg):
        clock = clock or ManualClock(1000.0)
        registry = registry or DownableRegistry(clock)
        state = tmp_path / f"state{len(made)}"
        catalog = Catalog(state.parent / f"catalog{len(made)}.db", clock=clock)
        store = LocalStore(state / "nvme", capacity_bytes, clock=clock)
        config = AgentConfig(node_id="n1", remote_root=(tmp_path / "remote") if remote else None,
                             **cfg)
        agent = NodeAgent(config, models=[ModelSpec(tiny_dir)],
                          backend=InProcessBackend(buffer_bytes=1 << 20), catalog=catalog,
                          store=store, registry=registry, inventory=Inventory([], "test: cpu"),
                          clock=clock, executor=ThreadPoolExecutor(2),
                          sleep=lambda s: clock.advance(s), summary=summary,
                          node_meta=node_meta)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.executor.shutdown(wait=True)


