"""bench/golden_profile.py on a tiny synthetic snapshot: every span it reports, both thread modes."""

import importlib.util
import json
import pathlib

import pytest

from agent.replica import zygote
from agent.replica.synthetic import make_synthetic

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "golden_profile.py"


def _bench():
    spec = importlib.util.spec_from_file_location("golden_profile", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    root = tmp_path_factory.mktemp("gp")
    booted = zygote.boot(make_synthetic(root / "m", "tiny", seed=5), max_seqs=2, max_seq_len=32)
    zygote.capture(booted, root / "snap")
    return root / "snap", booted


def test_the_profile_accounts_for_the_golden_phase_span_by_span(snapshot, tmp_path, capsys):
    snap, booted = snapshot
    out = tmp_path / "p.json"
    assert _bench().main(["--snapshot", str(snap), "--trials", "1", "--torch-threads", "1",
                          "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"same", "cross"} and res["trials"] == 1
    prompts = booted.golden.prompts
    width = max(len(p) for p in prompts) + booted.golden.max_tokens - 2   # prefill of all but the last
    for mode in res["modes"].values():
        rows = {k: v for k, v in mode.items() if k not in ("first_tokens", "weights_read")}
        (read,) = mode["weights_read"]
        assert read["bytes"] > 0 and 0 <= read["direct_chunks"] <= read["chunks"] and read["gbps"] > 0
        assert all(v >= 0 for k, v in rows.items() if "other" not in k)
        golden = rows["golden_s"]
        prefill = rows[f"  golden: forward B,S={len(prompts)},{width}"]
        decode = rows[f"  golden: forward B,S={len(prompts)},1"]
        assert rows["  golden: sample"] > 0 and prefill > 0 and decode > 0
        spans = [v for k, v in rows.items() if k.startswith("  golden: ")]
        # "other" closes the sum in each trial; the JSON rounds each median to 0.1 ms, so the
        # rounded parts may differ from the rounded whole by half a unit each
        assert sum(spans) == pytest.approx(golden, abs=0.05 * (len(spans) + 1) + 1e-9)
        assert prefill + decode <= golden
        assert rows["zygote_restore (restore + first token)"] >= golden + rows["weights_s (restore_snapshot)"]
        assert rows[f"warm: forward B,S={len(prompts)},1"] > 0       # the zygote ran the check's calls
        assert rows[f"steady: forward B,S={len(prompts)},{width}"] > 0
        assert len(mode["first_tokens"]) == 1
    assert "golden: forward" in capsys.readouterr().out


def test_an_unknown_thread_mode_is_refused(snapshot, tmp_path):
    with pytest.raises(SystemExit):
        _bench().main(["--snapshot", str(snapshot[0]), "--threads", "both", "--json", str(tmp_path / "x")])


def test_a_trial_that_fails_says_so(tmp_path, capsys):
    assert _bench().main(["--snapshot", str(tmp_path / "missing"), "--trials", "1", "--threads", "same",
                          "--json", str(tmp_path / "x")]) == 1
    assert "missing" in capsys.readouterr().err
