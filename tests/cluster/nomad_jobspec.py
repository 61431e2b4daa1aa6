"""The Nomad stand-in's ``POST /v1/jobs/parse``: HCL2 job specs (python-hcl2) to API JSON.

Tests only; rewarm itself sends its HCL to Nomad's own parser.  Written from Nomad's
documentation: "Job Specification" (developer.hashicorp.com/nomad/docs/job-specification:
``job``, ``group``, ``task``, ``variable``, ``constraint``, ``affinity``, ``update``,
``restart``, ``reschedule``, ``scaling``, ``network``/``port``, ``service``/``check``,
``template``, ``env``, ``identity``, ``volume``/``volume_mount``, ``resources``/``device``)
and the JSON form of a job the API takes and returns ("JSON Job Specification",
developer.hashicorp.com/nomad/api-docs/json-jobs: ``ID``, ``TaskGroups``, ``Tasks``,
``Constraints`` with ``LTarget``/``RTarget``/``Operand``, durations in nanoseconds).

HCL2 input variables ("Input Variables", docs/job-specification/hcl2/variables): each
``variable`` block declares a name with an optional ``type`` and ``default``; a value comes
from the request's ``Variables`` (an HCL vars file, ``name = value`` lines) or the default;
a variable with neither is an error, an undeclared one in ``Variables`` too.  ``var.x`` is
replaced at parse time; runtime interpolation (``${attr...}``, ``${NOMAD_...}``) is kept.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import hcl2

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}
_ESCAPE = re.compile(r'\\(.)')
_HEREDOC = re.compile(r"^<<(-?)([A-Za-z_][A-Za-z0-9_]*)\n(.*?)\n?[ \t]*\2$", re.S)
_VAR = re.compile(r"\$\{var\.([A-Za-z_][A-Za-z0-9_-]*)\}")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|ms|s|m|h)")
_NS = {"ns": 1, "us": 1e3, "ms": 1e6, "s": 1e9, "m": 60e9, "h": 3600e9}


class ParseError(ValueError):
    """What the stand-in answers with 400 (Nomad: "error parsing: ...")."""


def duration_ns(text: Any) -> int | None:
    """``"2s"``, ``"1m30s"`` -> nanoseconds (Go's time.Duration, as the API carries it)."""
    if text is None:
        return None
    parts = _DURATION.findall(str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        raise ParseError(f"invalid duration {text!r}")
    return int(sum(float(n) * _NS[u] for n, u in parts))


def _string(raw: str) -> str:
    body = raw[1:-1]
    heredoc = _HEREDOC.match(body)
    if heredoc:
        text = heredoc.group(3)
        if heredoc.group(1):            # <<-: strip the common indentation
            text = textwrap.dedent(text)
        text += "\n"
    else:
        text = _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(0)), body)
    return text


def _clean(value: Any, variables: dict[str, Any]) -> Any:
    """python-hcl2 keeps quotes and adds ``__is_block__``: plain values, ``var.x`` replaced."""
    if isinstance(value, dict):
        return {_clean(k, variables): _clean(v, variables) for k, v in value.items()
                if not (isinstance(k, str) and k.startswith("__") and k.endswith("__"))}
    if isinstance(value, list):
        return [_clean(v, variables) for v in value]
    if not isinstance(value, str):
        return value
    whole = _VAR.fullmatch(value)
    if whole:                           # a bare expression: the variable's own type
        return _lookup(whole.group(1), variables)
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = _string(value)
    value = _VAR.sub(lambda m: str(_lookup(m.group(1), variables)), value)
    # HCL template escapes: "$${" is a literal "${", "%%{" a literal "%{"
    return value.replace("$${", "${").replace("%%{", "%{")


def _lookup(name: str, variables: dict[str, Any]) -> Any:
    if name not in variables:
        raise ParseError(f'Unsupported attribute; This object does not have an attribute '
                         f'named "{name}".')
    return variables[name]


def _var_values(text: str) -> dict[str, Any]:
    """An HCL vars file (``name = value`` lines) as python values."""
    if not text.strip():
        return {}
    try:
        parsed = hcl2.loads(text)
    except Exception as exc:  # python-hcl2 raises lark errors
        raise ParseError(f"error parsing variables: {exc}") from exc
    return {k: _clean(v, {}) for k, v in parsed.items()}


