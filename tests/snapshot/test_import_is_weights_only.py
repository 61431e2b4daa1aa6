"""`rewarm import` makes a weights-only snapshot and says so: HF-layout tensors, the config under
extra.config, no golden check; replicas refuse it (tests/replica/test_restore_refusals.py)."""

import torch
from safetensors.torch import save_file

from agent.cli import main
from agent.snapshot.manifest import read_manifest


def test_import_says_it_is_weights_only_and_how_to_serve(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"hidden_size": 4}')
    save_file({"model.norm.weight": torch.ones(4)}, hf / "model.safetensors")
    assert main(["import", str(hf), str(tmp_path / "snap"), "--name", "m", "--version", "v1"]) == 0
    out = capsys.readouterr().out
    assert "m v1, 1 tensors" in out
    assert f"weights only: replicas do not restore it (serve with `rewarm replica --model-dir {hf}`)" in out
    m = read_manifest(tmp_path / "snap")
    assert m.golden is None and m.extra == {"config": {"hidden_size": 4},
                                            "source_files": ["model.safetensors"]}
    assert [t.name for t in m.tensors] == ["model.norm.weight"]
