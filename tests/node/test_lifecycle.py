import pytest

from agent.clock import ManualClock
from agent.node.lifecycle import (TRANSITIONS, IllegalTransition, Lifecycle, ReplicaState as S)


def test_happy_path_records_history():
    clock = ManualClock(10.0)
    lc = Lifecycle("r1", clock=clock)
    assert lc.state is S.COLD and not lc.serving
    clock.advance(1.5)
    assert lc.move(S.RESTORING, "zygote 0") is S.COLD
    clock.advance(2.0)
    lc.move(S.WARM, "golden ok")
    assert lc.serving
    assert lc.seconds_in_state() == 0.0
    clock.advance(3.0)
    assert lc.seconds_in_state() == 3.0
    lc.move(S.SUSPENDED)
    lc.move(S.WARM)
    lc.move(S.DRAINING)
    lc.move(S.DEAD)
    assert [h[0] for h in lc.history] == [S.COLD, S.RESTORING, S.WARM, S.SUSPENDED, S.WARM,
                                         S.DRAINING, S.DEAD]
    assert lc.history[1] == (S.RESTORING, 11.5, "zygote 0")


def test_failed_restore_goes_back_to_cold():
    lc = Lifecycle("r", clock=ManualClock())
    lc.move(S.RESTORING)
    lc.move(S.COLD, "golden mismatch")
    lc.move(S.WARM, "cold boot")
    assert lc.state is S.WARM


@pytest.mark.parametrize("before", list(S))
def test_every_illegal_move_is_refused(before):
    for to in S:
        lc = Lifecycle("r", clock=ManualClock(), state=before)
        if to in TRANSITIONS[before]:
            lc.move(to)
            assert lc.state is to
        else:
            with pytest.raises(IllegalTransition) as info:
                lc.move(to)
            assert info.value.value == (before.value, to.value)
            assert lc.state is before


def test_dead_is_final_and_draining_only_dies():
    assert TRANSITIONS[S.DEAD] == frozenset()
    assert TRANSITIONS[S.DRAINING] == frozenset({S.DEAD})
