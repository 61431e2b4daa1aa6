"""``rewarm frontdoor`` as a process and ``rewarm generate`` against it."""

import asyncio
import os
import pathlib
import subprocess
import sys
import threading

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from stub_replica import StubReplica  # noqa: E402

from agent import exitcodes
from agent.cli import main as rewarm  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def stub_port():
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    stub = asyncio.run_coroutine_threadsafe(StubReplica("demo").start(), loop).result(5)
    yield stub.port
    loop.call_soon_threadsafe(loop.stop)


@pytest.mark.slow  # a subprocess importing every component's CLI (torch among them)
def test_frontdoor_process_serves_generate_and_writes_events(stub_port, tmp_path, capsys):
    events = tmp_path / "events.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "frontdoor", "--port", "0", "--http-port", "0",
         "--model", "demo=2000",
         "--replica", f"demo@127.0.0.1:{stub_port}", "--events", str(events)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line
        address = line.split()[-1]
        assert rewarm(["generate", "--model", "demo", "--address", address,
                       "--max-tokens", "3", "hello"]) == 0
        out, err = capsys.readouterr()
        assert out.split() == ["0", "1", "2"] and "path warm_hit" in err
        assert rewarm(["generate", "--model", "nope", "--address", address, "x"]) == exitcodes.EX_TEMPFAIL
        assert "404" in capsys.readouterr().err
        # token ids instead of text (the stub counts on from the prompt's length)
        assert rewarm(["generate", "--model", "demo", "--address", address,
                       "--max-tokens", "2", "--tokens", "7,8,9"]) == 0
        assert capsys.readouterr().out.split() == ["3", "4"]
        assert rewarm(["generate", "--model", "demo", "--address", address]) == 2
        assert "exactly one" in capsys.readouterr().err
    finally:
        proc.terminate()
        assert proc.wait(10) == 0          # SIGTERM stops it cleanly, flushing events
    codes = [line.split('"code": ')[1].split(",")[0] for line in events.read_text().splitlines()]
    assert codes == ["200", "404", "200"]


def test_frontdoor_refuses_an_open_bind_without_tokens(capsys):
    assert rewarm(["frontdoor", "--host", "0.0.0.0", "--port", "0"]) == exitcodes.EX_CONFIG
    assert "without tokens" in capsys.readouterr().err


def _byte_level_tokenizer():
    """A small byte-level BPE: every byte is a token, plus a few merges for common words."""
    from tokenizers import pre_tokenizers

    from agent.replica.tokenizer import build_from_gguf

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ P", "ĠP a", "ĠPa r", "ĠPar i", "ĠPari s", "Ġ C", "ĠC a", "ĠCa f"]
    tokens = alphabet + ["".join(m.split()) for m in merges]
    return build_from_gguf(tokens, merges)


def test_generate_prints_the_decoded_text_with_no_added_spaces(monkeypatch, capsys):
    import agent.client

    tok = _byte_level_tokenizer()
    text = " Paris.\n Café 日本!"
    ids = tok.encode(text).ids
    assert len(ids) > 6 and tok.decode(ids) == text
    # Multi-byte characters span several tokens, each decoding to U+FFFD on its own.
    assert "\ufffd" in "".join(tok.decode([i]) for i in ids)

    class FakeClient:   # what a replica sends: each chunk decoded alone, then the whole text
        def __init__(self, host, port, **kw):
            pass

        def stream(self, model, prompt, **kw):
            for i in ids:
                yield {"type": "tokens", "tokens": [i], "text": tok.decode([i])}
            yield {"type": "done", "ttft_ms": 1.0, "total_ms": 2.0, "path": "warm_hit",
                   "replica": "r1", "n_tokens": len(ids), "text": tok.decode(ids)}

        def close(self):
            pass

    monkeypatch.setattr(agent.client, "Client", FakeClient)
    assert rewarm(["generate", "--model", "m", "--address", "127.0.0.1:1", "The capital"]) == 0
    out = capsys.readouterr().out
    assert out == tok.decode(ids) + "\n"


def test_text_stream_writes_ascii_as_it_arrives_and_ids_with_spaces():
    import io

    from agent.frontdoor.cli import TextStream

    buf = io.StringIO()
    stream = TextStream(buf)
    stream.tokens({"tokens": [1], "text": "The"})
    stream.tokens({"tokens": [2], "text": " capital"})
    assert buf.getvalue() == "The capital"          # streamed, nothing invented
    stream.done({"text": "The capital"})
    assert buf.getvalue() == "The capital"
    ids = io.StringIO()
    stream = TextStream(ids)
    stream.tokens({"tokens": [0, 1]})
    stream.tokens({"tokens": [2]})
    stream.done({})
    assert ids.getvalue() == "0 1 2"


def test_slo_flags_parse_and_refuse_nonsense():
    from agent.errors import ConfigError
    from agent.frontdoor.cli import _slos

    assert _slos(["m=1500,3000", "n=100,200.5"]) == {"m": (1500.0, 3000.0), "n": (100.0, 200.5)}
    for bad in ("m=1500", "m=0,3000", "=1,2", "m=a,b"):
        with pytest.raises(ConfigError, match="--slo"):
            _slos([bad])


SIGTERM_IN_START = """
import os, signal, sys
import agent.frontdoor.server as server

class Door(server.FrontDoor):
    async def start(self):
        out = await super().start()
        os.kill(os.getpid(), signal.SIGTERM)   # the supervisor stops it while it starts
        return out

    async def stop(self):
        await super().stop()
        print("stopped", flush=True)

server.FrontDoor = Door
from agent.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_sigterm_while_the_door_starts_stops_it_cleanly(tmp_path):
    # the door listens (and is announced) before its signal handlers were installed: a
    # SIGTERM then killed it outright (rc -15), its events unflushed and its Consul
    # registration left behind
    proc = subprocess.run([sys.executable, "-c", SIGTERM_IN_START, "frontdoor", "--port", "0",
                           "--no-http", "--model", "demo=2000",
                           "--events", str(tmp_path / "events.jsonl")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert (proc.returncode, "Traceback" in proc.stderr) == (0, False), proc.stderr[-2000:]
    assert "stopped" in proc.stdout
