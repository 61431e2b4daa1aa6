"""agent/node/bounded.py: a blocking call bounded by a timeout, and what the suspender and the
restore ladder make of its TimeoutError."""

from __future__ import annotations

import threading

import pytest

from agent.clock import ManualClock
from agent.errors import CudaCheckpointError
from agent.node.bounded import call_within
from agent.node.suspend import StepTimes, Suspender


def test_the_value_and_the_error_come_back_on_the_callers_thread():
    assert call_within(lambda: threading.current_thread().name, 5.0, "name") == "bounded-name"
    with pytest.raises(KeyError, match="gone"):
        call_within(lambda: {}["gone"], 5.0, "lookup")


def test_a_call_past_its_timeout_is_a_timeout_naming_the_step_and_the_limit():
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError) as err:
            call_within(release.wait, 0.05, "restore")
        assert "restore did not finish within 0.05 s" in str(err.value)
    finally:
        release.set()      # the abandoned helper thread ends


def test_the_suspender_reports_a_stuck_toggle_as_the_driver_error_it_was():
    release = threading.Event()
    # the step itself is the blocking call here: the driver is never called
    suspender = Suspender(object(), toggle_timeout_s=0.05, clock=ManualClock())
    times = StepTimes()
    try:
        with pytest.raises(CudaCheckpointError) as err:
            suspender._timed(times, "checkpoint", release.wait)
    finally:
        release.set()
    assert (err.value.call, err.value.name, err.value.limit) == ("checkpoint", "timeout", 0.05)
    assert "checkpoint" in times.steps_s
