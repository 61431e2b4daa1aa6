"""An engine step that raises something untyped (a RuntimeError from a forward) never stops
the batching loop: every request in it is answered 503 ``replica_failed`` with its KV slot
freed and no token of the failed step sent; the replica keeps serving while the engine is
usable, and one that keeps failing is taken as broken (health says so, it drains)."""

import asyncio
import dataclasses

import pytest

from agent.protocol import Decoder, pack
from agent.replica import zygote
from agent.replica.batching import ENGINE_FAILURES_MAX
from agent.replica.synthetic import make_synthetic
from agent.replica.worker import Worker
from agent.wire import refusals


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    model_dir = make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=3)
    return zygote.boot(model_dir, max_seqs=4, max_seq_len=64)


class Conn:
    """One connection to a serving worker; :meth:`ask` sends and reads to the final answer."""

    async def open(self, worker: Worker) -> "Conn":
        ready = asyncio.get_running_loop().create_future()
        self.serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
        host, port = (await asyncio.wait_for(ready, 10)).rsplit(":", 1)
        self.reader, self.writer = await asyncio.open_connection(host, int(port))
        self.decoder = Decoder()
        return self

    async def ask(self, message: dict) -> list[dict]:
        self.writer.write(pack(message))
        out: list[dict] = []
        while not out or out[-1]["type"] == "tokens":
            data = await asyncio.wait_for(self.reader.read(65536), 5)
            assert data, "worker closed the connection"
            out.extend(self.decoder.feed(data))
        return out

    async def close(self) -> None:
        self.writer.close()
        if not self.serving.done():
            self.serving.cancel()
        try:
            await self.serving
        except asyncio.CancelledError:
            pass


def gen(rid, n=3):
    return {"op": "generate", "id": rid, "tokens": [1, 2, 3], "max_tokens": n}


def test_a_forward_that_raises_once_fails_its_requests_and_the_replica_serves_the_next(booted):
    engine = booted.engine
    inner = engine.forward
    calls = []

    def flaky(tokens, *rest):       # the prefill works; the first decode raises
        calls.append(tokens.shape[1])
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return inner(tokens, *rest)

    async def main():
        conn = await Conn().open(Worker(dataclasses.replace(booted, engine=engine)))
        first = await conn.ask(gen(1))
        # its first token came from the prefill (that forward succeeded); nothing after the
        # failed decode step, and the answer says why, as data
        assert [m["type"] for m in first] == ["tokens", "error"]
        assert first[-1]["code"] == 503 and first[-1]["refusal"] == refusals.REPLICA_FAILED
        assert "RuntimeError: CUDA error" in first[-1]["reason"]
        assert engine.kv.active == 0 and not engine.busy          # its slot freed
        second = await conn.ask(gen(2))                            # the engine is usable
        assert second[-1]["type"] == "done" and second[-1]["n_tokens"] == 3
        health = await conn.ask({"op": "health", "id": "h"})
        assert health[-1]["result"]["ok"] is True
        await conn.close()

    engine.forward = flaky
    try:
        asyncio.run(main())
    finally:
        engine.forward = inner


def test_an_engine_that_keeps_failing_is_broken_drains_and_refuses_503(booted):
    engine = booted.engine
    inner = engine.forward

    def broken(tokens, *rest):
        raise RuntimeError("device lost")

    async def main():
        worker = Worker(dataclasses.replace(booted, engine=engine))
        conn = await Conn().open(worker)
        for i in range(ENGINE_FAILURES_MAX):
            answer = await conn.ask(gen(i))
            assert [m["type"] for m in answer] == ["error"]        # no token of a failed step
            assert answer[-1]["code"] == 503 and answer[-1]["refusal"] == refusals.REPLICA_FAILED
            assert engine.kv.active == 0
        health = await conn.ask({"op": "health", "id": "h"})
        assert health[-1]["result"]["ok"] is False
        assert "device lost" in health[-1]["result"]["broken"]
        assert worker.draining                                      # it stops: replaced
        late = await conn.ask(gen("late"))
        assert late[-1]["code"] == 503                              # refused, not hung
        await conn.close()

    engine.forward = broken
    try:
        asyncio.run(main())
    finally:
        engine.forward = inner


