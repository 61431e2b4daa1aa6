import importlib.util

import pytest

from agent.errors import ConfigError, CudaCheckpointError, DriverUnavailable
from agent.node import cuda_checkpoint as cc
from agent.node.cuda_checkpoint import CudaCheckpointDriver, ProcessState

C_STATE, C_TID, C_LOCK, C_CHECKPOINT, C_RESTORE, C_UNLOCK = range(6)


def test_result_names_come_from_cuda_h():
    assert cc.result_name(0) == "CUDA_SUCCESS"
    assert cc.result_name(2) == "CUDA_ERROR_OUT_OF_MEMORY"
    assert cc.result_name(401) == "CUDA_ERROR_ILLEGAL_STATE"
    assert cc.result_name(909) == "CUDA_ERROR_TIMEOUT"
    assert cc.result_name(999) == "CUDA_ERROR_UNKNOWN"
    assert cc.result_name(12345) == "CUresult(12345)"
    assert len(cc.CURESULT_NAMES) == 101


def test_missing_library_raises_one_clear_error(cuda_ffi, tmp_path):
    drv = CudaCheckpointDriver(library=str(tmp_path / "libcuda.so.1"), ffi=cuda_ffi)
    assert drv.available() is False
    for call in (lambda: drv.get_state(1), lambda: drv.lock(1, 1.0), lambda: drv.unlock(1),
                 lambda: drv.checkpoint(1), lambda: drv.restore(1),
                 lambda: drv.get_restore_thread_id(1)):
        with pytest.raises(DriverUnavailable) as info:
            call()
        assert info.value.missing == [str(tmp_path / "libcuda.so.1")]
        assert "r570" in str(info.value)


def test_env_var_names_the_library(cuda_ffi, fake_libcuda_path, monkeypatch):
    monkeypatch.setenv(cc.LIBRARY_ENV, str(fake_libcuda_path))
    drv = CudaCheckpointDriver(ffi=cuda_ffi)
    assert drv.library == str(fake_libcuda_path)
    assert drv.available()
    assert drv.driver_version == 13000


def test_old_driver_names_every_missing_symbol(cuda_ffi, old_libcuda_path):
    drv = CudaCheckpointDriver(library=str(old_libcuda_path), ffi=cuda_ffi)
    assert drv.available() is False
    with pytest.raises(DriverUnavailable) as info:
        drv.lock(1, 1.0)
    assert info.value.missing == list(cc.CHECKPOINT_SYMBOLS)
    assert "cuCheckpointProcessLock" in str(info.value)


def test_driver_below_the_minimum_version_fails_closed(cuda_ffi, fake_libcuda_path, fake):
    fake.fake_set_version(cc.MIN_DRIVER_VERSION - 40)  # 12.4: symbols present, pin not met
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    assert drv.available() is False
    with pytest.raises(DriverUnavailable) as info:
        drv.lock(1, 1.0)
    assert str(cc.MIN_DRIVER_VERSION) in str(info.value)
    assert str(cc.MIN_DRIVER_VERSION - 40) in str(info.value)
    assert fake.fake_calls(C_LOCK) == 0


def test_driver_at_the_minimum_version_is_used(cuda_ffi, fake_libcuda_path, fake):
    fake.fake_set_version(cc.MIN_DRIVER_VERSION)
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    assert drv.available()
    assert drv.driver_version == cc.MIN_DRIVER_VERSION


def test_full_cycle_moves_states_and_zeroes_reserved(cuda_ffi, fake_libcuda_path, fake):
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    assert drv.get_state(7) is ProcessState.RUNNING
    drv.lock(7, 2.5)
    assert fake.fake_last_timeout_ms() == 2500
    assert drv.get_state(7) is ProcessState.LOCKED
    drv.checkpoint(7)
    assert drv.get_state(7) is ProcessState.CHECKPOINTED
    drv.restore(7, [(b"\xff" * 16, bytes(range(16)))])
    assert fake.fake_last_pairs() == 1
    drv.unlock(7)
    assert drv.get_state(7) is ProcessState.RUNNING
    assert drv.get_restore_thread_id(7) == 8
    assert fake.fake_nonzero_reserved() == 0


def test_restore_passes_uuid_bytes(cuda_ffi, fake_libcuda_path, fake):
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    drv.lock(1, 0)
    drv.checkpoint(1)
    new = bytes(range(1, 17))  # no NUL, so c_char_p returns it whole
    drv.restore(1, [(bytes(16), new)])
    assert fake.fake_last_new_uuid()[:16] == new


@pytest.mark.parametrize("code,name", [(2, "CUDA_ERROR_OUT_OF_MEMORY"), (909, "CUDA_ERROR_TIMEOUT"),
                                       (801, "CUDA_ERROR_NOT_SUPPORTED"), (7777, "CUresult(7777)")])
def test_each_failure_is_typed_with_the_driver_name(cuda_ffi, fake_libcuda_path, fake, code, name):
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    fake.fake_set_result(C_LOCK, code)
    with pytest.raises(CudaCheckpointError) as info:
        drv.lock(3, 1.0)
    err = info.value
    assert (err.call, err.result, err.name, err.pid) == ("cuCheckpointProcessLock", code, name, 3)
    assert name in str(err)
    assert not isinstance(err, DriverUnavailable)


def test_wrong_state_is_illegal_state(cuda_ffi, fake_libcuda_path, fake):
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    with pytest.raises(CudaCheckpointError) as info:
        drv.checkpoint(1)
    assert info.value.name == "CUDA_ERROR_ILLEGAL_STATE"


def test_unknown_state_value_is_an_error(cuda_ffi, fake_libcuda_path, fake):
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    fake.fake_set_state(9)
    with pytest.raises(CudaCheckpointError) as info:
        drv.get_state(1)
    assert info.value.value == 9


def test_lock_timeout_limits(cuda_ffi, fake_libcuda_path, fake):
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    drv.lock(1, cc.MAX_LOCK_TIMEOUT_MS / 1000)  # at the limit
    assert fake.fake_last_timeout_ms() == cc.MAX_LOCK_TIMEOUT_MS
    with pytest.raises(ConfigError):
        drv.lock(1, cc.MAX_LOCK_TIMEOUT_MS / 1000 + 0.001)
    with pytest.raises(ConfigError):
        drv.lock(1, -0.001)
    for bad in (float("nan"), float("inf"), "5"):
        with pytest.raises(ConfigError) as info:
            drv.lock(1, bad)
        assert info.value.name == "lock_timeout_s"


def test_uuid_length_checked_before_the_call(cuda_ffi, fake_libcuda_path, fake):
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    with pytest.raises(ConfigError) as info:
        drv.restore(1, [(bytes(16), bytes(17))])
    assert info.value.value == 17
    assert fake.fake_calls(C_RESTORE) == 0
    assert cc.uuid_bytes("GPU-00112233-4455-6677-8899-aabbccddeeff") == bytes.fromhex(
        "00112233445566778899aabbccddeeff")
    with pytest.raises(ValueError):
        cc.uuid_bytes("GPU-0011")


def test_out_of_line_module_builds(cuda_ffi, tmp_path, monkeypatch):
    """setup.py's cffi module: the ABI-mode module emitted from ext/ imports and declares the API."""
    out = tmp_path / "_cuda_checkpoint.py"
    cuda_ffi.emit_python_code(str(out))
    spec = importlib.util.spec_from_file_location("_cuda_checkpoint_test", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.ffi.sizeof("CUcheckpointRestoreArgs") == 64
    assert module.ffi.sizeof("CUcheckpointLockArgs") == 64
    assert module.ffi.sizeof("CUcheckpointGpuPair") == 32
