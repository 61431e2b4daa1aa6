"""agent/exitcodes.py: each kind of failure has its own documented status."""

from agent import exitcodes as x
from agent.client import error_from
from agent.errors import (AclDenied, ConfigError, DiskFull, GoldenMismatch, InvalidCheckpoint,
                          SnapshotCorrupt, SnapshotNotFound, Unauthorized, Unreachable)


def test_each_kind_has_its_code():
    assert x.exit_code(Unreachable("no agent", service="node agent")) == x.EX_UNAVAILABLE == 69
    assert x.exit_code(ConnectionRefusedError()) == x.EX_UNAVAILABLE
    assert x.exit_code(ConfigError("bad", name="n", value=1, limit=2)) == x.EX_CONFIG == 78
    assert x.exit_code(SnapshotCorrupt("chunk 3")) == x.EX_DATAERR == 65
    assert x.exit_code(InvalidCheckpoint("header")) == x.EX_DATAERR
    assert x.exit_code(SnapshotNotFound("none")) == x.EX_NOINPUT == 66
    assert x.exit_code(DiskFull("full")) == x.EX_IOERR == 74
    assert x.exit_code(Unauthorized("token")) == x.EX_NOPERM == 77
    assert x.exit_code(AclDenied("acl")) == x.EX_NOPERM
    assert x.exit_code(GoldenMismatch("tokens")) == x.FAILURE == 1


def test_a_servers_answer_is_a_refusal_not_a_local_error():
    # 409 comes back as ConfigError, but it was the server refusing, not this command's config
    for code in (429, 503, 504, 409, 404):
        assert x.exit_code(error_from({"code": code, "reason": "r"})) == x.EX_TEMPFAIL == 75
    for code in (400, 413):                  # the request itself is wrong: no retry helps
        assert x.exit_code(error_from({"code": code, "reason": "r"})) == x.EX_DATAERR == 65
    assert x.exit_code(error_from({"code": 401, "reason": "r"})) == x.EX_NOPERM
    assert x.exit_code(error_from({"code": 500, "reason": "bug"})) == x.FAILURE
    assert x.answered_by_server(ConfigError("local", name="n", value=1, limit=2)) is None


def test_codes_are_distinct_and_documented():
    codes = [x.USAGE, x.EX_DATAERR, x.EX_NOINPUT, x.EX_UNAVAILABLE, x.EX_IOERR, x.EX_TEMPFAIL,
             x.EX_NOPERM, x.EX_CONFIG]
    assert len(set(codes)) == len(codes)
    for code in codes:
        assert f"\n{code} " in x.__doc__
