"""Pins are compared before a byte is read; each mismatch is named with both values."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from agent.errors import SnapshotIncompatible
from agent.snapshot.format import FORMAT_VERSION, MANIFEST_NAME, Pins
from agent.snapshot.pins import check_pins, machine_pins
from agent.snapshot.reader import restore_snapshot
from agent.snapshot.writer import DATA_NAME

OTHER = {"format_version": 99, "torch": "1.0.0", "cuda_driver": "570.86", "gpu_name": "NVIDIA H100",
         "gpu_cc": "9.0", "cpu_isa": "NOT-THIS-ISA", "python_abi": "cpython-39-x", "rewarm": "0.0.1"}


def test_machine_pins_on_cpu():
    p = machine_pins("cpu")
    assert p.format_version == FORMAT_VERSION and p.torch == torch.__version__
    assert p.cuda_driver == "cpu" and p.gpu_name is None and p.gpu_cc is None
    assert p.cpu_isa == torch.backends.cpu.get_cpu_capability() and p.python_abi.startswith("cpython-311")


@pytest.mark.parametrize("pin", [f.name for f in dataclasses.fields(Pins)])
def test_each_pin_mismatch_is_refused_before_reading(make_snapshot, pin):
    path, manifest = make_snapshot()
    (path / DATA_NAME).unlink()            # proves no data is touched: that would be SnapshotCorrupt
    machine = dataclasses.replace(machine_pins("cpu"), **{pin: OTHER[pin]})
    with pytest.raises(SnapshotIncompatible) as err:
        restore_snapshot(path, machine=machine)
    snap_value = getattr(manifest.pins, pin)
    assert err.value.mismatches == {pin: (snap_value, OTHER[pin])}
    assert pin in str(err.value) and repr(OTHER[pin]) in str(err.value) and repr(snap_value) in str(err.value)


def test_all_differing_pins_are_named():
    a = machine_pins("cpu")
    b = dataclasses.replace(a, torch="9.9", cpu_isa="X")
    with pytest.raises(SnapshotIncompatible) as err:
        check_pins(a, b, "p")
    assert err.value.mismatches == {"torch": (a.torch, "9.9"), "cpu_isa": (a.cpu_isa, "X")}
    check_pins(a, dataclasses.replace(a), "p")  # equal pins pass


def test_envelope_format_version_mismatch(make_snapshot):
    path, _ = make_snapshot()
    env = msgpack.unpackb((path / MANIFEST_NAME).read_bytes())
    env["format_version"] = FORMAT_VERSION + 1
    (path / MANIFEST_NAME).write_bytes(msgpack.packb(env, use_bin_type=True))
    with pytest.raises(SnapshotIncompatible) as err:
        restore_snapshot(path)
    assert err.value.mismatches == {"format_version": (FORMAT_VERSION + 1, FORMAT_VERSION)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_gpu_snapshot_on_a_cpu_machine_names_the_gpu_pins(make_snapshot):
    gpu_pins = dataclasses.replace(machine_pins("cpu"), cuda_driver="570.86.15", gpu_name="NVIDIA H200", gpu_cc="9.0")
    path, _ = make_snapshot(pins=gpu_pins)
    with pytest.raises(SnapshotIncompatible) as err:
        restore_snapshot(path)
    assert err.value.mismatches == {"cuda_driver": ("570.86.15", "cpu"), "gpu_name": ("NVIDIA H200", None),
                                    "gpu_cc": ("9.0", None)}
