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
