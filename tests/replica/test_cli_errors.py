"""Bad input to ``rewarm model import-gguf`` and ``rewarm build`` is a typed error naming the
path or device, the value found and what was expected: one ``error:`` line, never a traceback."""

from __future__ import annotations

from agent import exitcodes
import pytest

from agent.cli import main
from agent.errors import ConfigError, InvalidCheckpoint
from agent.replica.gguf_import import import_gguf


def test_a_file_that_is_not_gguf_names_the_magic_found(tmp_path, capsys):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x08\x00\x00\x00{}" + b"\0" * 64)
    with pytest.raises(InvalidCheckpoint) as info:
        import_gguf(bad, tmp_path / "out")
    err = info.value
    assert (err.path, err.field, err.value, err.limit) == (bad, "magic", b"\x08\x00\x00\x00", b"GGUF")
    assert str(bad) in str(err) and "not a GGUF file" in str(err)
    assert main(["model", "import-gguf", str(bad), str(tmp_path / "out")]) == exitcodes.EX_DATAERR
    out = capsys.readouterr().err
    assert out.startswith(f"error: {bad}: not a GGUF file: magic ") and out.count("\n") == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("content, what", [(None, "does not exist"), (b"", "magic b''"),
                                           (b"GG", "magic b'GG'")])
def test_missing_empty_or_short_files_are_named(tmp_path, content, what):
    path = tmp_path / "x.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InvalidCheckpoint, match=what) as info:
        import_gguf(path, tmp_path / "out")
    assert info.value.path == path


def test_a_directory_is_not_a_gguf_file(tmp_path):
    with pytest.raises(InvalidCheckpoint, match="is a directory"):
        import_gguf(tmp_path, tmp_path / "out")


def test_gguf_magic_with_a_bad_header_is_invalid_checkpoint(tmp_path):
    path = tmp_path / "v99.gguf"
    path.write_bytes(b"GGUF" + (99).to_bytes(4, "little") + b"\0" * 32)
    with pytest.raises(InvalidCheckpoint, match="version 99") as info:
        import_gguf(path, tmp_path / "out")
    assert info.value.field == "header"


def test_build_for_cuda_without_cuda_is_a_config_error(tmp_path, monkeypatch, capsys):
    import agent.replica.targets as targets
    from agent.replica.aot import build
    from agent.replica.targets import current_target

    monkeypatch.setattr(targets, "gpu_target", lambda index=0: None)   # no CUDA device seen
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError) as info:
        current_target("cuda")
    err = info.value
    assert (err.name, err.value, err.limit) == ("device", "cuda", ["cpu"])
    assert "'cuda'" in str(err) and "0 CUDA device(s)" in str(err)
    with pytest.raises(ConfigError, match="'tpu'"):
        current_target("tpu")
    with pytest.raises(ConfigError):   # refused before the (missing) model is read
        build(tmp_path / "tiny", tmp_path / "rel", device="cuda")
    assert main(["build", str(tmp_path / "tiny"), "--out", str(tmp_path / "rel"),
                 "--device", "cuda"]) == exitcodes.EX_CONFIG
    out = capsys.readouterr().err
    assert out.startswith("error: --device 'cuda' cannot be used here") and out.count("\n") == 1
