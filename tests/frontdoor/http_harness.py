"""A front door with its HTTP entrance over stub replicas, for the HTTP tests (loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from text_stub import TextStub  # noqa: E402

from agent.cluster.local import LocalRegistry  # noqa: E402
from agent.frontdoor.http_entrance import HttpConfig, HttpEntrance  # noqa: E402
from agent.frontdoor.server import FrontDoor, FrontDoorConfig  # noqa: E402


class ManualClock:
    """A clock the test moves (for the sweeper's timeouts: no test sleeps on them)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


@contextlib.asynccontextmanager
async def http_door(*, stubs: int = 1, hold: bool = False, capacity=None, auth=None,
                    models=None, http: dict | None = None, clock=None,
                    fail_with: int | None = None, **cfg):
    """Yields ``(fd, entrance, stubs)``; the entrance's URL is ``entrance.url``."""
    registry = LocalRegistry()
    replicas = []
    for i in range(stubs):
        stub = await TextStub("m", f"t{i}", hold=hold, fail_with=fail_with).start()
        registry.register(stub.instance(), 60)
        replicas.append(stub)
    config = FrontDoorConfig(models={"m": 5000.0}, **cfg)
    fd = FrontDoor(config, registry=registry, capacity=capacity, auth=auth)
    await fd.start()
    entrance = HttpEntrance(fd.path, HttpConfig(port=0, **(http or {})), clock=clock or fd.clock,
                            auth=fd.auth, models=models)
    await entrance.start()
    try:
        yield fd, entrance, replicas
    finally:
        entrance.close_listener()
        await fd.stop(grace_s=0.1)
        await entrance.stop()
        for stub in replicas:
            await stub.stop()


def client(entrance, api_key: str = "none"):
    import openai

    return openai.AsyncOpenAI(base_url=entrance.url + "/v1", api_key=api_key, max_retries=0)


async def raw_http(entrance, data: bytes, *, timeout_s: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection; return everything read until the server closes
    or ``timeout_s`` passes without a byte."""
    host, port = entrance.address
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    out = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), timeout_s)
            if not chunk:
                break
            out += chunk
    except TimeoutError:
        pass
    writer.close()
    return out


def run(coro, timeout_s: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))
