"""Every refusal the request path decides carries its code (agent/wire/refusals.py) to the
sink, and a replica's code reaches the client only when it is one of the known ones."""

import asyncio
import pathlib
import sys

import msgpack

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from virtual_fleet import Fleet, Sink  # noqa: E402

from agent.frontdoor.msgpack_entrance import MsgpackSink  # noqa: E402
from agent.frontdoor.request import GenerateRequest  # noqa: E402
from agent.wire.refusals import REFUSALS, known_refusal  # noqa: E402


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def refusal_of(sink: Sink) -> str | None:
    assert sink.final is not None and sink.final["type"] == "error", sink.final
    return sink.final["refusal"]


def test_arrival_refusals_name_their_reason():
    async def main():
        f = Fleet(max_seqs=1, restore_s=10.0, measured_restores_s=(10.0,))
        f.submit(max_tokens=500)
        late = f.submit()                                   # nothing in sight starts it in 4 s
        assert late.code == 429 and refusal_of(late) == "deadline_unreachable"
        largest = f.replicas[0].load.kv_capacity_tokens
        big = f.submit(prompt_tokens=largest, max_tokens=16)
        assert big.code == 413 and refusal_of(big) == "too_large"
        unknown = Sink(f.clock, f.clock.now())
        f.path.submit(GenerateRequest("u", "nope", [1], None, 4), unknown)
        assert unknown.final["code"] == 404 and refusal_of(unknown) == "unknown_model"
        f.path.begin_stop(f.clock.now() + 5)
        draining = f.submit()
        assert draining.code == 503 and refusal_of(draining) == "draining"
    run(main())


def test_no_capacity_requester_and_no_warm_replica_is_no_capacity():
    async def main():
        f = Fleet(warm=0)
        s = f.submit()
        assert s.code == 503 and refusal_of(s) == "no_capacity"
    run(main())


def test_a_full_queue_is_queue_full():
    async def main():
        f = Fleet(max_seqs=1, restore_s=1.0, measured_restores_s=(1.0,), max_queue_depth=1)
        f.capacity.hang = True
        f.submit(max_tokens=500)
        held = f.submit()
        assert held.final is None
        over = f.submit()
        assert over.code == 429 and refusal_of(over) == "queue_full"
    run(main())


def test_queued_refusals_name_their_reason():
    async def main():
        # gone bad at a re-check: deadline_unreachable
        f = Fleet(max_seqs=1, restore_s=1.0, measured_restores_s=(0.5, 0.5, 3.0))
        f.capacity.hang = True
        f.submit(max_tokens=500)
        t0 = f.clock.now()
        held = f.submit()
        await f.timeline.run_until(t0 + 6)
        assert held.code == 429 and refusal_of(held) == "deadline_unreachable"
        # the deadline passed while queued (no re-check ran): deadline
        f = Fleet(max_seqs=1, restore_s=1.0, measured_restores_s=(1.0,))
        f.capacity.hang = True
        f.submit(max_tokens=500)
        held = f.submit()
        f.clock.advance(4.5)
        f.path.expire_queued()
        assert held.code == 504 and refusal_of(held) == "deadline"
    run(main())


def test_every_restore_failing_is_no_capacity_and_shutdown_is_draining_for_the_queued():
    async def main():
        f = Fleet(max_seqs=1, warm=0, restore_s=1.0, measured_restores_s=(1.0,))
        f.capacity.fail = True
        s = f.submit()
        await f.timeline.run_until(f.clock.now() + 3)
        assert s.code == 503 and refusal_of(s) == "no_capacity"
        f = Fleet(max_seqs=1, restore_s=1.0, measured_restores_s=(1.0,))
        f.capacity.hang = True
        f.submit(max_tokens=500)
        held = f.submit()
        f.path.begin_stop(f.clock.now() + 5)
        assert held.code == 503 and refusal_of(held) == "draining"
    run(main())


def test_a_link_lost_after_tokens_is_replica_failed():
    async def main():
        f = Fleet(warm=1)
        replica = f.replicas[0]
        s = f.submit()
        rid, flight = next(iter(replica.in_flight.items()))
        f.path.on_answer(replica, flight, {"id": rid, "type": "tokens", "tokens": [1]})
        f.path.replica_failed(replica, "connection to replica lost (reset)")
        assert s.code == 503 and refusal_of(s) == "replica_failed"
    run(main())


def test_a_replicas_refusal_is_passed_on_only_when_it_is_a_known_code():
    async def main():
        for theirs, passed in (("context_length", "context_length"), ("no such", None),
                               (7, None), (None, None)):
            f = Fleet(warm=1)
            replica = f.replicas[0]
            s = f.submit()
            rid, flight = next(iter(replica.in_flight.items()))
            message = {"id": rid, "type": "error", "code": 400, "reason": "too long"}
            if theirs is not None:
                message["refusal"] = theirs
            f.path.on_answer(replica, flight, message)
            assert s.code == 400 and refusal_of(s) == passed, theirs
    run(main())


def test_the_msgpack_entrance_writes_the_code_in_the_error_map():
    class Conn:
        def __init__(self):
            self.sent, self.done = [], []

        def send(self, data):
            self.sent.append(msgpack.unpackb(data))

        def finished(self, sink):
            self.done.append(sink)

    conn = Conn()
    MsgpackSink(conn, "a").error(429, "cannot start", 120, "deadline_unreachable")
    MsgpackSink(conn, "b").error(500, "bug")
    assert conn.sent[0]["refusal"] == "deadline_unreachable" and conn.sent[0]["id"] == "a"
    assert conn.sent[0]["retry_after_ms"] == 120 and conn.sent[0]["code"] == 429
    assert "refusal" not in conn.sent[1]


def test_known_refusal_takes_only_the_vocabulary():
    assert all(known_refusal(code) == code for code in REFUSALS)
    assert len(set(REFUSALS)) == len(REFUSALS)
    for bad in ("Deadline", "", None, 1, ["no_capacity"], b"no_capacity"):
        assert known_refusal(bad) is None
