import pytest

from agent.clock import ManualClock
from agent.errors import ConfigError, CudaCheckpointError, DriverUnavailable
from agent.node.cuda_checkpoint import CudaCheckpointDriver, ProcessState
from agent.node.suspend import ResumeFailed, Suspender

C_STATE, C_TID, C_LOCK, C_CHECKPOINT, C_RESTORE, C_UNLOCK = range(6)


@pytest.fixture
def suspender(cuda_ffi, fake_libcuda_path, fake):
    drv = CudaCheckpointDriver(library=str(fake_libcuda_path), ffi=cuda_ffi)
    return Suspender(drv, lock_timeout_s=30.0, toggle_timeout_s=5.0, clock=ManualClock())


def test_suspend_then_resume(suspender, fake):
    times = suspender.suspend(11)
    assert list(times.steps_s) == ["lock", "checkpoint"]
    assert fake.fake_last_timeout_ms() == 30_000
    assert suspender.state(11) is ProcessState.CHECKPOINTED
    times = suspender.resume(11)
    assert list(times.steps_s) == ["restore", "unlock"]
    assert suspender.state(11) is ProcessState.RUNNING


def test_lock_failure_leaves_process_running(suspender, fake):
    fake.fake_set_result(C_LOCK, 909)
    with pytest.raises(CudaCheckpointError) as info:
        suspender.suspend(1)
    assert info.value.name == "CUDA_ERROR_TIMEOUT"
    assert suspender.state(1) is ProcessState.RUNNING
    assert fake.fake_calls(C_CHECKPOINT) == 0


def test_checkpoint_failure_unlocks_again(suspender, fake):
    fake.fake_set_result(C_CHECKPOINT, 2)
    with pytest.raises(CudaCheckpointError) as info:
        suspender.suspend(1)
    assert info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert fake.fake_calls(C_UNLOCK) == 1
    assert suspender.state(1) is ProcessState.RUNNING


def test_restore_out_of_memory_reports_state(suspender, fake):
    suspender.suspend(5)
    fake.fake_set_result(C_RESTORE, 2)
    with pytest.raises(ResumeFailed) as info:
        suspender.resume(5)
    err = info.value
    assert (err.step, err.state, err.name, err.pid) == (
        "restore", ProcessState.CHECKPOINTED, "CUDA_ERROR_OUT_OF_MEMORY", 5)
    assert "kill it" in str(err)
    assert fake.fake_calls(C_UNLOCK) == 0


def test_unlock_failure_is_resume_failed(suspender, fake):
    suspender.suspend(5)
    fake.fake_set_result(C_UNLOCK, 999)
    with pytest.raises(ResumeFailed) as info:
        suspender.resume(5)
    assert info.value.step == "unlock"
    assert info.value.state is ProcessState.LOCKED


def test_unknown_state_after_failure(suspender, fake):
    suspender.suspend(5)
    fake.fake_set_result(C_RESTORE, 3)
    fake.fake_set_result(C_STATE, 3)
    with pytest.raises(ResumeFailed) as info:
        suspender.resume(5)
    assert info.value.state is None
    assert "unknown" in str(info.value)


def test_no_driver_is_driver_unavailable(cuda_ffi, old_libcuda_path):
    s = Suspender(CudaCheckpointDriver(library=str(old_libcuda_path), ffi=cuda_ffi))
    with pytest.raises(DriverUnavailable):
        s.suspend(1)
    with pytest.raises(DriverUnavailable):
        s.resume(1)


@pytest.mark.parametrize("kw", [{"lock_timeout_s": -1}, {"toggle_timeout_s": 0}])
def test_timeouts_validated(cuda_ffi, kw):
    with pytest.raises(ConfigError):
        Suspender(CudaCheckpointDriver(ffi=cuda_ffi), **kw)
