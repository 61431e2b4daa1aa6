"""bench/engine_compare.py's aggregation: each figure is its best round's, ratios from one run."""

import importlib.util
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "engine_compare.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("engine_compare", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _round(ttft32, ttft512, rates, out8, served8, slow8):
    r = {"ttft:32": {"ttft_ms": ttft32}, "ttft:512": {"ttft_ms": ttft512}}
    for c, rate in zip((1, 4, 8), rates, strict=True):
        r[f"decode:{c}"] = {"tok_s_per_seq": rate, "output_tok_s": out8 if c == 8 else 1.0,
                            "served": served8 if c == 8 else c, "ttft_ms_max": slow8}
    return r


def test_best_of_takes_the_lowest_ttft_and_highest_rates_and_the_best_c8_round(bench):
    rounds = [_round(90.0, 900.0, [50.0, 20.0, 10.0], 60.0, 8, 700.0),
              _round(70.0, 1100.0, [40.0, 25.0, None], 80.0, 7, 900.0)]
    got = bench.best_of(rounds)
    assert got["ttft_ms"] == {"32": 70.0, "512": 900.0}
    assert got["decode_tok_s_per_seq"] == {"1": 50.0, "4": 25.0, "8": 10.0}
    # the c8 figures travel together, from the round with the highest output rate
    assert (got["output_tok_s_c8"], got["served_c8"], got["ttft_ms_c8_max"]) == (80.0, 7, 900.0)


def test_best_of_a_failed_round_leaves_the_others(bench):
    rounds = [_round(90.0, 900.0, [50.0, 20.0, 10.0], 60.0, 8, 700.0),
              {"ttft:32": None, "ttft:512": None, "decode:1": None, "decode:4": None, "decode:8": None}]
    assert bench.best_of(rounds)["ttft_ms"]["32"] == 90.0


def test_headline_ratios_come_from_the_same_engines_dict(bench):
    engines = {"rewarm_engine": {"ttft_ms": {"32": 50.0}, "decode_tok_s_per_seq": {"1": 60.0},
                                 "output_tok_s_c8": 200.0},
               "llama_cpp": {"ttft_ms": {"32": 100.0}, "decode_tok_s_per_seq": {"1": 120.0},
                             "output_tok_s_c8": 100.0}}
    assert bench.headline(engines) == [
        ["decode tok/s, 1 seq, rewarm / llama.cpp", "0.50"],
        ["TTFT 32-token prompt, llama.cpp / rewarm", "2.00"],
        ["output tok/s at 8 concurrent, rewarm / llama.cpp", "2.00"]]
    assert bench.headline({"rewarm_engine": {"error": ["x"]}, "llama_cpp": {}}) == []
    # llama.cpp runs "concurrent" requests one at a time: its best one-sequence rate counts
    engines["llama_cpp"]["decode_tok_s_per_seq"] = {"1": 30.0, "4": 120.0, "8": None}
    assert bench.headline(engines)[0] == ["decode tok/s, 1 seq, rewarm / llama.cpp", "0.50"]


FAKE_CHILD = '''
import json, sys
name = sys.argv[sys.argv.index("--child") + 1]
print("FIRST", flush=True)
print("READY " + json.dumps({"weights": name, "concurrency_kind": "fake"}), flush=True)
n = 0
for line in sys.stdin:
    n += 1
    what = line.strip()
    if what.startswith("ttft"):
        out = {"ttft_ms": float(n)}
    elif what.startswith("decode"):
        out = {"tok_s_per_seq": float(n), "output_tok_s": float(n), "served": 8, "ttft_ms_max": 1.0}
    else:
        out = {"rss_mib": 1.0, "pss_mib": 1.0}
    print("RESULT " + json.dumps(out), flush=True)
'''


def test_compare_asks_every_child_for_every_figure_each_round(bench, tmp_path, monkeypatch):
    """The parent's protocol against two stand-in children: each answers its n-th question
    with n, so the best TTFT is the first answer and the best rate the last."""
    import sys

    from bench import engine_rounds

    script = tmp_path / "child.py"
    script.write_text(FAKE_CHILD)
    monkeypatch.setattr(engine_rounds, "SCRIPT", script)
    kids = {name: engine_rounds.Child(sys.executable, name, [], timeout_s=30) for name in ("a", "b")}
    try:
        assert kids["a"].info["weights"] == "a" and "start_to_first_token_s" in kids["a"].info
        out = engine_rounds.compare(kids, rounds=2)
    finally:
        for kid in kids.values():
            kid.close()
    per_round = len(engine_rounds.FIGURES)
    for name in ("a", "b"):
        assert len(out[name]["rounds"]) == 2 and out[name]["pss_mib"] == 1.0
        assert out[name]["ttft_ms"]["32"] == 1.0
        assert out[name]["decode_tok_s_per_seq"]["8"] == 2.0 * per_round
    assert all(not kid.alive for kid in kids.values())
