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
    assert big["type"] == "error" and big["code"] == 400       # vLLM's status and words
    assert "maximum context length is 64 tokens" in big["reason"] and "65" in big["reason"]
    assert answers["fits"][-1]["type"] == "done" and answers["fits"][-1]["n_tokens"] == 5
    for rid in ("vocab", "maxt", "none", "notzyg", "op"):
        assert answers[rid][-1]["type"] == "error" and answers[rid][-1]["code"] == 400, rid
        assert "refusal" not in answers[rid][-1], rid       # a bad request, not a refusal
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


def test_a_data_listener_serves_generation_and_refuses_control_ops(booted, tmp_path):
    # the node agent's layout: control on a unix socket, a TCP data listener for other hosts
    dest = tmp_path / "never"
    sock = tmp_path / "w.sock"
    worker = Worker(booted, tcp_control=False)

    async def ask(opener, messages, ids):
        reader, writer = await opener()
        writer.write(b"".join(pack(m) for m in messages))
        answers, decoder = {}, Decoder()
        while not all(k in answers and answers[k][-1]["type"] in ("done", "error", "result")
                      for k in ids):
            data = await asyncio.wait_for(reader.read(65536), 60)
            assert data, "worker closed the connection"
            for answer in decoder.feed(data):
                answers.setdefault(answer["id"], []).append(answer)
        writer.close()
        return answers

    async def main():
        ready = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(worker.serve(f"unix:{sock}", ready.set_result,
                                                   data_listen="127.0.0.1:0"))
        await asyncio.wait_for(ready, 10)
        host, port = worker.data_address.rsplit(":", 1)
        tcp = await ask(lambda: asyncio.open_connection(host, int(port)),
                        [{"op": "capture", "id": "c", "dest": str(dest)},
                         {"op": "generate", "id": "g", "tokens": [5, 6, 7], "max_tokens": 2}],
                        ("c", "g"))
        unix = await ask(lambda: asyncio.open_unix_connection(str(sock)),
                         [{"op": "stats", "id": "s"}], ("s",))
        worker.stop()
        await asyncio.wait_for(serving, 30)
        return tcp, unix

    tcp, unix = asyncio.run(main())
    assert tcp["c"][-1]["type"] == "error" and tcp["c"][-1]["code"] == 401
    assert tcp["g"][-1]["type"] == "done" and unix["s"][-1]["type"] == "result"
    assert not dest.exists()


# --- text, chat, stop strings, sampling fields, cancel -----------------------------------

CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def texted(model_dir, tmp_path_factory):
    """The tiny model with a byte-level tokenizer (its 256 ids are the 256 bytes) and a chat
    template, so that text, chat and stop strings can be exercised without the real model."""
    import shutil

    from tokenizers import pre_tokenizers

    from agent.replica.tokenizer import build_from_gguf, save_tokenizer

    d = tmp_path_factory.mktemp("t") / "tiny-text"
    shutil.copytree(model_dir, d)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    save_tokenizer(build_from_gguf(alphabet, []), d, bos=None, eos=None, chat_template=CHATML)
    return zygote.boot(d, max_seqs=4, max_seq_len=128)


def _text(answers):
    return "".join(a.get("text", "") for a in answers if a["type"] == "tokens")


def test_text_prompt_stop_string_spanning_tokens_is_never_sent(texted):
    base = run(Worker(texted), [{"op": "generate", "id": 1, "prompt": "hello", "max_tokens": 20}])
    full = base[1][-1]["text"]
    assert base[1][-1]["finish_reason"] == "length" and base[1][-1]["n_tokens"] == 20
    assert _text(base[1]) == full and base[1][-1]["prompt_tokens"] == 5
    stop = full[5:8]                                  # three tokens of one byte each
    cut = full[:full.index(stop)]
    answers = run(Worker(texted), [{"op": "generate", "id": 2, "prompt": "hello",
                                    "max_tokens": 20, "stop": ["zzz-never", stop]}])
    done = answers[2][-1]
    assert done["finish_reason"] == "stop" and done["text"] == cut
    assert _text(answers[2]) == cut                   # nothing past (or of) the stop string
    assert done["n_tokens"] == full.index(stop) + len(stop)


