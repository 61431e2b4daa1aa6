"""The front door's metric scheme, read back through prometheus-client's own parser: label
sets, bucket bounds up to 600 s, rejections by reason, the prediction ratio, process metrics,
and the status port's paths (/metrics, /healthz, /readyz, 404)."""

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.telemetry import BUCKETS_S, OTHER_MODEL, REJECT_REASONS, Telemetry, reject_reason


def families(t: Telemetry) -> dict:
    from prometheus_client import generate_latest
    return {f.name: f for f in text_string_to_metric_families(generate_latest(t.registry).decode())}


def samples(fam, suffix=""):
    return [s for s in fam.samples if s.name == fam.name + suffix]


def test_label_sets_and_buckets():
    t = Telemetry()
    t.event(1, "llama", "warm_hit", 200, 0.0, None, 12.0, False, predicted_ttft_ms=10.0)
    t.event(2, "llama", "cold_boot", 200, 44_000.0, 43_000.0, 44_100.0, True)
    t.event(3, "qwen", "refused", 429, 0.0, None, None, False, reason="queue_full")
    t.event(4, "qwen", "refused", 504, 0.0, None, None, True)
    f = families(t)
    req = samples(f["rewarm_requests"], "_total")
    assert {tuple(sorted(s.labels)) for s in req} == {("code", "model", "path")}
    assert {(s.labels["model"], s.labels["path"], s.labels["code"]): s.value for s in req} == {
        ("llama", "warm_hit", "200"): 1, ("llama", "cold_boot", "200"): 1,
        ("qwen", "refused", "429"): 1, ("qwen", "refused", "504"): 1}
    ttft = f["rewarm_ttft_seconds"]
    buckets = [s for s in ttft.samples if s.name.endswith("_bucket")]
    assert {tuple(sorted(s.labels)) for s in buckets} == {("le", "model", "path")}
    bounds = [float(s.labels["le"]) for s in buckets if s.labels["path"] == "cold_boot"]
    assert bounds == [*map(float, BUCKETS_S), float("inf")] and bounds[-2] == 600.0
    cold = {float(s.labels["le"]): s.value for s in buckets if s.labels["path"] == "cold_boot"}
    assert cold[30.0] == 0 and cold[60.0] == 1        # a 44 s cold boot is not in +Inf only
    wait = {s.labels["path"] for s in f["rewarm_queue_wait_seconds"].samples}
    assert wait == {"cold_boot"}
    rej = {(s.labels["model"], s.labels["code"], s.labels["reason"]): s.value
           for s in samples(f["rewarm_rejections"], "_total")}
    assert rej == {("qwen", "429", "queue_full"): 1, ("qwen", "504", "deadline"): 1}
    ratio = f["rewarm_ttft_prediction_ratio"]
    count = [s for s in ratio.samples if s.name.endswith("_count")]
    assert [(s.labels, s.value) for s in count] == [({"model": "llama", "path": "warm_hit"}, 1)]
    assert [s.value for s in ratio.samples if s.name.endswith("_sum")] == [pytest.approx(1.2)]
    assert any(name.startswith("process_") for name in f)


def test_model_label_is_bounded():
    t = Telemetry(max_models=2)
    for i in range(5):
        t.event(i, f"m{i}", "refused", 404, 0.0, None, None, False)
    models = {s.labels["model"] for s in samples(families(t)["rewarm_requests"], "_total")}
    assert models == {"m0", "m1", OTHER_MODEL}


def test_reject_reason_is_the_refusal_code_never_the_text():
    assert reject_reason(429, "queue_full") == "queue_full"
    assert reject_reason(503, "draining") == "draining"
    # text is never classified: a message naming capacity is no no_capacity
    assert reject_reason(429, "no capacity in sight can start it in time") == "other"
    assert reject_reason(503, "front door is draining") == "other"
    assert reject_reason(504, None) == "deadline" and reject_reason(429, None) == "other"
    assert set(REJECT_REASONS) >= {"queue_full", "max_connections", "fd_reserve",
                                   "deadline_unreachable", "context_length"}


def _get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_status_port_paths_and_readiness():
    t = Telemetry()
    server = t.serve_http(0)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert _get(base + "/healthz") == (200, "ok\n")
        assert _get(base + "/readyz") == (200, "ready\n")
        code, body = _get(base + "/metrics")
        assert code == 200 and "rewarm_restores_in_flight 0.0" in body
        assert _get(base + "/")[0] == 404 and _get(base + "/healthz/x")[0] == 404
        t.restore_outcome("m", False, "503 no candidate nodes")
        t.restore_outcome("n", False, "503 no candidate nodes")
        code, body = _get(base + "/readyz")
        assert code == 503 and "every restore fails" in body and "no candidate nodes" in body
        assert _get(base + "/healthz")[0] == 200          # alive all the same
        t.restore_outcome("n", True)
        assert _get(base + "/readyz") == (200, "ready\n")
    finally:
        server.close()


def test_token_counters_and_end_to_end_and_inter_token_histograms():
    t = Telemetry()
    done = {"prompt_tokens": 7, "n_tokens": 5, "total_ms": 250.0}
    # 5 tokens: the first, then messages of 1, 1 and 2 tokens 10, 30 and 40 ms apart
    t.event(1, "m", "warm_hit", 200, 0.0, None, 50.0, False, done=done,
            token_gaps=[(0.01, 1), (0.03, 1), (0.04, 2)])
    t.event(2, "m", "snapshot_restore", 200, 0.0, 900.0, 1000.0, False,
            done={"prompt_tokens": 3, "n_tokens": 1, "total_ms": 1000.0}, token_gaps=[])
    t.event(3, "m", "refused", 429, 0.0, None, None, False, reason="queue_full")
    f = families(t)
    prompt = {s.labels["path"]: s.value for s in samples(f["rewarm_prompt_tokens"], "_total")}
    generated = {s.labels["path"]: s.value
                 for s in samples(f["rewarm_generation_tokens"], "_total")}
    assert prompt == {"warm_hit": 7, "snapshot_restore": 3}
    assert generated == {"warm_hit": 5, "snapshot_restore": 1}
    e2e = f["rewarm_e2e_request_latency_seconds"]
    assert {s.labels["path"]: s.value for s in samples(e2e, "_sum")} == {
        "warm_hit": pytest.approx(0.25), "snapshot_restore": pytest.approx(1.0)}
    itl = f["rewarm_inter_token_latency_seconds"]
    [count] = samples(itl, "_count")
    assert count.labels == {"model": "m", "path": "warm_hit"} and count.value == 4
    assert samples(itl, "_sum")[0].value == pytest.approx(0.08)
    le = {float(s.labels["le"]): s.value for s in samples(itl, "_bucket")}
    assert le[0.01] == 1 and le[0.025] == 3 and le[0.05] == 4   # 10 ms, 2 x 20 ms, 30 ms


def test_the_refusal_code_is_the_label():
    t = Telemetry()
    t.event(1, "m", "refused", 429, 0.0, None, None, False, reason="deadline_unreachable")
    t.event(2, "m", "refused", 503, 0.0, None, None, False,
            reason="model 'm': no warm replica and no capacity requester configured")
    rej = {(s.labels["code"], s.labels["reason"]): s.value
           for s in samples(families(t)["rewarm_rejections"], "_total")}
    assert rej == {("429", "deadline_unreachable"): 1, ("503", "other"): 1}
