"""Cost and capacity arithmetic against the worked numbers of docs/architecture.md ("Sizing",
"Cost model")."""

import math

import pytest

from agent.errors import ConfigError
from agent.predictor.sizing import seqs_per_replica, target_replicas
from agent.sim.cost import (DOC_COST_TABLE, DOC_REQUESTS_PER_DAY, PRICE_PER_GPU_HOUR,
                            cost_per_1000, gpu_hours_per_day, kv_bytes_per_token,
                            kv_capacity_tokens)


def test_kv_capacity_chain_matches_document():
    per_token = kv_bytes_per_token(layers=40, kv_heads=8, head_dim=128, dtype_bytes=2)
    assert per_token == 163_840                      # "160 KB"
    tokens = kv_capacity_tokens(40, 26, 3, per_token)
    assert tokens == 72_089                          # 11,534,336 KB / 160 KB
    assert seqs_per_replica(tokens, 900) == 80       # "~80"


def test_replica_counts_match_document():
    assert target_replicas(20, 7.0, 80, 0.75, 0, 1000) == 3     # ceil(140 / 60)
    assert target_replicas(200, 7.0, 80, 0.75, 0, 1000) == 24   # ceil(1,400 / 60)


@pytest.mark.parametrize("name,replicas_hours,cost_day,per_1000", [
    ("always_on", 24 * 24, 1613, 0.93),
    ("scale_to_zero", 20 * 24, 1344, 0.78),
    ("snapshot_reactive", 114, 319, 0.18),
    ("snapshot_predictive", 126, 353, 0.20),
])
def test_cost_table_rows(name, replicas_hours, cost_day, per_1000):
    row = DOC_COST_TABLE[name]
    gpu_h = gpu_hours_per_day(replicas_hours * 3600.0, 86_400.0)
    assert gpu_h == pytest.approx(row["gpu_hours_per_day"])
    assert round(gpu_h * PRICE_PER_GPU_HOUR) == cost_day == row["cost_per_day"]
    assert round(cost_per_1000(gpu_h, DOC_REQUESTS_PER_DAY), 2) == per_1000


def test_gpu_hours_per_day_scales_a_short_run():
    # 24 replicas for one simulated hour is 576 GPU-hours per day
    assert gpu_hours_per_day(24 * 3600.0, 3600.0) == pytest.approx(576.0)
    with pytest.raises(ConfigError) as e:
        gpu_hours_per_day(1.0, 0.0)
    assert e.value.name == "sim_s"


def test_cost_edges():
    assert math.isinf(cost_per_1000(1.0, 0))
    assert cost_per_1000(1.0, 2800) == pytest.approx(1.0)
    with pytest.raises(ConfigError) as e:
        kv_capacity_tokens(40, 38, 3, 163_840)
    assert e.value.value == 40 and e.value.limit == 41
