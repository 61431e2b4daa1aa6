"""The worker's drain (SIGTERM: in-flight requests finish, new ones get 503 + retry_after_ms),
its load meter in ``stats``, and its status port read back through prometheus-client's parser."""

import asyncio
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.protocol import Decoder, pack
from agent.replica import zygote
from agent.replica.meter import ReplicaMeter
from agent.replica.synthetic import make_synthetic
from agent.replica.worker import Worker, _serve_status


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    model_dir = make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=3)
    return zygote.boot(model_dir, max_seqs=4, max_seq_len=64)


async def _drain_session(worker: Worker):
    ready = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
    host, port = (await asyncio.wait_for(ready, 10)).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(pack({"op": "generate", "id": 1, "tokens": [1, 2, 3], "max_tokens": 40}))
    decoder, answers = Decoder(), []
    while not answers:                     # the first token: request 1 is in flight
        answers += decoder.feed(await asyncio.wait_for(reader.read(65536), 60))
    worker.drain()
    writer.write(pack({"op": "generate", "id": 2, "tokens": [1, 2], "max_tokens": 2}))
    final = lambda: {a["id"] for a in answers if a["type"] in ("done", "error")}  # noqa: E731
    while final() != {1, 2}:
        data = await asyncio.wait_for(reader.read(65536), 60)
        assert data, "the worker closed the connection before answering"
        answers += decoder.feed(data)
    await asyncio.wait_for(serving, 30)        # it stops by itself once drained
    writer.close()
    return answers


def test_drain_finishes_the_stream_and_refuses_new_requests(booted):
    worker = Worker(booted, drain_grace_s=60.0)
    answers = asyncio.run(_drain_session(worker))
    first = [a for a in answers if a["id"] == 1]
    assert first[-1]["type"] == "done" and first[-1]["n_tokens"] == 40   # not cut short
    [refused] = [a for a in answers if a["id"] == 2]
    assert refused["type"] == "error" and refused["code"] == 503
    assert refused["retry_after_ms"] == 1000 and "draining" in refused["reason"]
    assert refused["refusal"] == "draining"
    stats = worker.stats()
    assert stats["draining"] is True and stats["generated_tokens"] == 40
    assert stats["kv_slots_used"] == 0 and stats["kv_slots"] == 4


def test_drain_grace_bounds_the_wait(booted):
    worker = Worker(booted, drain_grace_s=0.0)       # stop at once: 39 tokens were still due
    answers = asyncio.run(_drain_session(worker))
    first = [a for a in answers if a["id"] == 1]
    assert first[-1]["type"] == "error" and first[-1]["code"] == 503   # cut at the bound


def test_meter_window():
    now = [100.0]
    m = ReplicaMeter(window_s=10.0, clock=lambda: now[0])
    assert m.tokens_per_s() == 0.0
    m.step(4, 4, duration_s=1.0)
    assert m.tokens_per_s() == 4.0 and m.batch_size == 4       # 4 tokens over 1 s so far
    now[0] = 109.0
    m.step(6, 3, duration_s=1.0)
    assert m.tokens_per_s() == 1.0                              # 10 tokens over 10 s
    now[0] = 119.5
    assert m.tokens_per_s() == 0.0 and m.batch_size == 0        # idle past the window
    assert m.generated_tokens == 10


def test_status_port(tmp_path):
    model_dir = make_synthetic(tmp_path / "tiny", "tiny", seed=3)
    booted = zygote.boot(model_dir, max_seqs=4, max_seq_len=64)   # an engine no test used
    worker = Worker(booted)
    server = _serve_status(worker, "127.0.0.1:0")
    try:
        text = urllib.request.urlopen(server.url + "/metrics", timeout=5).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert "rewarm_replica_tokens_per_second" not in fams   # a counter and rate() instead
        assert fams["rewarm_replica_generated_tokens"].samples[0].value == 0
        for name in ("rewarm_replica_batch_size",
                     "rewarm_replica_queued_prefill_tokens", "rewarm_replica_kv_slots_used"):
            [sample] = fams[name].samples
            assert sample.labels == {"model": booted.identity.name} and sample.value == 0
        assert fams["rewarm_replica_kv_slots"].samples[0].value == 4
        assert urllib.request.urlopen(server.url + "/readyz", timeout=5).status == 200
        worker.draining = True
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server.url + "/readyz", timeout=5)
        assert e.value.code == 503 and b"draining" in e.value.read()
    finally:
        server.close()