def test_health_says_how_long_the_engine_has_been_in_one_call(booted):
    """Its event loop answers ``health`` while the engine thread is stuck in a forward; the
    answer says for how long, so a front door that found the replica silent keeps it out."""
    import threading

    engine = booted.engine
    inner = engine.forward
    release = threading.Event()

    def stuck(tokens, *rest):
        release.wait(10)
        return inner(tokens, *rest)

    async def main():
        conn = await Conn().open(Worker(dataclasses.replace(booted, engine=engine)))
        idle = await conn.ask({"op": "health", "id": "h0"})
        assert "engine_busy_s" not in idle[-1]["result"]          # no engine call running
        conn.writer.write(pack(gen(1)))
        await asyncio.sleep(0.3)
        busy = await conn.ask({"op": "health", "id": "h1"})
        assert busy[-1]["id"] == "h1" and busy[-1]["result"]["ok"] is True
        assert busy[-1]["result"]["engine_busy_s"] >= 0.2
        release.set()
        seen: list[dict] = []
        while not any(m["id"] == 1 and m["type"] in ("done", "error") for m in seen):
            data = await asyncio.wait_for(conn.reader.read(65536), 5)
            assert data, "worker closed the connection"
            seen.extend(conn.decoder.feed(data))
        assert [m for m in seen if m["id"] == 1][-1]["type"] == "done"
        await conn.close()

    engine.forward = stuck
    try:
        asyncio.run(main())
    finally:
        release.set()
        engine.forward = inner


def test_a_typed_failure_whose_slots_cannot_be_freed_breaks_the_engine_not_the_loop(booted):
    """A forward refusing its inputs (a typed error) and then an engine that cannot even
    cancel: the request is answered, health says the engine is broken, and a later request is
    refused, never left waiting on a loop that died."""
    from agent.errors import PackageInputError

    engine = booted.engine
    inner, inner_cancel = engine.forward, engine.cancel
    calls = []

    def refusing(tokens, *rest):           # the prefill works; the first decode is refused
        calls.append(tokens.shape[1])
        if len(calls) == 2:
            raise PackageInputError("decode outside the package's ranges", field="batch",
                                    value=9, limit=8)
        return inner(tokens, *rest)

    def cannot_cancel(seq_id):
        raise RuntimeError("KV allocator corrupted")

    async def main():
        worker = Worker(dataclasses.replace(booted, engine=engine))
        conn = await Conn().open(worker)
        first = await conn.ask(gen(1, n=10))
        assert first[-1]["type"] == "error" and first[-1]["code"] == 503
        health = await conn.ask({"op": "health", "id": "h"})
        assert health[-1]["result"]["ok"] is False
        assert "KV allocator corrupted" in health[-1]["result"]["broken"]
        late = await conn.ask(gen(2))
        assert late[-1]["type"] == "error" and late[-1]["code"] == 503
        await conn.close()

    engine.forward, engine.cancel = refusing, cannot_cancel
    try:
        asyncio.run(main())
    finally:
        engine.forward, engine.cancel = inner, inner_cancel
        for seq in [*engine._active.values(), *engine._waiting]:   # the shared engine's slots
            inner_cancel(seq.seq_id)
        assert engine.kv.active == 0 and not engine.busy


def test_an_exception_outside_the_engine_calls_answers_the_held_requests(booted, monkeypatch):
    """A failure in the loop's own bookkeeping (here: delivering a token) is handled like an
    engine step's: the request is answered 503 and the next one is served."""
    from agent.replica.batching import BatchScheduler

    engine = booted.engine
    real = BatchScheduler._deliver
    calls = []

    def failing_once(self, events):
        if events:
            calls.append(len(events))
            if len(calls) == 1:
                raise KeyError("bookkeeping bug")
        return real(self, events)

    monkeypatch.setattr(BatchScheduler, "_deliver", failing_once)

    async def main():
        conn = await Conn().open(Worker(dataclasses.replace(booted, engine=engine)))
        first = await conn.ask(gen(1))
        assert first[-1]["type"] == "error" and first[-1]["code"] == 503
        assert "KeyError" in first[-1]["reason"]
        assert engine.kv.active == 0
        second = await conn.ask(gen(2))
        assert second[-1]["type"] == "done" and second[-1]["n_tokens"] == 3
        await conn.close()

    asyncio.run(main())


def test_a_second_request_with_an_id_in_flight_on_the_connection_is_refused_400(booted):
    """Two in-flight requests sharing an id on one connection: their answers could not be
    told apart, so the second is refused with a 400 naming the id; the first is served."""
    async def main():
        conn = await Conn().open(Worker(dataclasses.replace(booted, engine=booted.engine)))
        conn.writer.write(pack(gen(7, n=8)) + pack(dict(gen(7, n=8), tokens=[4, 5, 6, 7])))
        seen: list[dict] = []
        while not any(m["type"] == "done" for m in seen):
            data = await asyncio.wait_for(conn.reader.read(65536), 5)
            assert data, "worker closed the connection"
            seen.extend(conn.decoder.feed(data))
        errors = [m for m in seen if m["type"] == "error"]
        assert len(errors) == 1 and errors[0]["code"] == 400 and "already in flight" in \
            errors[0]["reason"]
        assert [m for m in seen if m["type"] == "done"][0]["n_tokens"] == 8
        await conn.close()

    asyncio.run(main())
