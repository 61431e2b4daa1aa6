"""bench/ops_check.py's pieces that need no running stack: the unit checks and the label
reader (the full run is bench/ops_check.sh)."""

import importlib.util
import shutil
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location(
    "ops_check", Path(__file__).resolve().parents[2] / "bench" / "ops_check.py")
ops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ops)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_verify_and_score():
    units = ops.check_units()
    assert sorted(units) == ["rewarm-agent.service", "rewarm-frontdoor.service",
                             "rewarm-predictor.service"]
    for name, u in units.items():
        assert u["verify_ok"] is True, (name, u["verify_output"])
        assert u["exposure"] is not None and u["exposure"] <= 5.0


def test_labels_of():
    text = ('# TYPE rewarm_x_total counter\nrewarm_x_total{model="m",path="warm_hit"} 1.0\n'
            '# TYPE process_y gauge\nprocess_y 2.0\n')
    assert ops.labels_of(text) == (True, True, 1)
    assert ops.labels_of("# TYPE rewarm_z gauge\nrewarm_z 1.0\n") == (False, False, 1)
