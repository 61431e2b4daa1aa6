"""agent/logs.py: JSON lines carry time, level, component, message and the known fields."""

import io
import json
import logging

import pytest

from agent import logs
from agent.cli import main


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_json_line_has_the_fields(restore_root):
    out = io.StringIO()
    logs.setup("INFO", "json", out)
    logging.getLogger("agent.node.agent").info("replica %s warm", "r1",
                                               extra={"model": "m", "replica": "r1",
                                                      "request_id": 7})
    logging.getLogger("agent.x").debug("not shown")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert set(rec) == {"time", "level", "component", "message", "model", "replica", "request_id"}
    assert (rec["level"], rec["component"], rec["message"]) == ("INFO", "node.agent", "replica r1 warm")
    assert (rec["model"], rec["replica"], rec["request_id"]) == ("m", "r1", 7)
    assert rec["time"].endswith("Z") and rec["time"][10] == "T"


def test_json_exception_is_one_line(restore_root):
    out = io.StringIO()
    logs.setup("INFO", "json", out)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("agent.y").exception("failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and "ValueError: boom" in json.loads(lines[0])["exc"]


def test_text_is_as_before_and_unknown_format_refused(restore_root):
    out = io.StringIO()
    logs.setup("WARNING", "text", out)
    logging.getLogger("agent.z").warning("careful")
    assert out.getvalue().rstrip().endswith("WARNING agent.z: careful")
    with pytest.raises(ValueError, match="'xml'"):
        logs.setup("INFO", "xml")


def test_cli_flag(restore_root, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--log-format", "yaml", "simulate"])
    assert e.value.code == 2


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out.strip()
    from importlib.metadata import version
    assert out == f"rewarm {version('rewarm')}"


def test_log_level_in_any_case_before_or_after_the_command():
    from agent.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["--log-level", "debug", "snapshot", "verify", "x"]).log_level == "DEBUG"
    after = parser.parse_args(["snapshot", "verify", "x", "--log-level", "Warning",
                               "--log-format", "json"])
    assert (after.log_level, after.log_format) == ("WARNING", "json")
    both = parser.parse_args(["--log-level", "error", "snapshot", "verify", "x", "--log-level", "info"])
    assert both.log_level == "INFO"                        # the one after the command wins
    assert parser.parse_args(["snapshot", "verify", "x"]).log_level == "INFO"
    with pytest.raises(SystemExit) as bad:
        parser.parse_args(["--log-level", "loud", "snapshot", "verify", "x"])
    assert bad.value.code == 2


def test_say_and_error_are_json_objects_under_json(restore_root, capsys):
    out = io.StringIO()
    logs.setup("INFO", "json", out)
    logs.say("front door listening on 127.0.0.1:7400", address="127.0.0.1:7400")
    logs.error("no healthy rewarm-frontdoor in Consul", exit_code=69)
    assert capsys.readouterr() == ("", "")                 # nothing printed beside the log
    banner, err = (json.loads(line) for line in out.getvalue().splitlines())
    assert (banner["level"], banner["message"], banner["address"]) == (
        "INFO", "front door listening on 127.0.0.1:7400", "127.0.0.1:7400")
    assert (err["level"], err["message"], err["exit_code"]) == (
        "ERROR", "no healthy rewarm-frontdoor in Consul", 69)
    logs.setup("INFO", "text", io.StringIO())
    logs.say("banner")
    logs.error("bad")
    assert capsys.readouterr() == ("banner\n", "error: bad\n")


def test_a_scraper_that_goes_away_is_logged_not_printed(restore_root, capsys):
    from prometheus_client import CollectorRegistry

    from agent.health import serve_status

    out = io.StringIO()
    logs.setup("DEBUG", "json", out)
    server = serve_status(CollectorRegistry(), component="frontdoor")
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError:
            server.handle_error(None, ("127.0.0.1", 50000))
        try:
            raise RuntimeError("a bug")
        except RuntimeError:
            server.handle_error(None, ("127.0.0.1", 50001))
    finally:
        server.close()
    assert capsys.readouterr().err == ""
    # only the status server's lines: threads left by earlier tests may log into ``out`` too
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    gone, bug = (r for r in records if r["component"] == "health")
    assert gone["level"] == "DEBUG" and "went away" in gone["message"] and "exc" not in gone
    assert bug["level"] == "WARNING" and "RuntimeError: a bug" in bug["exc"]


def test_frontdoor_banner_is_a_json_line(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "REWARM_LOG_FORMAT": ""}
    proc = subprocess.Popen([sys.executable, "-m", "agent.cli", "--log-format", "json",
                             "frontdoor", "--model", "m", "--port", "0", "--http-port", "0"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        while not any(r["message"].startswith("OpenAI-compatible") for r in lines):
            line = proc.stderr.readline()
            assert line, "the front door ended before its banners"
            lines.append(json.loads(line))                 # every line parses
    finally:
        proc.send_signal(signal.SIGTERM)
        rest_out, rest_err = proc.communicate(timeout=30)
    messages = [r["message"] for r in lines]
    assert any(m.startswith("front door listening on 127.0.0.1:") for m in messages)
    assert messages[-1].startswith("OpenAI-compatible HTTP entrance on http://")
    assert proc.stdout is not None and rest_out == ""
    for line in rest_err.splitlines():
        json.loads(line)
