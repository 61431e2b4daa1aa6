"""agent/progress.py: bars go to stderr on a terminal (forced here with REWARM_PROGRESS=1),
and nothing is written when stderr is not a terminal; the long commands use them."""

from agent import progress


def test_quiet_when_not_a_terminal(capsys, monkeypatch):
    monkeypatch.delenv("REWARM_PROGRESS", raising=False)
    with progress.bar(10, "work", unit="step") as b:
        b.update(10)
    assert capsys.readouterr().err == ""


def test_forced_on_and_byte_callback(capsys, monkeypatch):
    monkeypatch.setenv("REWARM_PROGRESS", "1")
    shown, close = progress.byte_callback("stage s1")
    shown(512, 2048)
    shown(2048, 2048)
    close()
    err = capsys.readouterr().err
    assert "stage s1" in err and "2.00k" in err        # 2048 bytes with a 1024 divisor
    monkeypatch.setenv("REWARM_PROGRESS", "0")
    with progress.bar(1, "off") as b:
        b.update(1)
    assert capsys.readouterr().err == ""


def test_import_shows_its_steps(tmp_path, capsys, monkeypatch):
    from agent.replica.synthetic import make_synthetic
    from agent.snapshot.safetensors_import import import_hf

    model = make_synthetic(tmp_path / "tiny", "tiny", seed=1)
    monkeypatch.setenv("REWARM_PROGRESS", "1")
    import_hf(model, tmp_path / "snap")
    err = capsys.readouterr().err
    assert "import: digest" in err and "import: load" in err
    monkeypatch.delenv("REWARM_PROGRESS")
    import_hf(model, tmp_path / "snap2")
    assert capsys.readouterr().err == ""
