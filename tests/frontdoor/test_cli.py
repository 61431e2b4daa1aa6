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
        [sys.executable, "-m", "agent.cli", "frontdoor", "--port", "0", "--model", "demo=2000",
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
        assert rewarm(["generate", "--model", "nope", "--address", address, "x"]) == 2
        assert "404" in capsys.readouterr().err
    finally:
        proc.terminate()
        assert proc.wait(10) == 0          # SIGTERM stops it cleanly, flushing events
    codes = [line.split('"code": ')[1].split(",")[0] for line in events.read_text().splitlines()]
    assert codes == ["200", "404"]


def test_frontdoor_refuses_an_open_bind_without_tokens():
    with pytest.raises(Exception, match="without tokens"):
        rewarm(["frontdoor", "--host", "0.0.0.0", "--port", "0"])
