"""tests/fake_kvikio.py against the kvikio wheel the Makefile installs: the same public names
and signatures, reachable after the same imports, the same refusals of the same arguments.

The real package is read in fresh interpreters (tests/snapshot/kvikio_shape.py): what is an
attribute of it depends on what was imported, and this process may have imported anything.
Without libcuda.so.1 the wheel imports, opens files and checks arguments; its reads need the
driver, so those are compared up to the point where the real one would start reading."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agent.snapshot import gpu
from tests.fake_kvikio import INSTRUMENTS, VERSION, Defaults, FakeKvikio
from tests.snapshot import kvikio_shape

REPO = Path(__file__).resolve().parents[2]


def _real(stage: str) -> dict:
    p = subprocess.run([sys.executable, str(REPO / "tests" / "snapshot" / "kvikio_shape.py"), stage],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"the installed kvikio could not be read ({stage}): {p.stderr[-2000:]}"
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def real_bare() -> dict:
    return _real("bare")


@pytest.fixture(scope="module")
def real_loaded() -> dict:
    return _real("loaded")


def _offers(fake: FakeKvikio) -> dict[str, dict]:
    shape = kvikio_shape.describe(fake)
    return {k: v for k, v in shape.items() if k.split(".")[1] not in INSTRUMENTS}


def _more_than_real(fake: dict[str, dict], real: dict[str, dict]) -> dict[str, tuple]:
    return {k: (v, real.get(k)) for k, v in fake.items() if real.get(k) != v}


def test_the_fake_follows_the_installed_version(real_loaded):
    assert real_loaded["shape"]["kvikio.__version__"]["value"] == VERSION


def test_every_name_the_fake_offers_is_the_real_ones_after_the_same_imports(real_bare, real_loaded):
    """Name, kind and signature (parameter names, kinds, defaults) of everything public."""
    bare, loaded = _offers(FakeKvikio(bare=True)), _offers(FakeKvikio())
    assert _more_than_real(bare, real_bare["shape"]) == {}
    assert _more_than_real(loaded, real_loaded["shape"]) == {}
    # what the comparison covers: the fake is not empty, and defaults appears only once imported
    assert {"kvikio.CuFile.pread", "kvikio.cufile.IOFuture.get", "kvikio.CompatMode"} <= set(bare)
    assert "kvikio.defaults" not in bare and "kvikio.defaults" not in real_bare["shape"]
    assert {"kvikio.defaults.set", "kvikio.defaults.get",
            "kvikio.defaults.is_compat_mode_preferred"} <= set(loaded)
    assert not INSTRUMENTS & {k.split(".")[1] for k in real_loaded["shape"]}


def test_the_comparison_catches_a_kinder_fake(real_bare):
    """A fake offering ``defaults`` after a bare import (the old fake did), or a keyword the
    real pread lacks, differs from the real package."""
    kind = FakeKvikio(bare=True)
    kind.defaults = Defaults()
    assert "kvikio.defaults" in _more_than_real(_offers(kind), real_bare["shape"])

    class Kinder(kind.CuFile):
        def pread(self, buf, size=None, file_offset=0, task_size=None, nbytes=None):
            raise AssertionError
    kind.CuFile = Kinder
    assert "kvikio.CuFile.pread" in _more_than_real(_offers(kind), real_bare["shape"])


def test_defaults_set_and_get_refuse_what_kvikio_refuses(real_loaded):
    assert kvikio_shape.settings_outcomes(FakeKvikio()) == real_loaded["settings"]


def test_pread_and_cufile_check_arguments_as_kvikio_does(real_loaded, tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(bytes(range(64)))
    assert kvikio_shape.pread_outcomes(FakeKvikio(), f) == real_loaded["pread"]


def test_defaults_appears_when_imported_as_python_imports_submodules():
    fake = FakeKvikio(bare=True)
    assert not hasattr(fake, "defaults")
    with fake.installed():
        import kvikio
        assert kvikio is fake and not hasattr(kvikio, "defaults")
        import kvikio.defaults  # noqa: F401 - the statement under test
        assert kvikio.defaults.get("task_size") == 4 << 20
    assert "kvikio" not in sys.modules or sys.modules["kvikio"] is not fake


def test_a_load_kvikio_that_skips_the_defaults_import_fails_here_as_on_the_gpu(monkeypatch):
    """kvikio 26.10's ``import kvikio`` leaves ``kvikio.defaults`` unset: a loader without
    ``import kvikio.defaults`` made io_path raise AttributeError on every device restore."""
    def forgetful():
        import kvikio
        return kvikio
    monkeypatch.setattr(gpu, "load_kvikio", forgetful)
    fake = FakeKvikio()
    with pytest.raises(AttributeError, match="defaults"):
        gpu.io_path(fake)


def test_a_failed_read_and_the_futures_state_are_as_kvikio_leaves_them(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(bytes(range(64)))
    fake = FakeKvikio(fail_at=10)
    with fake.CuFile(f, "r") as h:
        fut = h.pread(torch.empty(16, dtype=torch.uint8), 16, 0)
        assert fut.done()
        with pytest.raises(RuntimeError, match="Input/output error"):
            fut.get()
        with pytest.raises(RuntimeError, match="No associated state"):
            fut.done()
        buf = np.zeros(16, dtype=np.uint8)
        assert h.read(buf, 16, 32) == 16 and buf.tolist() == list(range(32, 48))
    assert h.closed and fake.reads == [("data.bin", 0, 16), ("data.bin", 32, 16)]
    with pytest.raises(RuntimeError, match="closed"):
        h.pread(buf, 16, 0)


def test_an_f_contiguous_tensor_is_filled_in_memory_order(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(bytes(range(64)))
    t = torch.zeros(8, 8, dtype=torch.uint8).t()          # F-contiguous: kvikio accepts it
    assert FakeKvikio().CuFile(f).pread(t).get() == 64
    assert t.t().reshape(-1).tolist() == list(range(64))
    with pytest.raises(ValueError, match="contiguous"):
        FakeKvikio().CuFile(f).pread(torch.zeros(8, 8, dtype=torch.uint8)[:, :4])


def test_compat_mode_preference_follows_the_setting():
    d = Defaults()                              # AUTO, and cuFile is never usable here
    assert d.get("compat_mode") == 2 and d.is_compat_mode_preferred()
    d.set("compat_mode", 0)
    assert not d.is_compat_mode_preferred()
    with d.set({"compat_mode": 1}):
        assert d.is_compat_mode_preferred()
    assert not d.is_compat_mode_preferred() and not Defaults(compat=False).is_compat_mode_preferred()
