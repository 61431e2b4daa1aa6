"""What the replica does for the OpenAI conventions the HTTP door promises: the context
error worded as vLLM words it, a chat without max_tokens filling the context, and token-id
prompts served by a model without a tokenizer."""

import asyncio

import pytest

from agent.replica import zygote
from agent.replica.synthetic import make_synthetic
from agent.replica.worker import Worker
from agent.protocol import Decoder, pack

CONTEXT = 64


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    model_dir = make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=3)
    return zygote.boot(model_dir, max_seqs=2, max_seq_len=CONTEXT)


def _answers(booted, messages: list[dict]) -> dict:
    async def main():
        worker = Worker(booted)
        ready = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
        host, port = (await asyncio.wait_for(ready, 10)).rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"".join(pack(m) for m in messages))
        pending, out, decoder = {m["id"] for m in messages}, {}, Decoder()
        while pending:
            data = await asyncio.wait_for(reader.read(65536), 60)
            assert data
            for answer in decoder.feed(data):
                out.setdefault(answer["id"], []).append(answer)
                if answer["type"] in ("done", "error"):
                    pending.discard(answer["id"])
        writer.write(pack({"op": "shutdown", "id": "bye"}))
        await asyncio.wait_for(serving, 30)
        writer.close()
        return out

    return asyncio.run(main())


def test_over_the_context_is_400_in_vllms_words(booted):
    answers = _answers(booted, [{"op": "generate", "id": 1, "tokens": [5] * 60,
                                 "max_tokens": 5}])
    err = answers[1][-1]
    assert err["type"] == "error" and err["code"] == 400
    assert err["reason"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested 65 "
        "tokens (60 in the messages, 5 in the completion). Please reduce the length of the "
        "messages or completion.")


def test_exactly_the_context_is_served(booted):
    answers = _answers(booted, [{"op": "generate", "id": 1, "tokens": [5] * 60,
                                 "max_tokens": 4, "ignore_eos": True}])
    assert answers[1][-1]["type"] == "done" and answers[1][-1]["n_tokens"] == 4


def test_fit_context_generates_what_the_context_leaves(booted):
    answers = _answers(booted, [{"op": "generate", "id": 1, "tokens": [5] * 54,
                                 "max_tokens": 4096, "fit_context": True}])
    done = answers[1][-1]
    assert done["type"] == "done" and done["n_tokens"] == CONTEXT - 54
    assert done["finish_reason"] == "length"


def test_fit_context_with_a_full_prompt_is_the_context_error(booted):
    answers = _answers(booted, [{"op": "generate", "id": 1, "tokens": [5] * CONTEXT,
                                 "max_tokens": 4096, "fit_context": True}])
    err = answers[1][-1]
    assert err["code"] == 400 and "maximum context length is 64 tokens" in err["reason"]


def test_detokenize_on_a_model_without_a_tokenizer_serves_the_tokens(booted):
    want = booted.engine.generate([[5, 6, 7]], 3)[0]
    answers = _answers(booted, [{"op": "generate", "id": 1, "tokens": [5, 6, 7],
                                 "max_tokens": 3, "detokenize": True}])
    *tokens, done = answers[1]
    assert done["type"] == "done" and [t for a in tokens for t in a["tokens"]] == want
    assert "text" not in done


def test_a_stop_string_still_needs_the_tokenizer(booted):
    answers = _answers(booted, [{"op": "generate", "id": 1, "tokens": [5, 6, 7],
                                 "max_tokens": 3, "stop": ["x"]}])
    err = answers[1][-1]
    assert err["code"] == 400 and err["reason"].startswith("stop:")