def test_stop_strings_on_a_token_prompt_give_text_too(texted):
    ids = [104, 105]
    base = run(Worker(texted), [{"op": "generate", "id": 1, "tokens": ids, "max_tokens": 12}])
    assert "text" not in base[1][-1]                 # tokens in, tokens out
    answers = run(Worker(texted), [{"op": "generate", "id": 1, "tokens": ids, "max_tokens": 12,
                                    "stop": ["\x00never"]}])
    assert answers[1][-1]["text"] == _text(answers[1]) and len(answers[1][-1]["text"]) > 0


def test_chat_messages_use_the_model_template(texted):
    msgs = [{"role": "user", "content": "hi"}]
    answers = run(Worker(texted), [{"op": "generate", "id": "c", "messages": msgs,
                                    "max_tokens": 4, "seed": 1, "temperature": 0.0}])
    prompt = "<|user|>hi\n<|assistant|>"
    same = run(Worker(texted), [{"op": "generate", "id": "p", "prompt": prompt, "max_tokens": 4}])
    assert answers["c"][-1]["text"] == same["p"][-1]["text"]
    assert answers["c"][-1]["prompt_tokens"] == len(prompt)
    none = run(Worker(texted.__class__(**{**vars(texted), "tokenizer_dir": None})),
               [{"op": "generate", "id": "n", "messages": msgs}])
    assert none["n"][-1]["code"] == 400 and "template" in none["n"][-1]["reason"]


def test_sampling_fields_reach_the_engine_and_max_tokens_defaults(booted):
    msg = {"op": "generate", "tokens": [5, 6, 7], "max_tokens": 8, "seed": 9}
    answers = run(Worker(booted), [{**msg, "id": 1, "temperature": 1.5},
                                   {**msg, "id": 2, "temperature": 1.5},
                                   {**msg, "id": 3, "temperature": 0.0},
                                   {**msg, "id": 4, "temperature": 1.5, "top_k": 1},
                                   {"op": "generate", "id": 5, "tokens": [5, 6, 7]},
                                   {**msg, "id": 6, "top_p": 2.0}])
    toks = {i: [t for a in answers[i][:-1] for t in a["tokens"]] for i in (1, 2, 3, 4, 5)}
    greedy = booted.engine.generate([[5, 6, 7]], 8)[0]
    assert toks[1] == toks[2] and toks[3] == greedy == toks[4]
    assert len(toks[5]) == 16 and answers[5][-1]["finish_reason"] == "length"
    assert answers[6][-1]["code"] == 400 and "top_p" in answers[6][-1]["reason"]


async def _streaming(loaded, request_id):
    """A worker over ``loaded`` on TCP with one 60-token generate sent and its first answer
    read: ``(worker, serving task, reader, writer, decoder, answers so far)``."""
    worker = Worker(loaded)
    ready = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
    host, port = (await asyncio.wait_for(ready, 10)).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(pack({"op": "generate", "id": request_id, "tokens": [1, 2], "max_tokens": 60}))
    decoder, seen = Decoder(), []
    while not seen:
        seen += decoder.feed(await asyncio.wait_for(reader.read(65536), 30))
    return worker, serving, reader, writer, decoder, seen


def test_cancel_frees_the_slot_and_sends_nothing_more(booted):
    async def main():
        worker, serving, reader, writer, decoder, seen = await _streaming(booted, 7)
        writer.write(pack({"op": "cancel", "id": 7}) + pack({"op": "cancel", "id": 99}))
        for _ in range(200):                            # the next ticks cancel it
            await asyncio.sleep(0.01)
            if not booted.engine.busy:
                break
        writer.write(pack({"op": "stats", "id": "s"}))
        while seen[-1].get("id") != "s":
            seen += decoder.feed(await asyncio.wait_for(reader.read(65536), 30))
        writer.write(pack({"op": "shutdown", "id": "bye"}))
        await asyncio.wait_for(serving, 30)
        writer.close()
        return seen

    seen = asyncio.run(main())
    assert seen[-1]["result"]["active_seqs"] == 0
    assert not [m for m in seen if m.get("id") == 7 and m["type"] != "tokens"]
    assert len([m for m in seen if m.get("id") == 7]) < 60


