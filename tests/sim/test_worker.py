"""The simulated replica at the protocol level (agent/sim/worker.py) behind a production
ReplicaLink, and the simulated node agent (agent/sim/node.py): answers, the worker's
deadline refusal, draining, the replica cap, billing.  Virtual time only."""

from __future__ import annotations

import asyncio

import pytest

from agent.errors import ConfigError
from agent.frontdoor.links import ReplicaLink
from agent.protocol import DEFAULT_LIMITS, PROTOCOL_VERSION
from agent.sim.node import SimNode
from agent.sim.vloop import run_virtual
from agent.sim.worker import SimWorker
from agent.speed import SpeedProfile

SPEED = SpeedProfile(prefill_tokens_per_s=1000.0, prefill_overhead_s=0.02, decode_base_s=0.05,
                     decode_per_seq_s=0.01, decode_per_ctx_token_s=0.0)
SLOWER = SpeedProfile(prefill_tokens_per_s=500.0, prefill_overhead_s=0.04, decode_base_s=0.1,
                      decode_per_seq_s=0.02, decode_per_ctx_token_s=0.0)


class Owner:
    """A LinkOwner that records (time, message) per flight."""

    def __init__(self) -> None:
        self.answers: dict = {}
        self.failed: list[str] = []

    def on_answer(self, link, flight, message) -> None:
        self.answers.setdefault(flight, []).append((asyncio.get_running_loop().time(),
                                                    message))
        if message["type"] in ("done", "error"):
            link.in_flight.pop(message["id"], None)

    def replica_failed(self, link, reason) -> None:
        self.failed.append(reason)


def generate(prompt: int, max_tokens: int, **kw) -> dict:
    return {"v": PROTOCOL_VERSION, "op": "generate", "model": "m", "tokens": [1] * prompt,
            "max_tokens": max_tokens, **kw}


def session(worker: SimWorker, messages: list[dict], wait_s: float = 10.0) -> Owner:
    owner = Owner()

    async def main():
        link = ReplicaLink(owner, worker.replica_id, DEFAULT_LIMITS)
        await worker.connect(link)
        for i, m in enumerate(messages):
            link.dispatch(i, m)
        await asyncio.sleep(wait_s)
    run_virtual(main())
    return owner


def test_answers_first_token_after_its_prefill_and_done_after_its_decode_steps():
    worker = SimWorker("r1", "m", SPEED, max_seqs=4, max_seq_len=512)
    owner = session(worker, [generate(40, 3)])
    (t_first, first), (t_second, second), (t_done, done) = owner.answers[0]
    assert first["type"] == "tokens" and done["type"] == "done" and done["n_tokens"] == 3
    assert t_first == pytest.approx(SPEED.prefill_s(40))
    # two decode steps after the prefill (the prefill gave the first token); the stream
    # moves at each step, as the worker's does
    assert second["type"] == "tokens"
    assert t_second == pytest.approx(SPEED.prefill_s(40) + SPEED.decode_step_s(1, 40))
    assert t_done == pytest.approx(SPEED.prefill_s(40) + SPEED.decode_step_s(1, 40)
                                   + SPEED.decode_step_s(1, 41))


def test_each_first_token_is_sent_when_its_own_prefill_ends():
    worker = SimWorker("r1", "m", SPEED, max_seqs=4, max_seq_len=512, itl_target_s=0.0)
    owner = session(worker, [generate(40, 1), generate(300, 1)])
    first_a, first_b = owner.answers[0][0], owner.answers[1][0]
    assert first_a[0] == pytest.approx(SPEED.prefill_s(40))
    # whole, alone: in the engine's calls of prefill_chunk (256) tokens, each its overhead
    assert first_b[0] == pytest.approx(SPEED.prefill_s(40) + SPEED.prefill_s(256)
                                       + SPEED.prefill_s(44))


def test_a_prompt_longer_than_the_step_budget_is_prefilled_over_steps():
    """At the default ITL target (0.2 s) a step prefills at most (0.2 - 0.02) * 1000 = 180
    tokens here: the 300-token prompt (arriving during the first step) takes two steps,
    and its first token comes when the second one's call ends."""
    worker = SimWorker("r1", "m", SPEED, max_seqs=4, max_seq_len=512)
    assert worker.stats()["itl_target_s"] == 0.2
    owner = session(worker, [generate(40, 1), generate(300, 1)])
    first_a, first_b = owner.answers[0][0], owner.answers[1][0]
    assert first_a[0] == pytest.approx(SPEED.prefill_s(40))
    assert first_b[0] == pytest.approx(SPEED.prefill_s(40) + SPEED.prefill_s(180)
                                       + SPEED.prefill_s(120))
    assert worker.engine.calls == 3


