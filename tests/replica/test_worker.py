"""The replica worker in process: multiplexed generate, stats, errors, zygote restore, capture."""

import asyncio
import dataclasses

import pytest

from agent.replica import zygote
from agent.replica.synthetic import make_synthetic
from agent.replica.worker import State, Worker
from agent.protocol import Decoder, pack
from agent.snapshot.reader import HostBuffer
from agent.snapshot.writer import write_snapshot


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=3)


@pytest.fixture(scope="module")
def booted(model_dir):
    return zygote.boot(model_dir, max_seqs=4, max_seq_len=64)


@pytest.fixture(scope="module")
def snapshot(booted, tmp_path_factory):
    dest = tmp_path_factory.mktemp("s") / "snap"
    zygote.capture(booted, dest)
    return dest


async def _session(worker: Worker, messages: list[dict], *, final_ids=None) -> dict:
    """Start ``worker``, send ``messages`` on one connection, collect answers per id until every
    id has its final answer; shut the worker down.  Returns {id: [answers]}."""
    ready = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
    host, port = (await asyncio.wait_for(ready, 10)).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"".join(pack(m) for m in messages))
    pending = set(final_ids if final_ids is not None else (m["id"] for m in messages))
    answers: dict = {}
    decoder = Decoder()
    while pending:
        data = await asyncio.wait_for(reader.read(65536), 60)
        assert data, "worker closed the connection"
        for answer in decoder.feed(data):
            answers.setdefault(answer["id"], []).append(answer)
            if answer["type"] in ("done", "error", "result"):
                pending.discard(answer["id"])
    writer.write(pack({"op": "shutdown", "id": "bye"}))
    await asyncio.wait_for(serving, 30)
    writer.close()
    return answers


def run(worker, messages, **kw):
    return asyncio.run(_session(worker, messages, **kw))


def test_concurrent_requests_multiplex_on_one_connection(booted):
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5], [1, 2]]
    want = [booted.engine.generate([p], 6)[0] for p in prompts]
    want_seeded = booted.engine.generate([prompts[0]], 6, seed=42)[0]
    messages = [{"op": "generate", "id": i, "tokens": p, "max_tokens": 6} for i, p in enumerate(prompts)]
    messages.append({"op": "generate", "id": "s", "tokens": prompts[0], "max_tokens": 6, "seed": 42})
    answers = run(Worker(booted, replica_id="r1"), messages)
    for i in range(3):
        *tokens, done = answers[i]
        assert [t for a in tokens for t in a["tokens"]] == want[i]
        assert done["type"] == "done" and done["n_tokens"] == 6 and done["replica"] == "r1"
        assert done["path"] == "eager" and 0 <= done["ttft_ms"] <= done["total_ms"]
    assert [t for a in answers["s"][:-1] for t in a["tokens"]] == want_seeded


def test_stop_token_ends_a_sequence_early(booted):
    first = booted.engine.generate([[5, 6, 7]], 6)[0]
    answers = run(Worker(booted), [{"op": "generate", "id": 1, "tokens": [5, 6, 7],
                                    "max_tokens": 6, "stop": [first[2]]}])
    *tokens, done = answers[1]
    assert [t for a in tokens for t in a["tokens"]] == first[:first.index(first[2])]
    assert done["n_tokens"] == first.index(first[2])


def test_stats_report_kv_capacity_and_use(booted):
    answers = run(Worker(booted, replica_id="r2"), [{"op": "stats", "id": 1}, {"op": "health", "id": 2}])
    stats = answers[1][0]["result"]
    assert stats["kv_capacity_tokens"] == 4 * 64 and stats["max_seqs"] == 4
    assert stats["kv_used_tokens"] == 0 and stats["active_seqs"] == 0
    assert stats["state"] == "serving" and stats["model"] == "tiny" and stats["version"]
    assert answers[2][0]["result"] == {"ok": True, "state": "serving"}


def test_bad_requests_get_typed_errors_and_the_worker_keeps_serving(booted):
    messages = [
        {"op": "generate", "id": "big", "tokens": [1] * 60, "max_tokens": 5},     # 65 > 64
        {"op": "generate", "id": "fits", "tokens": [1] * 59, "max_tokens": 5},    # 64 = 64
        {"op": "generate", "id": "vocab", "tokens": [256], "max_tokens": 1},
        {"op": "generate", "id": "maxt", "tokens": [1], "max_tokens": 0},
        {"op": "generate", "id": "none", "max_tokens": 1},
        {"op": "restore", "id": "notzyg", "snapshot": "/nonexistent"},
        {"op": "teleport", "id": "op"},
    ]
    answers = run(Worker(booted), messages)
    big = answers["big"][-1]
    assert big["type"] == "error" and big["code"] == 413
    assert "65" in big["reason"] and "64" in big["reason"]
    assert answers["fits"][-1]["type"] == "done" and answers["fits"][-1]["n_tokens"] == 5
    for rid in ("vocab", "maxt", "none", "notzyg", "op"):
        assert answers[rid][-1]["type"] == "error" and answers[rid][-1]["code"] == 400, rid
    assert "256" in answers["vocab"][-1]["reason"]