def test_detokenize_gives_text_for_a_token_prompt(texted):
    answers = run(Worker(texted), [{"op": "generate", "id": 1, "tokens": [104, 105],
                                    "max_tokens": 6, "detokenize": True}])
    done = answers[1][-1]
    assert done["text"] == _text(answers[1]) and done["n_tokens"] == 6 and done["text"]


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


def test_stop_lists_past_the_protocol_limits_are_400_at_the_replica_too(texted):
    # The front door refuses these; a client reaching the replica's port directly must not
    # make every token cost thousands of string searches on the replica's event loop.
    from agent.protocol import DEFAULT_LIMITS

    many = ["x%d" % i for i in range(DEFAULT_LIMITS.max_stop + 1)]
    long = "y" * (DEFAULT_LIMITS.max_stop_bytes + 1)
    answers = run(Worker(texted), [
        {"op": "generate", "id": "many", "prompt": "hello", "max_tokens": 2, "stop": many},
        {"op": "generate", "id": "long", "prompt": "hello", "max_tokens": 2, "stop": [long]},
        {"op": "generate", "id": "ok", "prompt": "hello", "max_tokens": 2,
         "stop": many[:DEFAULT_LIMITS.max_stop]}])
    for rid in ("many", "long"):
        assert answers[rid][-1]["type"] == "error" and answers[rid][-1]["code"] == 400, rid
        assert "stop" in answers[rid][-1]["reason"]
    assert answers["ok"][-1]["type"] == "done"


def test_stopping_frees_the_kv_slots_of_requests_it_held(booted):
    # the engine outlives the server (an in-process replica, this module's shared model):
    # a request answered 503 at shutdown must not keep its slot
    async def main():
        worker, serving, reader, writer, decoder, seen = await _streaming(booted, 1)
        worker.stop()
        await asyncio.wait_for(serving, 30)
        while seen[-1]["type"] == "tokens":
            data = await asyncio.wait_for(reader.read(65536), 30)
            if not data:
                break
            seen += decoder.feed(data)
        writer.close()
        for _ in range(200):
            if not booted.engine.busy:
                break
            await asyncio.sleep(0.01)
        return seen

    seen = asyncio.run(main())
    assert seen[-1]["type"] == "error" and seen[-1]["code"] == 503
    assert not booted.engine.busy and booted.engine.capacity()["active_seqs"] == 0


def test_a_serving_worker_loads_its_tokenizer_before_the_first_request(texted):
    import time

    worker = Worker(texted)            # constructed serving: the text side loads at once
    deadline = time.monotonic() + 30
    while (worker.text._tokenizer is None or worker.text._chat_template is None) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.text._tokenizer is not None and worker.text._chat_template not in (None, False)


def test_a_zygote_warmed_for_a_snapshot_preloads_its_tokenizer(texted, tmp_path):
    from agent.replica import model_text

    snap = tmp_path / "snap"
    zygote.capture(texted, snap)
    model_text._PRELOADED.pop(texted.tokenizer_dir, None)
    zygote.prepare_zygote(1, 1 << 20, prefault=False, warm=snap)
    assert texted.tokenizer_dir in model_text._PRELOADED
    restored = zygote.restore(snap, buffer=None)
    text = model_text.ModelText(restored)
    assert text.tokenizer() is model_text._PRELOADED[texted.tokenizer_dir]   # not loaded again


def test_a_corrupt_tokenizer_is_a_typed_error_and_never_stops_a_warm_zygote(texted, tmp_path):
    import shutil

    from agent.errors import InvalidCheckpoint
    from agent.replica import model_text
    from agent.replica.tokenizer import load_tokenizer

    bad = tmp_path / "bad"
    shutil.copytree(texted.tokenizer_dir, bad)
    (bad / "tokenizer.json").write_text('{"not": "a tokenizer"')
    with pytest.raises(InvalidCheckpoint, match="tokenizer"):
        load_tokenizer(bad)
    model_text.preload_tokenizer(str(bad))          # left to the request that needs it
    assert str(bad) not in model_text._PRELOADED
    text = model_text.ModelText(dataclasses.replace(texted, tokenizer_dir=str(bad)))
    text.preload()                                  # no exception out of the preload thread
    assert not text.has_tokenizer()
