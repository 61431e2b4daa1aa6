"""Nomad job specs in ``jobs/``: parse them (python-hcl2) and render the per-model replica
template into the JSON job that ``POST /v1/jobs`` takes.

The template ``jobs/rewarm-replica.nomad.hcl`` carries two placeholders, ``__MODEL__`` and
``__MAX__`` (the ``scaling`` block's max), substituted before parsing. The JSON follows
Nomad's API job shape (``ID``, ``Name``, ``Type``, ``Datacenters``, ``TaskGroups`` with
``Count``, ``Scaling``, ``Affinities``, ``Services``, ``Networks``, ``Tasks`` with
``Resources.Devices``).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import hcl2

from agent.errors import ConfigError

JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"
REPLICA_TEMPLATE = JOBS_DIR / "rewarm-replica.nomad.hcl"
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
MAX_REPLICAS_LIMIT = 1024


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}
_ESCAPE = re.compile(r'\\(.)')
_HEREDOC = re.compile(r"^<<(-?)([A-Za-z_][A-Za-z0-9_]*)\n(.*?)\n?[ \t]*\2$", re.S)


def _template_literal(text: str) -> str:
    # HCL template escapes: "$${" is a literal "${", "%%{" a literal "%{"
    return text.replace("$${", "${").replace("%%{", "%{")


def _string(raw: str) -> str:
    """The value of a python-hcl2 string token (it keeps quotes, escapes and heredoc marks)."""
    body = raw[1:-1]
    heredoc = _HEREDOC.match(body)
    if heredoc:
        text = heredoc.group(3)
        if heredoc.group(1):            # <<-: strip the common indentation
            text = textwrap.dedent(text)
        return _template_literal(text + "\n")
    return _template_literal(_ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(0)), body))


def _clean(value: Any) -> Any:
    """python-hcl2 keeps string quotes and adds ``__is_block__``/``__comments__``: drop them."""
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()
                if not (isinstance(k, str) and k.startswith("__") and k.endswith("__"))}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return _string(value)
    return value


def load_hcl(text: str) -> dict:
    """Parse HCL text into plain Python values (labels as dict keys, blocks as lists)."""
    return _clean(hcl2.loads(text))


def _labelled(blocks: list[dict]) -> list[tuple[str, dict]]:
    return [(label, body) for block in blocks for label, body in block.items()]


def _one(body: dict, name: str) -> dict:
    return (body.get(name) or [{}])[0]


def _task(name: str, t: dict) -> dict:
    res = _one(t, "resources")
    devices = [{"Name": dev, "Count": d.get("count", 1)}
               for dev, d in _labelled(res.get("device", []))]
    return {"Name": name, "Driver": t["driver"], "Config": _one(t, "config"),
            "Env": _one(t, "env") or None, "KillTimeout": _duration_ns(t.get("kill_timeout")),
            "Resources": {"CPU": res.get("cpu", 100), "MemoryMB": res.get("memory", 300),
                          "Devices": devices or None}}


def _duration_ns(text: str | None) -> int | None:
    """``"60s"``/``"500ms"``/``"2m"`` -> nanoseconds (the API's time.Duration); None stays."""
    if text is None:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", str(text))
    if not m:
        raise ConfigError(f"jobs: duration {text!r} is not N(ms|s|m|h)", name="duration",
                          value=text, limit="N(ms|s|m|h)")
    scale = {"ms": 1e6, "s": 1e9, "m": 60e9, "h": 3600e9}[m.group(2)]
    return int(float(m.group(1)) * scale)


def _group(name: str, g: dict) -> dict:
    scaling = g.get("scaling")
    net = _one(g, "network")
    ports = [{"Label": label, "Value": p.get("static", 0)} for label, p in
             _labelled(net.get("port", []))]
    out = {
        "Name": name, "Count": g.get("count", 1),
        "Affinities": [{"LTarget": a["attribute"], "Operand": a.get("operator", "="),
                        "RTarget": a["value"], "Weight": a.get("weight", 50)}
                       for a in g.get("affinity", [])] or None,
        "Networks": [{"DynamicPorts": [p for p in ports if not p["Value"]] or None,
                      "ReservedPorts": [p for p in ports if p["Value"]] or None}]
        if ports else None,
        "Services": [{"Name": s["name"], "PortLabel": s.get("port", ""),
                      "Provider": s.get("provider", "consul"), "Tags": s.get("tags")}
                     for s in g.get("service", [])] or None,
        "Tasks": [_task(n, t) for n, t in _labelled(g.get("task", []))],
    }
    if scaling:
        s = scaling[0]
        out["Scaling"] = {"Enabled": s.get("enabled", True), "Min": s.get("min", 0),
                          "Max": s["max"], "Type": "horizontal"}
    return out


def to_api_job(parsed: dict) -> dict:
    """Nomad API JSON for the (single) job in ``parsed`` (the output of :func:`load_hcl`)."""
    (job_id, job), = _labelled(parsed["job"])
    return {"ID": job_id, "Name": job_id, "Type": job.get("type", "service"),
            "Datacenters": job.get("datacenters", ["*"]), "Meta": _one(job, "meta") or None,
            "Constraints": [{"LTarget": c["attribute"], "Operand": c.get("operator", "="),
                             "RTarget": c["value"]} for c in job.get("constraint", [])] or None,
            "TaskGroups": [_group(n, g) for n, g in _labelled(job["group"])]}


def render_replica_job(model: str, max_replicas: int = 8,
                       template: Path = REPLICA_TEMPLATE) -> dict:
    """The replica job for ``model`` as Nomad API JSON.

    Raises ConfigError for a model name that is not a Nomad-safe identifier (1-63 of
    ``[A-Za-z0-9._-]``, starting alphanumeric) or ``max_replicas`` outside 1..1024.
    """
    if not _MODEL_NAME.match(model or ""):
        raise ConfigError(f"jobs: model name {model!r} is not 1-63 of [A-Za-z0-9._-]",
                          name="model", value=model, limit=_MODEL_NAME.pattern)
    if not 1 <= int(max_replicas) <= MAX_REPLICAS_LIMIT:
        raise ConfigError(f"jobs: max_replicas={max_replicas} is out of range; limit is "
                          f"1..{MAX_REPLICAS_LIMIT}", name="max_replicas", value=max_replicas,
                          limit=MAX_REPLICAS_LIMIT)
    text = Path(template).read_text()
    text = text.replace("__MODEL__", model).replace("__MAX__", str(int(max_replicas)))
    return to_api_job(load_hcl(text))
