"""A replica restores only captured replica snapshots: a weights-only `rewarm import` snapshot,
or a manifest missing or mangling a key the restore reads, is refused with SnapshotIncompatible
naming the snapshot and the key (never a KeyError), before any data is read; a zygote that
refused stays a zygote and still restores a good snapshot afterwards."""

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from agent.errors import SnapshotIncompatible
from agent.protocol import Decoder, pack
from agent.replica import zygote
from agent.replica.synthetic import make_synthetic
from agent.replica.worker import State, Worker
from agent.snapshot.manifest import read_manifest
from agent.snapshot.reader import HostBuffer
from agent.snapshot.safetensors_import import import_hf
from agent.snapshot.writer import DATA_NAME, write_snapshot

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_synthetic(tmp_path_factory.mktemp("m") / "tiny", "tiny", seed=5)


@pytest.fixture(scope="module")
def imported(model_dir, tmp_path_factory):
    dest = tmp_path_factory.mktemp("imp") / "snap-tiny"
    import_hf(model_dir, dest)
    return dest


@pytest.fixture(scope="module")
def booted(model_dir):
    return zygote.boot(model_dir, max_seqs=2, max_seq_len=64)


@pytest.fixture(scope="module")
def captured(booted, tmp_path_factory):
    dest = tmp_path_factory.mktemp("cap") / "snap"
    zygote.capture(booted, dest)
    return dest


def test_an_imported_snapshot_is_refused_naming_what_it_lacks(imported):
    assert sorted(read_manifest(imported).extra) == ["config", "source_files"]
    with pytest.raises(SnapshotIncompatible) as err:
        zygote.restore(imported)
    e = err.value
    assert e.path == imported
    assert e.missing == ["model_config", "engine", "golden"]
    assert e.mismatches == {"model_config": (None, "present"), "engine": (None, "present"),
                            "golden": (None, "present")}
    msg = str(e)
    assert str(imported) in msg and "rewarm import" in msg
    assert "lacks model_config, engine, golden" in msg
    assert "its extra keys: config, source_files" in msg
    assert "rewarm replica --model-dir" in msg


def test_the_refusal_comes_before_any_data_is_read(model_dir, tmp_path):
    # With a corrupt data file, reading the chunks first would raise SnapshotCorrupt instead,
    # and the zygote's buffer would have been overwritten.
    bad = tmp_path / "imp-corrupt"
    import_hf(model_dir, bad)
    with open(bad / DATA_NAME, "r+b") as f:
        f.seek(10)
        byte = f.read(1)[0]
        f.seek(10)
        f.write(bytes([byte ^ 0xFF]))
    buffer = HostBuffer.allocate(1 << 20)
    buffer.as_tensor(4096).fill_(0xAB)
    with pytest.raises(SnapshotIncompatible) as err:
        zygote.restore(bad, buffer=buffer)
    assert err.value.missing == ["model_config", "engine", "golden"]
    assert bool(buffer.as_tensor(4096).eq(0xAB).all())


def _rewrite(booted, captured, dest, *, golden="keep", **changes):
    """A copy of ``captured`` with its manifest's extra changed (None value: key removed)."""
    extra = dict(read_manifest(captured).extra)
    for key, value in changes.items():
        if value is None:
            extra.pop(key, None)
        else:
            extra[key] = value
    write_snapshot(dest, booted.weights, model=booted.identity,
                   golden=booted.golden if golden == "keep" else golden, extra=extra)
    return dest


@pytest.mark.parametrize("key", ["model_config", "engine", "golden"])
def test_a_captured_manifest_missing_a_key_is_refused_naming_it(booted, captured, tmp_path, key):
    if key == "golden":
        snap = _rewrite(booted, captured, tmp_path / "s", golden=None)
    else:
        snap = _rewrite(booted, captured, tmp_path / "s", **{key: None})
    with pytest.raises(SnapshotIncompatible) as err:
        zygote.restore(snap)
    assert err.value.missing == [key]
    assert f"lacks {key} " in str(err.value) and str(snap) in str(err.value)
    assert "rewarm import" not in str(err.value)   # not an import: not called one


@pytest.mark.parametrize("key, value", [("model_config", "tiny"), ("model_config", [1, 2]),
                                        ("aot_package", {"digest": "sha256:x"}),
                                        ("aot_package", {"digest": 1, "dir": "/x"}),
                                        ("aot_package", "pkg"), ("aot_package", {}),
                                        ("tokenizer_dir", 7)])