def test_restore_into_a_zygote_gives_the_fresh_boot_tokens(booted, snapshot):
    prompt = [3, 1, 4, 1, 5]
    want = booted.engine.generate([prompt], 8)[0]
    worker = Worker(None, buffer=HostBuffer.allocate(1 << 20))
    assert worker.state is State.ZYGOTE
    answers = run(worker, [{"op": "generate", "id": "early", "tokens": prompt, "max_tokens": 1},
                           {"op": "stats", "id": "zs"},
                           {"op": "restore", "id": "r", "snapshot": str(snapshot)},
                           {"op": "generate", "id": "g", "tokens": prompt, "max_tokens": 8}])
    assert answers["early"][-1]["code"] == 400 and "zygote" in answers["early"][-1]["reason"]
    assert answers["zs"][0]["result"]["state"] == "zygote"
    assert answers["zs"][0]["result"]["kv_capacity_tokens"] == 0
    result = answers["r"][0]["result"]
    assert result["state"] == "serving" and result["path"] == "zygote_restore"
    assert result["kv_capacity_tokens"] == 4 * 64
    assert [t for a in answers["g"][:-1] for t in a["tokens"]] == want
    assert answers["g"][-1]["path"] == "zygote_restore"


def test_golden_mismatch_fails_the_restore_and_the_zygote_stays_empty(booted, snapshot, tmp_path):
    golden = booted.golden
    wrong = [list(e) for e in golden.expected]
    wrong[1][3] = (wrong[1][3] + 1) % booted.config.vocab_size
    bad = tmp_path / "bad"
    from agent.snapshot.reader import read_manifest
    extra = read_manifest(snapshot).extra
    write_snapshot(bad, booted.weights, model=booted.identity,
                   golden=dataclasses.replace(golden, expected=wrong), extra=extra)
    worker = Worker(None, buffer=HostBuffer.allocate(1 << 20))
    answers = run(worker, [{"op": "restore", "id": "bad", "snapshot": str(bad)},
                           {"op": "health", "id": "h"},
                           {"op": "restore", "id": "missing", "snapshot": str(tmp_path / "nope")},
                           {"op": "capture", "id": "cap", "dest": str(tmp_path / "c")}])
    error = answers["bad"][-1]
    assert error["type"] == "error" and "prompt 1, token 3" in error["reason"]
    assert answers["h"][0]["result"] == {"ok": False, "state": "zygote"}
    assert answers["missing"][-1]["type"] == "error"
    assert answers["cap"][-1]["code"] == 400
    assert worker.loaded is None


def test_capture_writes_a_snapshot_that_restores_with_its_golden_check(booted, tmp_path):
    dest = tmp_path / "cap"
    answers = run(Worker(booted), [{"op": "capture", "id": 1, "dest": str(dest)}])
    result = answers[1][0]["result"]
    assert result["total_bytes"] > 0 and result["golden_prompts"] == len(booted.golden.prompts)
    restored = zygote.restore(dest)
    assert restored.golden == booted.golden and restored.identity == booted.identity
    assert restored.engine.kv.max_seqs == 4 and restored.engine.kv.max_seq_len == 64


def test_engine_sizes_from_a_snapshot_are_checked_at_and_over_their_limits(booted):
    from agent.errors import ConfigError

    cfg = booted.config
    ok = {"max_seqs": zygote.MAX_SEQS_LIMIT, "max_seq_len": cfg.max_position_embeddings}
    assert zygote.check_engine_config(ok, cfg) == ok
    for name, over in (("max_seqs", zygote.MAX_SEQS_LIMIT + 1),
                       ("max_seq_len", cfg.max_position_embeddings + 1),
                       ("max_seqs", 0), ("max_seq_len", "64")):
        with pytest.raises(ConfigError) as err:
            zygote.check_engine_config({**ok, name: over}, cfg)
        assert err.value.name == name and err.value.value == over
    with pytest.raises(ConfigError):
        zygote.check_engine_config(None, cfg)


