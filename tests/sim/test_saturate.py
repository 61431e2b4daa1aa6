"""What the replicas behind a front door sustain while backlogged, measured by clients
(agent/sim/replay.py ``saturate``), against a server of known capacity."""

from __future__ import annotations

import asyncio

import pytest

from agent.errors import ConfigError
from agent.sim import replay


class Server:
    """A front door whose replicas serve ``slots`` requests at a time, each for ``service_s``
    (so it sustains ``slots / service_s`` requests per second), answering every request with
    as many tokens as it asked for."""

    def __init__(self, slots: int, service_s: float, fail_after: int | None = None) -> None:
        self.sem = asyncio.Semaphore(slots)
        self.service_s, self.fail_after, self.seen = service_s, fail_after, []

    async def one_request(self, client, model, tokens, max_tokens, sent_s=0.0,
                          deadline_ms=None):
        self.seen.append((len(tokens), max_tokens, deadline_ms))
        async with self.sem:
            await asyncio.sleep(self.service_s)
        if self.fail_after is not None and len(self.seen) > self.fail_after:
            return replay.Outcome(429, reason="refused")
        return replay.Outcome(200, "warm_hit", tokens=[1] * max_tokens)


@pytest.fixture
def server(monkeypatch):
    def make(**kw):
        srv = Server(**kw)
        monkeypatch.setattr(replay, "one_request", srv.one_request)

        class Client:
            @classmethod
            async def connect(cls, host, port, max_retries=0):
                return cls()

            async def close(self):
                pass
        import agent.client
        monkeypatch.setattr(agent.client, "AsyncClient", Client)
        return srv
    return make


def test_the_rate_is_what_the_server_sustains_at_the_mix_sent(server):
    srv = server(slots=4, service_s=0.02)              # 200 requests/s at most
    got = asyncio.run(replay.saturate("127.0.0.1:1", "m", list(range(50)),
                                      [(8, 1), (16, 3)], concurrency=16, seconds=1.0,
                                      warmup_s=0.2))
    assert got.rps == pytest.approx(200.0, rel=0.15)
    assert got.batch == 16.0
    assert got.prompt_tokens == pytest.approx(12.0, abs=0.5)   # the two lengths in turn
    assert got.gen_tokens == pytest.approx(2.0, abs=0.25)
    # every request carried the calibration deadline, so admission held it
    assert {d for _, _, d in srv.seen} == {replay.CALIBRATION_DEADLINE_MS}


def test_requests_longer_than_the_window_are_measured_over_two_answers_a_client(server):
    # 8 slots, 1.5 s a request: 5.33 requests/s.  16 clients and a 1 s window: no request
    # is answered within it (was RuntimeError, or a rate of the few that were, over the
    # whole window); the run goes on until 32 are answered after the warm-up.
    srv = server(slots=8, service_s=1.5)
    got = asyncio.run(replay.saturate("127.0.0.1:1", "m", list(range(50)), [(8, 1)],
                                      concurrency=16, seconds=1.0, warmup_s=0.2))
    assert got.rps == pytest.approx(8 / 1.5, rel=0.2)
    assert len(srv.seen) >= 32
    # a cap on the time: what was answered within it, never a wait for ever
    srv = server(slots=8, service_s=1.5)
    got = asyncio.run(replay.saturate("127.0.0.1:1", "m", list(range(50)), [(8, 1)],
                                      concurrency=16, seconds=1.0, warmup_s=0.2, max_s=2.0))
    assert got.rps > 0 and len(srv.seen) <= 32


def test_a_refused_request_is_an_error_not_a_lower_rate(server):
    server(slots=2, service_s=0.01, fail_after=3)
    with pytest.raises(RuntimeError, match="429"):
        asyncio.run(replay.saturate("127.0.0.1:1", "m", [1, 2], [(4, 1)], concurrency=2,
                                    seconds=0.5, warmup_s=0.0))


@pytest.mark.parametrize("kw", [dict(concurrency=0), dict(seconds=0.0), dict(lengths=[]),
                                dict(warmup_s=-1.0)])
def test_arguments_out_of_range_are_config_errors(kw):
    args = dict(concurrency=2, seconds=1.0, lengths=[(1, 1)], warmup_s=0.0)
    args.update(kw)
    lengths = args.pop("lengths")
    with pytest.raises(ConfigError):
        asyncio.run(replay.saturate("127.0.0.1:1", "m", [1], lengths, **args))
