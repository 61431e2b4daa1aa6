"""``rewarm replica --itl-target-ms``: the worker sets its engine's step target on every model
it serves, a boot's and a zygote restore's alike."""

import argparse
import asyncio

import pytest

from agent.replica import zygote
from agent.replica.synthetic import make_synthetic
from agent.replica.worker import Worker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=5)


def test_a_worker_sets_the_step_target_on_its_engine(model_dir):
    loaded = zygote.boot(model_dir, max_seqs=2, max_seq_len=64)
    default = loaded.engine.itl_target_s
    Worker(loaded)                              # none given: the engine keeps its default
    assert loaded.engine.itl_target_s == default
    Worker(loaded, itl_target_s=0.0)            # whole prompts
    assert loaded.engine.itl_target_s == 0.0
    Worker(loaded, itl_target_s=0.05)
    assert loaded.engine.itl_target_s == 0.05


def test_a_zygote_restore_gets_the_workers_step_target(model_dir, tmp_path):
    from agent.replica.worker_restore import RestoreOps

    loaded = zygote.boot(model_dir, max_seqs=2, max_seq_len=64)
    zygote.capture(loaded, tmp_path / "snap")
    worker = Worker(None, buffer=zygote.prepare_zygote(1, 64 << 20, shared=False),
                    itl_target_s=0.07)
    asyncio.run(RestoreOps(worker).restore({"snapshot": str(tmp_path / "snap")}))
    assert worker.loaded is not None and worker.loaded.engine.itl_target_s == 0.07


def test_the_flag_is_in_milliseconds_never_negative_and_at_most_an_hour():
    from agent.replica.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["replica", "--listen", "unix:/tmp/x.sock", "--zygote",
                              "--itl-target-ms", "150"])
    assert args.itl_target_ms == 150.0
    for bad in ("-1", "nan", "3600000.5", "1e309"):
        with pytest.raises(SystemExit):
            parser.parse_args(["replica", "--listen", "unix:/tmp/x.sock", "--zygote",
                               "--itl-target-ms", bad])
    args = parser.parse_args(["replica", "--listen", "unix:/tmp/x.sock", "--zygote",
                              "--itl-target-ms", "3600000"])     # an hour: the report's limit
    assert args.itl_target_ms == 3_600_000.0
