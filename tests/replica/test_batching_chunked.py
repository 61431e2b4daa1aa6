"""The replica's batch loop over the chunked step (agent/replica/batching.py): a running
stream's tokens go out between a long prompt's chunk calls, a prompt's first token goes out
as soon as the call that ends its prefill returns, and a client's cancel mid-prefill frees
the slot before the prompt's next chunk runs."""

import asyncio
import dataclasses
import time

import pytest

from agent.protocol import Decoder, pack
from agent.replica import zygote
from agent.replica.engine import Engine
from agent.replica.speedmeter import SpeedMeter
from agent.replica.synthetic import make_synthetic
from agent.replica.worker import Worker
from tests.replica.test_engine_chunked import FIX, TARGET_S


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    model_dir = make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=4)
    return zygote.boot(model_dir, max_seqs=4, max_seq_len=96)


def fixed_worker(booted):
    """A worker over a fresh engine whose meter holds FIX (budget 40 alone, 30 beside one
    running sequence) and whose calls are logged: ``("prefill", rows)``, ``"decode"``, and
    the tokens messages sent: ``("first", id)`` or ``("token", id)``."""
    meter = SpeedMeter(FIX, measured_prior=True)
    meter.observe_prefill = meter.observe_decode = lambda *a: None  # type: ignore[method-assign]
    engine = Engine(booted.config, booted.weights, max_seqs=4, max_seq_len=96, meter=meter,
                    itl_target_s=TARGET_S)
    worker = Worker(dataclasses.replace(booted, engine=engine))
    log: list = []
    run, decode, send = engine._run_chunks, engine.decode, worker.batch.send

    def logged_run(group, rows, width):
        log.append(("prefill", list(rows)))
        return run(group, rows, width)

    def logged_decode():
        log.append("decode")
        return decode()

    def logged_send(writer, message):
        if message.get("type") == "tokens":
            log.append(("first" if "prompt_tokens" in message else "token", message["id"]))
        send(writer, message)
    engine._run_chunks, engine.decode, worker.batch.send = logged_run, logged_decode, logged_send
    return worker, engine, log


async def serve(worker):
    ready = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
    host, port = (await asyncio.wait_for(ready, 10)).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    return serving, reader, writer


async def read_until_done(reader, ids, decoder):
    pending, seen = set(ids), []
    while pending:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, "worker closed the connection"
        for message in decoder.feed(data):
            seen.append(message)
            if message["type"] in ("done", "error"):
                pending.discard(message["id"])
    return seen


def gen(rid, n_prompt, max_tokens):
    return {"op": "generate", "id": rid, "tokens": [(7 * i) % 200 + 1 for i in range(n_prompt)],
            "max_tokens": max_tokens}


def test_a_running_stream_gets_its_tokens_between_a_long_prompts_chunks(booted):
    worker, _, log = fixed_worker(booted)

    async def main():
        serving, reader, writer = await serve(worker)
        writer.write(pack(gen("r", 4, 30)) + pack(gen("l", 70, 2)))   # one tick: both
        seen = await read_until_done(reader, ["r", "l"], Decoder())
        assert [m["type"] for m in seen if m["id"] == "l"] == ["tokens", "tokens", "done"]
        writer.write(pack({"op": "shutdown", "id": "bye"}))
        await asyncio.wait_for(serving, 30)
        writer.close()

    asyncio.run(main())
    upto = log.index(("first", "l")) + 1
    # step 1 (budget 40): R's 4, then a further call of 36 - 2 = 34 of L's 70; R decodes.
    # Step 2 (30 beside R): 30 more of L; R decodes.  Step 3: L's last 6, its first token
    # at once, then the decode of both.
    assert log[:upto] == [("prefill", [4]), ("first", "r"), ("prefill", [34]), "decode",
                          ("token", "r"), ("prefill", [30]), "decode", ("token", "r"),
                          ("prefill", [6]), ("first", "l")]
    assert log[upto] == "decode"


def test_a_cancel_mid_prefill_frees_the_slot_before_the_next_chunk(booted):
    worker, engine, log = fixed_worker(booted)
    run = engine._run_chunks

    def slow_first(group, rows, width):    # the first chunk call takes a second
        if not log:                        # (the logging wrapper runs inside this one)
            time.sleep(1.0)
        return run(group, rows, width)
    engine._run_chunks = slow_first

    async def main():
        serving, reader, writer = await serve(worker)
        writer.write(pack(gen("l", 70, 2)))
        for _ in range(500):                          # until L's first chunk call has begun
            if engine.kv.active:
                break
            await asyncio.sleep(0.01)
        assert engine.kv.active == 1 and engine.load.waiting_seqs == 1
        writer.write(pack({"op": "cancel", "id": "l"}))
        for _ in range(100):
            if not engine.busy and engine.kv.active == 0:
                break
            await asyncio.sleep(0.02)
        assert not engine.busy and engine.kv.active == 0     # its slot freed
        answer = await _ask(reader, writer, {"op": "stats", "id": "s"})
        assert answer["result"]["waiting_seqs"] == 0 and answer["result"]["kv_used_tokens"] == 0
        writer.write(pack({"op": "shutdown", "id": "bye"}))
        await asyncio.wait_for(serving, 30)
        writer.close()

    asyncio.run(main())
    assert [entry for entry in log if entry != "decode"] == [("prefill", [40])]   # no 2nd chunk


async def _ask(reader, writer, message):
    writer.write(pack(message))
    decoder = Decoder()
    while True:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data
        for answer in decoder.feed(data):
            if answer.get("id") == message["id"]:
                return answer


def test_the_capacity_sustained_while_backlogged_is_reported_in_stats(booted):
    from agent.throughput import BACKLOG_META_KEYS, BacklogMeter

    worker, engine, _ = fixed_worker(booted)
    worker.batch.meter.backlog = BacklogMeter(min_s=1e-6, min_departures=4)

    async def main():
        serving, reader, writer = await serve(worker)
        writer.write(pack(gen("a", 6, 1)))                   # one request, nothing waiting
        await read_until_done(reader, ["a"], Decoder())
        stats = (await _ask(reader, writer, {"op": "stats", "id": "s0"}))["result"]
        assert not set(BACKLOG_META_KEYS) & set(stats)      # never saturated: nothing to say
        ids = [f"b{i}" for i in range(16)]                  # 16 at once on 4 slots
        writer.write(b"".join(pack(gen(i, 6, 2)) for i in ids))
        await read_until_done(reader, ids, Decoder())
        stats = (await _ask(reader, writer, {"op": "stats", "id": "s1"}))["result"]
        writer.write(pack({"op": "shutdown", "id": "bye"}))
        await asyncio.wait_for(serving, 30)
        writer.close()
        return stats

    stats = asyncio.run(main())
    assert stats["backlog_rps"] > 0 and stats["backlog_s"] > 0
    assert stats["backlog_prompt_tokens"] == 6.0 and stats["backlog_gen_tokens"] == 2.0
    assert 1.0 <= stats["backlog_batch"] <= 4.0
