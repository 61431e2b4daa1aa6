"""Evaluation: the discrete-event simulator driving the real control-plane code on a virtual
clock and its cost model, the live trace replay (:mod:`agent.sim.replay`), the demonstration
(:mod:`agent.sim.demo`) and forecast judging (:mod:`agent.sim.forecast_eval`).  Production code
never imports this package; the command line (``rewarm simulate``, ``rewarm up --demo``) and
bench/ do."""