def test_a_malformed_manifest_key_is_refused_naming_key_and_value(booted, captured, tmp_path,
                                                                   key, value):
    snap = _rewrite(booted, captured, tmp_path / "s", **{key: value})
    with pytest.raises(SnapshotIncompatible) as err:
        zygote.restore(snap)
    assert list(err.value.mismatches) == [key]
    assert err.value.mismatches[key][0] == (type(value).__name__ if key == "model_config" else value)
    assert f"{key}=" in str(err.value) and str(snap) in str(err.value)


def test_a_golden_record_of_an_earlier_method_is_refused_before_any_data_is_read(
        booted, captured, tmp_path, caplog):
    """A snapshot whose golden tokens were recorded by the lockstep decode of earlier releases
    (no ``method``) cannot be checked exactly by the teacher-forced replay: refused as
    incompatible (the node agent drops it as stale and captures again), never served."""
    import dataclasses

    old = dataclasses.replace(booted.golden, method="")
    snap = _rewrite(booted, captured, tmp_path / "s", golden=old)
    with open(snap / DATA_NAME, "r+b") as f:     # reading the data first would say corrupt
        f.write(b"\xff" * 16)
    buffer = HostBuffer.allocate(1 << 20)
    buffer.as_tensor(4096).fill_(0xAB)
    with pytest.raises(SnapshotIncompatible) as err:
        zygote.restore(snap, buffer=buffer)
    assert err.value.mismatches == {"golden.method": ("", "teacher_forced/1")}
    assert "capture the snapshot again" in str(err.value) and str(snap) in str(err.value)
    assert bool(buffer.as_tensor(4096).eq(0xAB).all())
    assert zygote.warm_zygote(buffer, snap) is None     # nor warmed for
    assert "teacher_forced/1" in caplog.text and "cannot warm" in caplog.text


def test_optional_keys_absent_still_restore(booted, captured, tmp_path):
    snap = _rewrite(booted, captured, tmp_path / "s", aot_package=None, tokenizer_dir=None)
    loaded = zygote.restore(snap)
    assert loaded.golden == booted.golden and loaded.package_digest is None
    assert loaded.tokenizer_dir is None


async def _session(worker: Worker, messages: list[dict]) -> dict:
    ready = asyncio.get_running_loop().create_future()
    serving = asyncio.create_task(worker.serve("127.0.0.1:0", ready.set_result))
    host, port = (await asyncio.wait_for(ready, 10)).rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    answers: dict = {}
    decoder = Decoder()
    for message in messages:          # one at a time: each answer before the next op
        writer.write(pack(message))
        while message["id"] not in answers or answers[message["id"]][-1]["type"] not in (
                "done", "error", "result"):
            data = await asyncio.wait_for(reader.read(65536), 60)
            assert data, "worker closed the connection"
            for answer in decoder.feed(data):
                answers.setdefault(answer["id"], []).append(answer)
    writer.write(pack({"op": "shutdown", "id": "bye"}))
    await asyncio.wait_for(serving, 30)
    writer.close()
    return answers


def test_a_zygote_refuses_an_import_stays_a_zygote_then_restores_a_capture(
        booted, imported, captured):
    worker = Worker(None, buffer=HostBuffer.allocate(1 << 20))
    prompt = [3, 1, 4, 1, 5]
    answers = asyncio.run(_session(worker, [
        {"op": "restore", "id": "imp", "snapshot": str(imported)},
        {"op": "health", "id": "h1"},
        {"op": "generate", "id": "g0", "tokens": prompt, "max_tokens": 6, "seed": 1},
        {"op": "restore", "id": "cap", "snapshot": str(captured)},
        {"op": "generate", "id": "g1", "tokens": prompt, "max_tokens": 6, "seed": 1}]))
    refused = answers["imp"][-1]
    assert refused["type"] == "error" and refused["code"] == 500
    assert "model_config" in refused["reason"] and "rewarm import" in refused["reason"]
    assert answers["h1"][0]["result"] == {"ok": False, "state": "zygote"}
    assert answers["g0"][-1]["type"] == "error" and answers["g0"][-1]["code"] == 400
    assert answers["cap"][-1]["result"]["state"] == "serving"
    served = [t for a in answers["g1"] if a["type"] == "tokens" for t in a["tokens"]]
    assert served == booted.engine.generate([prompt], 6, seed=1)[0]
    assert worker.state is State.CLOSED


def test_the_cli_says_one_error_line_not_a_traceback(imported, tmp_path):
    sock = tmp_path / "r.sock"
    proc = subprocess.run([sys.executable, "-m", "agent.cli", "replica", "--threads", "1",
                           "--listen", f"unix:{sock}", "--snapshot", str(imported)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 65       # EX_DATAERR: the snapshot is not one a replica restores
    assert "Traceback" not in proc.stderr and "KeyError" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {imported}: a weights-only snapshot")
    assert "model_config" in lines[0] and not sock.exists()
