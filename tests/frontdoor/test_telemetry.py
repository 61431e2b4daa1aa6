import json
import urllib.request

from agent.telemetry import EVENT_FIELDS, Telemetry


def test_events_are_buffered_then_written_as_json_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    t = Telemetry(path, flush_events=2)
    t.event("a", "m", "warm_hit", 200, 0.0, None, 1.5, False)
    assert path.read_text() == ""              # buffered
    t.event("b", "m", "snapshot_restore", 200, 812.0, 640.0, 900.0, True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["request_id"] for r in rows] == ["a", "b"]
    assert set(rows[1]) == set(EVENT_FIELDS)
    assert rows[1]["path"] == "snapshot_restore" and rows[1]["restore_ms"] == 640.0
    assert rows[1]["sla_breached"] is True and rows[1]["timestamp_ms"] > 1.6e12
    t.event("c", "m", "refused", 429, 0.0, None, None, False)
    t.close()
    assert len(path.read_text().splitlines()) == 3


def test_prometheus_metrics_are_served(tmp_path):
    t = Telemetry()
    t.event("a", "m", "warm_hit", 200, 0.0, None, 2.0, False)
    t.event("b", "m", "warm_hit", 200, 3.0, None, 4.0, False)
    t.event("c", "m", "refused", 504, 0.0, None, None, True)
    t.queue_depth("m", 7)
    t.restores_in_flight(2)
    server = t.serve_http(0)
    try:
        port = server.server_address[1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.shutdown()
    assert 'rewarm_requests_total{code="200",model="m",path="warm_hit"} 2.0' in text
    assert 'rewarm_requests_total{code="504",model="m",path="refused"} 1.0' in text
    assert 'rewarm_queue_depth{model="m"} 7.0' in text
    assert "rewarm_restores_in_flight 2.0" in text
    assert 'rewarm_ttft_seconds_count{model="m",path="warm_hit"} 2.0' in text
    assert 'rewarm_queue_wait_seconds_count{model="m",path="warm_hit"} 1.0' in text
