"""inf and NaN readings are missing readings, not builtin OverflowError/ValueError."""

import math

import pytest

from agent.clock import ManualClock
from agent.errors import ConfigError
from agent.predictor.forecast import CounterRate
from agent.predictor.loop import ModelPolicy, Predictor


class Scaler:
    def set_target(self, model, count, *, reason):
        pass

    def target(self, model):
        return 0


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_observe_ignores_a_non_finite_reading(bad):
    p = Predictor([ModelPolicy("m")], clock=ManualClock(), scaler=Scaler(),
                  snapshot_durable=lambda m: True)
    p.observe("m", 3)
    p.observe("m", bad)                       # arrivals
    p.observe("m", 2, window_s=bad)           # window
    st = p._state("m")
    assert (st.arrivals, st.window_s) == (3, 1.0)
    with pytest.raises(ConfigError):          # a real bad value is still refused, typed
        p.observe("m", -1)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_counter_rate_skips_a_non_finite_reading_and_keeps_its_base(bad):
    c = CounterRate()
    assert c.sample(10, 0.0) is None
    assert c.sample(bad, 1.0) is None
    assert c.sample(15, bad) is None
    assert c.sample(25, 2.0) == (15, 2.0)     # the window runs from the last good reading
    assert c.resets == 0