def _declared(parsed: dict, given: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for block in parsed.get("variable", []):
        for label, body in block.items():
            name = label.strip('"')
            kind = str(body.get("type", "any"))
            if name in given:
                value = given[name]
            elif "default" in body:
                value = _clean(body["default"], {})
            else:
                raise ParseError(f'No value for required variable "{name}"')
            if kind == "number":
                try:
                    value = float(value) if "." in str(value) else int(value)
                except ValueError:
                    raise ParseError(f'Invalid value for variable "{name}": a number is '
                                     "required") from None
            elif kind == "string":
                value = str(value)
            out[name] = value
    for name in given:
        if name not in out:
            raise ParseError(f'Undefined variable "{name}": a value was given for a variable '
                             "that is not declared")
    return out


def _labelled(blocks: list[dict]) -> list[tuple[str, dict]]:
    return [(label, body) for block in blocks for label, body in block.items()]


def _one(body: dict, name: str) -> dict:
    return (body.get(name) or [{}])[0]


def _constraints(blocks: list[dict]) -> list[dict] | None:
    out = []
    for c in blocks:
        op = c.get("operator", "=")
        if op == "distinct_hosts":
            out.append({"LTarget": "", "RTarget": str(c.get("value", "true")), "Operand": op})
        else:
            out.append({"LTarget": c.get("attribute", ""), "RTarget": str(c.get("value", "")),
                        "Operand": op})
    return out or None


def _affinities(blocks: list[dict]) -> list[dict] | None:
    return [{"LTarget": a["attribute"], "RTarget": str(a["value"]),
             "Operand": a.get("operator", "="), "Weight": a.get("weight", 50)}
            for a in blocks] or None


def _update(u: dict) -> dict | None:
    if not u:
        return None
    return {"MaxParallel": u.get("max_parallel", 1), "HealthCheck": u.get("health_check", "checks"),
            "MinHealthyTime": duration_ns(u.get("min_healthy_time", "10s")),
            "HealthyDeadline": duration_ns(u.get("healthy_deadline", "5m")),
            "AutoRevert": u.get("auto_revert", False), "Stagger": duration_ns(u.get("stagger", "30s"))}


def _task(name: str, t: dict) -> dict:
    res = _one(t, "resources")
    devices = [{"Name": dev, "Count": d.get("count", 1)} for dev, d in
               _labelled(res.get("device", []))]
    ident = t.get("identity")
    return {
        "Name": name, "Driver": t["driver"], "Config": _one(t, "config"),
        "Env": _one(t, "env") or None,
        "Templates": [{"EmbeddedTmpl": tp.get("data", ""), "DestPath": tp["destination"],
                       "Envvars": bool(tp.get("env", False)),
                       "ChangeMode": tp.get("change_mode", "restart")}
                      for tp in t.get("template", [])] or None,
        "VolumeMounts": [{"Volume": v["volume"], "Destination": v["destination"],
                          "ReadOnly": v.get("read_only", False)}
                         for v in t.get("volume_mount", [])] or None,
        "Identity": {"Env": bool(ident[0].get("env", False)),
                     "File": bool(ident[0].get("file", False))} if ident else None,
        # Defaults from the task block's documentation: SIGINT, 5 s.
        "KillSignal": t.get("kill_signal", "SIGINT"),
        "KillTimeout": duration_ns(t.get("kill_timeout", "5s")),
        "Resources": {"CPU": res.get("cpu", 100), "MemoryMB": res.get("memory", 300),
                      "Devices": devices or None}}


def _services(blocks: list[dict]) -> list[dict] | None:
    return [{"Name": s["name"], "PortLabel": s.get("port", ""),
             "Provider": s.get("provider", "consul"), "Tags": s.get("tags"),
             "ShutdownDelay": duration_ns(s.get("shutdown_delay")),
             "Checks": [{"Type": c["type"], "Path": c.get("path", ""),
                         "Interval": duration_ns(c["interval"]),
                         "Timeout": duration_ns(c["timeout"])} for c in s.get("check", [])]
             or None} for s in blocks] or None


def _group(name: str, g: dict) -> dict:
    net = _one(g, "network")
    ports = [{"Label": label, "Value": p.get("static", 0), "To": p.get("to", 0)}
             for label, p in _labelled(net.get("port", []))]
    restart, resched = _one(g, "restart"), _one(g, "reschedule")
    out = {
        "Name": name, "Count": g.get("count", 1),
        "Constraints": _constraints(g.get("constraint", [])),
        "Affinities": _affinities(g.get("affinity", [])),
        "Networks": [{"DynamicPorts": [p for p in ports if not p["Value"]] or None,
                      "ReservedPorts": [p for p in ports if p["Value"]] or None}]
        if ports else None,
        "Services": _services(g.get("service", [])),
        "Volumes": {label: {"Name": label, "Type": v.get("type"), "Source": v.get("source"),
                            "ReadOnly": v.get("read_only", False)}
                    for label, v in _labelled(g.get("volume", []))} or None,
        "Tasks": [_task(n, t) for n, t in _labelled(g.get("task", []))],
    }
    if restart:
        out["RestartPolicy"] = {"Attempts": restart.get("attempts", 2),
                                "Interval": duration_ns(restart.get("interval", "30m")),
                                "Delay": duration_ns(restart.get("delay", "15s")),
                                "Mode": restart.get("mode", "fail")}
    if resched:
        out["ReschedulePolicy"] = {"Attempts": resched.get("attempts", 0),
                                   "Interval": duration_ns(resched.get("interval", "0s")),
                                   "Delay": duration_ns(resched.get("delay", "30s")),
                                   "DelayFunction": resched.get("delay_function", "exponential"),
                                   "MaxDelay": duration_ns(resched.get("max_delay", "1h")),
                                   "Unlimited": resched.get("unlimited", True)}
    scaling = g.get("scaling")
    if scaling:
        s = scaling[0]
        out["Scaling"] = {"Enabled": s.get("enabled", True), "Min": s.get("min", 0),
                          "Max": s["max"], "Type": "horizontal"}
    return out


def parse_job(job_hcl: str, variables_hcl: str = "") -> dict:
    """The API JSON of the one job in ``job_hcl``; raises ParseError (the stand-in's 400)."""
    try:
        parsed = hcl2.loads(job_hcl)
    except Exception as exc:  # lark's errors
        raise ParseError(f"error parsing: {exc}") from exc
    variables = _declared(parsed, _var_values(variables_hcl))
    jobs = _labelled(_clean(parsed.get("job", []), variables))
    if len(jobs) != 1:
        raise ParseError(f"error parsing: expected one job block, found {len(jobs)}")
    (job_id, job), = jobs
    return {"ID": job_id, "Name": job_id, "Type": job.get("type", "service"),
            "Datacenters": job.get("datacenters", ["*"]), "Meta": _one(job, "meta") or None,
            "Constraints": _constraints(job.get("constraint", [])),
            "Affinities": _affinities(job.get("affinity", [])),
            "Update": _update(_one(job, "update")),
            "TaskGroups": [_group(n, g) for n, g in _labelled(job["group"])]}