def test_refuses_a_deadline_it_predicts_it_misses_with_the_workers_rule():
    worker = SimWorker("r1", "m", SPEED, max_seqs=4, max_seq_len=512)
    predicted_ms = SPEED.prefill_s(100) * 1000.0
    owner = session(worker, [generate(100, 2, deadline_ms=predicted_ms / 2),
                             generate(100, 2, deadline_ms=predicted_ms * 2)])
    (_, refused), = owner.answers[0]
    assert refused["type"] == "error" and refused["code"] == 429
    assert refused["predicted_ttft_ms"] == pytest.approx(predicted_ms, abs=1e-3)
    assert refused["retry_after_ms"] == max(1, round(predicted_ms - predicted_ms / 2))
    assert [m["type"] for _, m in owner.answers[1]] == ["tokens", "done"]
    assert worker.refused == 1 and worker.served == 1


def test_reports_and_predicts_with_its_meter_but_serves_at_its_own_speed():
    worker = SimWorker("r1", "m", SPEED, max_seqs=4, max_seq_len=512, reported=SLOWER)
    assert worker.predict_ttft_s(50) == pytest.approx(SLOWER.prefill_s(50))
    assert worker.stats()["prefill_tokens_per_s"] == SLOWER.prefill_tokens_per_s
    owner = session(worker, [generate(50, 1)])
    assert owner.answers[0][0][0] == pytest.approx(SPEED.prefill_s(50))


def test_a_draining_replica_answers_503_and_a_stopped_one_refuses_connections():
    worker = SimWorker("r1", "m", SPEED, max_seqs=4, max_seq_len=512)
    worker.draining = True
    owner = session(worker, [generate(10, 1)])
    (_, answer), = owner.answers[0]
    assert answer["code"] == 503 and answer["retry_after_ms"] == 1000
    worker.stop()
    with pytest.raises(ConnectionRefusedError):
        session(worker, [])


def test_node_caps_replicas_drains_after_in_flight_and_bills_every_live_second():
    async def main():
        loop = asyncio.get_running_loop()
        node = SimNode("m", SPEED, max_seqs=4, max_seq_len=512, restore_s=2.0, max_replicas=2)
        node.start_billing()
        first = node.start_warm()
        restored = await node.request_restore("m")           # a new one, 2 s
        assert restored.path == "snapshot_restore" and restored.restore_ms == pytest.approx(2000.0)
        assert loop.time() == pytest.approx(2.0)
        at_cap = await node.request_restore("m")             # at the cap: an existing one
        assert at_cap.path == "warm_hit" and node.restores == 1
        assert node.call("restore", model="m")["path"] == "warm"
        states = sorted(r["state"] for r in node.call("status")["replicas"])
        assert states == ["warm", "warm"]
        # a request in flight holds the drain
        link = ReplicaLink(Owner(), first.replica_id, DEFAULT_LIMITS)
        await node.connect(link, first.replica_id)
        link.dispatch(0, generate(10, 50))
        await asyncio.sleep(0)
        node.call("drain", replica=first.replica_id)
        assert first.replica_id not in {i.id for i in node.instances()}
        await node.settle()
        assert first.state == "dead" and first.dead_s > 2.0
        billed = node.replica_seconds()
        # 2 s of one replica and the restoring one, then both until the drain ended
        assert billed == pytest.approx(2 * 2.0 + (first.dead_s - 2.0) + (loop.time() - 2.0))
        with pytest.raises(ConfigError):
            node.call("scale", model="m")
    run_virtual(main())


def test_a_restore_that_finds_no_zygote_ready_waits_for_one_to_start():
    async def main():
        loop = asyncio.get_running_loop()
        node = SimNode("m", SPEED, max_seqs=4, max_seq_len=512, restore_s=1.0,
                       max_replicas=4, zygote_s=3.0)
        first, second = await asyncio.gather(node.request_restore("m"),
                                             node.request_restore("m"))
        # the first took the pool's zygote; the second started its own
        assert sorted([first.restore_ms, second.restore_ms]) == pytest.approx([1000.0, 4000.0])
        await asyncio.sleep(3.0)                     # the pool refills 3 s after a restore
        t0 = loop.time()
        third = await node.request_restore("m")
        assert third.restore_ms == pytest.approx(1000.0) and loop.time() - t0 == pytest.approx(1.0)
        with pytest.raises(ConfigError):
            SimNode("m", SPEED, max_seqs=4, max_seq_len=512, restore_s=1.0,
                    zygote_s=float("nan"))
    run_virtual(main())
