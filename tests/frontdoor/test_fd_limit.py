"""The front door at its descriptor limit: under ``resource.setrlimit`` in a
subprocess, more connections than descriptors each get an answer (served, or 429 and closed),
none hangs, and accept errors are logged once per interval, not once per failure."""

import asyncio
import subprocess
import sys
import textwrap

from agent.protocol import Decoder, pack

NOFILE = 64
CONNECTIONS = 120

CHILD = textwrap.dedent(f"""
    import asyncio, logging, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, ({NOFILE}, {NOFILE}))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from agent.cluster.local import LocalRegistry
    from agent.frontdoor.server import FrontDoor, FrontDoorConfig

    async def main():
        fd = FrontDoor(FrontDoorConfig(models={{"m": 5000.0}}, accept_log_interval_s=60.0),
                       registry=LocalRegistry())
        host, port = await fd.start()
        print(port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await fd.stop(grace_s=0.1)
    asyncio.run(main())
""")


async def one(port: int, results: list, hold: asyncio.Event) -> None:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        results.append(("connect", repr(exc)))
        return
    writer.write(pack({"op": "generate", "id": 1, "model": "m", "tokens": [1], "max_tokens": 1}))
    decoder, answer = Decoder(), None
    try:
        while answer is None:
            chunk = await asyncio.wait_for(reader.read(65536), 10.0)
            if not chunk:
                break
            for msg in decoder.feed(chunk):
                answer = msg
        results.append(("answer", answer and answer.get("code")))
    except TimeoutError:
        results.append(("hung", None))
    except OSError as exc:
        results.append(("reset", repr(exc)))
    await hold.wait()          # keep every connection open until all are counted
    writer.close()


def test_more_connections_than_descriptors_get_429_not_a_hang():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())

        async def main():
            results, hold = [], asyncio.Event()
            tasks = [asyncio.create_task(one(port, results, hold)) for _ in range(CONNECTIONS)]
            while len(results) < CONNECTIONS:
                await asyncio.sleep(0.05)
            hold.set()
            await asyncio.gather(*tasks)
            return results
        results = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        child.stdin.close()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    log = child.stderr.read()
    kinds = [k for k, _ in results]
    codes = [c for k, c in results if k == "answer"]
    assert "hung" not in kinds and "connect" not in kinds, results
    assert kinds.count("answer") == CONNECTIONS, results     # every one answered
    assert set(codes) <= {429, 503}, codes                  # 503: no replica here; 429: over
    assert codes.count(429) >= CONNECTIONS - NOFILE          # more than fit were refused
    assert "RLIMIT_NOFILE soft=64" in log and "at most" in log
    accept_lines = [line for line in log.splitlines() if "accept failed" in line]
    assert len(accept_lines) <= 2, accept_lines              # one per interval, with a count
    others = [line for line in log.splitlines() if "accept failed" not in line]
    assert not [line for line in others if "Too many open files" in line], others