def test_control_ops_on_a_tcp_listener_need_tcp_control(booted, tmp_path):
    dest = tmp_path / "never"
    worker = Worker(booted, tcp_control=False)

    async def main():
        ready = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
        host, port = (await asyncio.wait_for(ready, 10)).rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(pack({"op": "capture", "id": "c", "dest": str(dest)})
                     + pack({"op": "shutdown", "id": "s"})
                     + pack({"op": "generate", "id": "g", "tokens": [5, 6, 7], "max_tokens": 2}))
        answers, decoder = {}, Decoder()
        while not all(k in answers and answers[k][-1]["type"] in ("done", "error")
                      for k in ("c", "s", "g")):
            data = await asyncio.wait_for(reader.read(65536), 60)
            assert data, "worker closed the connection"
            for answer in decoder.feed(data):
                answers.setdefault(answer["id"], []).append(answer)
        worker.stop()                           # the owner stops it, not a TCP client
        await asyncio.wait_for(serving, 30)
        writer.close()
        return answers

    answers = asyncio.run(main())
    for rid in ("c", "s"):
        assert answers[rid][-1]["type"] == "error" and answers[rid][-1]["code"] == 401
        assert "unix-socket" in answers[rid][-1]["reason"]
    assert answers["g"][-1]["type"] == "done"          # generation is what TCP is for
    assert not dest.exists()


def test_a_text_prompt_to_a_model_without_a_tokenizer_is_400(booted):
    answers = run(Worker(booted), [{"op": "generate", "id": "t", "prompt": "hello",
                                    "max_tokens": 2}])
    err = answers["t"][-1]
    assert err["type"] == "error" and err["code"] == 400
    assert "tokenizer" in err["reason"] and "tokens" in err["reason"]


def test_capture_never_writes_over_an_existing_path(booted, tmp_path):
    dest = tmp_path / "taken"
    dest.mkdir()
    (dest / "keep").write_text("mine")
    answers = run(Worker(booted), [{"op": "capture", "id": 1, "dest": str(dest)}])
    err = answers[1][-1]
    assert err["type"] == "error" and err["code"] == 409 and "already exists" in err["reason"]
    assert (dest / "keep").read_text() == "mine"


def test_a_framing_error_answers_what_was_before_it_then_closes(booted):
    import asyncio as aio

    async def main():
        worker = Worker(booted)
        ready = aio.get_running_loop().create_future()
        serving = aio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
        host, port = (await aio.wait_for(ready, 10)).rsplit(":", 1)
        reader, writer = await aio.open_connection(host, int(port))
        writer.write(pack({"op": "health", "id": "h"}) + b"\xc1")
        answers, decoder = [], Decoder()
        while data := await aio.wait_for(reader.read(65536), 30):
            answers += decoder.feed(data)
        worker.stop()
        await aio.wait_for(serving, 30)
        return answers

    answers = asyncio.run(main())
    assert answers[0]["id"] == "h" and answers[0]["type"] == "result"
    assert answers[-1]["type"] == "error" and answers[-1]["code"] == 400


def test_a_refused_forward_fails_its_requests_and_the_replica_serves_the_next(booted):
    """A forward that refuses a call (an AOT package's PackageInputError: nothing ran) answers
    the requests in that step with the error; the slots are freed and later requests work."""
    from agent.errors import PackageInputError

    engine = booted.engine
    inner = engine.forward

    def narrow(tokens, *rest):   # as a package compiled for S <= 4 would
        if tokens.shape[1] > 4:
            raise PackageInputError(f"tokens seq {tokens.shape[1]} is outside [1, 4]", package="p",
                                    argument="tokens", field="seq", value=tokens.shape[1], limit=[1, 4])
        return inner(tokens, *rest)

    engine.forward = narrow
    try:
        worker = Worker(dataclasses.replace(booted, engine=engine))
        first = run(worker, [{"op": "generate", "id": 1, "tokens": list(range(1, 9)), "max_tokens": 3}])
        assert first[1][-1]["type"] == "error" and "outside [1, 4]" in first[1][-1]["reason"]
        assert engine.kv.active == 0 and not engine.busy          # nothing leaked
        worker = Worker(dataclasses.replace(booted, engine=engine))
        second = run(worker, [{"op": "generate", "id": 2, "tokens": [1, 2, 3], "max_tokens": 3}])
        assert second[2][-1]["type"] == "done" and second[2][-1]["n_tokens"] == 3
    finally:
        engine.forward = inner
