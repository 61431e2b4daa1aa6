"""bench/stack_check.py's serving path on the CPU: the embedded stack with process workers on a
tiny seeded model and a token-id prompt (as the 8B shape is driven), through cold boot,
capture, a warmed zygote, restore, and the cold restore with its measured read rate.  The CPU
stands in for the GPU: no CUDA checkpoint, so park and resume are skipped, and say so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import stack_check  # noqa: E402


class Figs:
    def __init__(self) -> None:
        self.figures: dict = {}
        self.notes: list[str] = []

    def fig(self, name, value, unit, path="-", limit=None, target=None, met=None):
        self.figures[name] = {"value": value, "unit": unit, "path": path, "limit": limit or {},
                              "target": target, "met": met}

    def note(self, text):
        self.notes.append(text)


@pytest.mark.slow
def test_the_serving_path_with_token_ids_and_a_cold_restore(tmp_path):
    from agent.replica.synthetic import make_synthetic

    model = make_synthetic(tmp_path / "tiny", "tiny", seed=7, device="cpu")
    figs = Figs()
    targets = stack_check.Targets(restore_s=60.0, resume_s=60.0, cold_base_s=60.0)
    stack_check.run_stack(figs, model, None, tmp_path / "state", [5, 17, 42, 99], 4,
                          targets=targets, capture_timeout_s=120.0, warm_timeout_s=120.0)
    f = {k: v["value"] for k, v in figs.figures.items()}
    assert f["restore_path"] == "restore" and f["scaled_to_zero"] is True
    assert f["tokens_match_after_restore"] is True
    assert f["tokens_match_after_cold_restore"] is True
    assert f["restore_warm_engine"] == "reused" and figs.figures["restore_warm_engine"]["met"]
    for prefix in ("restore", "cold_restore"):
        assert f[f"{prefix}_golden_ms"] >= f[f"{prefix}_golden_prefill_ms"] > 0
        assert f[f"{prefix}_agent_restore_s"] > 0
    assert f["cold_read_rate"] > 0 and f["snapshot_bytes"] > 0
    assert figs.figures["cold_restore_first_token_s"]["limit"]["bytes"] == f["snapshot_bytes"]
    assert any("park/resume skipped" in n for n in figs.notes)
    assert any(n.startswith("restore: warm record {") for n in figs.notes)
