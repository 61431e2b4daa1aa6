"""The Nomad stand-in's ``POST /v1/jobs/parse``: HCL2 job specs to API JSON (tests only).

rewarm itself sends its HCL to Nomad's own parser.  This stand-in parses with HashiCorp's HCL2
library (the Go ``hashicorp/hcl/v2``, through its Python binding ``pygohcl``), so what HCL2
refuses here Nomad's parser refuses too (interpolation in a block label: "Invalid string
literal; Template sequences are not allowed in this string").  On top of the syntax it does
what ``jobspec2`` does with the parsed body, at the commit recorded in ``nomad_schema.json``:

- every block and argument is checked against the ``hcl:"..."`` tags of ``api/*.go`` plus the
  jobspec2 decoder's own additions (``nomad_schema.json``, made by
  ``derive_nomad_schema.py``); gohcl refuses an argument its struct does not name
  ("Unsupported argument; An argument named "x" is not expected here.") and a driver's
  ``config`` takes only its ``taskConfigSpec`` keys;
- the job's id is its ``id`` argument, else its label (``jobspec2/parse_job.go``,
  ``normalizeJob``);
- HCL2 input variables (``jobspec2/types.variables.go``): each ``variable`` block declares a
  name with an optional ``type`` and ``default``; a value comes from the request's
  ``Variables`` (an HCL vars file) or the default; a variable with neither is an error, an
  undeclared one in ``Variables`` too; ``var.x`` is replaced at parse time, runtime
  interpolation (``${attr...}``, ``${NOMAD_...}``) is kept;
- the reply is canonicalized as ``api.Job.Canonicalize`` does (``api/jobs.go``,
  ``api/tasks.go``): region ``global``, namespace ``default``, priority 50; a service or
  system job without an ``update`` block gets ``DefaultUpdateStrategy`` (max_parallel 1) and
  each group the job's update merged with its own; restart and reschedule defaults per job
  type (``defaultServiceJobRestartPolicy``, ``NewDefaultReschedulePolicy``); kill_timeout 5 s.

Limits of the binding, written down so nobody reads more into the check: pygohcl renders
expressions as text (a bare ``var.x`` arrives as the string ``"var.x"``, ``"${node.x}"`` as
``node.x``, an escaped ``$${`` as ``${``), so a literal string spelled like a reference is
read as one; and an attribute whose value is an object looks like a block.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pygohcl

SCHEMA = json.loads((Path(__file__).with_name("nomad_schema.json")).read_text())
_VAR = re.compile(r"\$\{var\.([A-Za-z_][A-Za-z0-9_-]*)\}")
_BARE_VAR = re.compile(r"var\.([A-Za-z_][A-Za-z0-9_-]*)")
# A string that is one runtime reference (``"${node.unique.id}"``): HCL2 simplifies such a
# template to its expression, which pygohcl renders as ``node.unique.id``; jobspec2 keeps it
# for the client to interpolate, so the stand-in puts the ``${}`` back.
_RUNTIME = re.compile(r"(?:attr|node|meta|device|NOMAD_[A-Za-z0-9_]+)(?:\.[A-Za-z0-9_-]+)*")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_NS = {"ns": 1, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9, "m": 60e9, "h": 3600e9}
S = 1_000_000_000


class ParseError(ValueError):
    """What the stand-in answers with 400 (Nomad: "Failed to parse job: ...")."""


def duration_ns(text: Any) -> int | None:
    """``"2s"``, ``"1m30s"`` -> nanoseconds (Go's ``time.ParseDuration``; a number is already
    nanoseconds, as jobspec2's ``decodeDuration`` takes it)."""
    if text is None:
        return None
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    parts = _DURATION.findall(str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        raise ParseError(f'Failed to parse job: Unsuitable value type; Unsuitable duration '
                         f'value: time: invalid duration "{text}"')
    return int(sum(float(n) * _NS[u] for n, u in parts))


def load(text: str, what: str = "job") -> dict:
    """HCL2 text as pygohcl's dict; ParseError with HCL's diagnostic (``input.hcl:L,C``)."""
    try:
        return pygohcl.loads(text, keep_interpolations=True)
    except (pygohcl.HCLParseError, pygohcl.HCLInternalError) as exc:
        msg = str(exc).removeprefix("invalid HCL: ").replace("tmp.hcl:", "input.hcl:")
        raise ParseError(f"Failed to parse {what}: {msg}") from exc


# -- schema: the api structs' hcl tags ---------------------------------------------------------
def _bodies(value: Any) -> list[dict]:
    if isinstance(value, list):
        return [v for v in value if isinstance(v, dict)]
    return [value] if isinstance(value, dict) else []


def unknown_arguments(job_body: dict, schema: dict = SCHEMA) -> list[str]:
    """Paths of every argument or block in a ``job`` body that Nomad's decoder does not take
    (``job.group[replica].service.shutdown_delay``); [] when all are known."""
    out: list[str] = []
    _walk(job_body, schema["root"], "job", out, schema, driver=None)
    return out


def _walk(body: dict, struct: str, path: str, out: list[str], schema: dict, driver) -> None:
    spec = schema["structs"][struct]
    either = schema["attribute_or_block"].get(struct, [])
    for key, value in body.items():
        field = spec["fields"].get(key)
        where = f"{path}.{key}"
        if field is None:
            out.append(where)
            continue
        if field["kind"] != "block" or key in either and not isinstance(value, (dict, list)):
            continue
        kind = field["type"]
        if kind == "map":
            if key == "config" and struct == "Task":
                known = (schema["drivers"].get(body.get("driver") or "") or {}).get("config")
                if known is not None:
                    for cfg in _bodies(value):
                        out.extend(f"{where}.{k}" for k in cfg if k not in known)
            continue
        labelled = bool(schema["structs"].get(kind, {}).get("labels")) or \
            f"{struct}.{key}" in schema["labelled_blocks"]
        for item in _bodies(value):
            pairs = item.items() if labelled else [(None, item)]
            for label, sub in pairs:
                for one in _bodies(sub):
                    name = where if label is None else f"{where}[{label}]"
                    if kind in schema["structs"]:
                        _walk(one, kind, name, out, schema, driver)


# -- variables ---------------------------------------------------------------------------------
def _substitute(value: Any, variables: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        return {k: _substitute(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, variables) for v in value]
    if not isinstance(value, str):
        return value
    whole = _BARE_VAR.fullmatch(value) or _VAR.fullmatch(value)
    if whole:                                   # a bare expression keeps the variable's type
        return _lookup(whole.group(1), variables)
    if _RUNTIME.fullmatch(value):
        return "${" + value + "}"
    return _VAR.sub(lambda m: str(_lookup(m.group(1), variables)), value)


def _lookup(name: str, variables: dict[str, Any]) -> Any:
    if name not in variables:
        raise ParseError('Failed to parse job: Unsupported attribute; This object does not '
                         f'have an attribute named "{name}".')
    return variables[name]


def _declared(parsed: dict, given: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, body in (parsed.get("variable") or {}).items():
        kind = str(body.get("type", "any"))
        if name in given:
            value = given[name]
        elif "default" in body:
            value = body["default"]
        else:
            raise ParseError(f'Failed to parse job: No value for required variable; The root '
                             f'module input variable "{name}" is not set, and has no default '
                             'value.')
        if kind == "number":
            try:
                value = float(value) if "." in str(value) else int(value)
            except ValueError:
                raise ParseError(f'Failed to parse job: Invalid value for input variable; '
                                 f'variable "{name}": a number is required.') from None
        elif kind == "string":
            value = str(value)
        out[name] = value
    for name in given:
        if name not in out:
            raise ParseError(f'Failed to parse job: Undefined variable; A variable named '
                             f'"{name}" was assigned a value, but the root module does not '
                             'declare a variable of that name.')
    return out


# -- API JSON, canonicalized -------------------------------------------------------------------
def _labelled(value: Any) -> list[tuple[str, dict]]:
    return [(label, body) for item in _bodies(value) for label, body in item.items()]


def _one(body: dict, name: str) -> dict:
    bodies = _bodies(body.get(name))
    return bodies[0] if bodies else {}


def _constraints(value: Any) -> list[dict] | None:
    out = []
    for c in _bodies(value):        # jobspec2/hcl_conversions.go decodeConstraint
        op = c.get("operator", "=")
        ltarget, rtarget = c.get("attribute", ""), str(c.get("value", ""))
        if "distinct_hosts" in c:
            op, rtarget = "distinct_hosts", str(c["distinct_hosts"]).lower()
        if "set_contains" in c:
            op, rtarget = "set_contains", c["set_contains"]
        out.append({"LTarget": ltarget, "RTarget": rtarget, "Operand": op})
    return out or None


def _affinities(value: Any) -> list[dict] | None:
    return [{"LTarget": a.get("attribute", ""), "RTarget": str(a.get("value", "")),
             "Operand": a.get("operator", "="), "Weight": a.get("weight", 50)}
            for a in _bodies(value)] or None


def _update(u: dict | None) -> dict | None:
    """``api.UpdateStrategy.Canonicalize`` over ``DefaultUpdateStrategy``."""
    if u is None:
        return None
    return {"MaxParallel": u.get("max_parallel", 1), "HealthCheck": u.get("health_check", "checks"),
            "MinHealthyTime": duration_ns(u.get("min_healthy_time", "10s")),
            "HealthyDeadline": duration_ns(u.get("healthy_deadline", "5m")),
            "ProgressDeadline": duration_ns(u.get("progress_deadline", "10m")),
            "AutoRevert": bool(u.get("auto_revert", False)), "Canary": u.get("canary", 0),
            "AutoPromote": bool(u.get("auto_promote", False)),
            "Stagger": duration_ns(u.get("stagger", "30s"))}


def _task(name: str, t: dict) -> dict:
    res = _one(t, "resources")
    devices = [{"Name": dev, "Count": d.get("count", 1)} for dev, d in _labelled(res.get("device"))]
    ident = _one(t, "identity") if "identity" in t else None
    return {
        "Name": name, "Driver": t.get("driver", ""), "Config": _one(t, "config"),
        "Env": _one(t, "env") or None,
        "Templates": [{"EmbeddedTmpl": tp.get("data", ""), "DestPath": tp.get("destination", ""),
                       "Envvars": bool(tp.get("env", False)),
                       "ChangeMode": tp.get("change_mode", "restart")}
                      for tp in _bodies(t.get("template"))] or None,
        "VolumeMounts": [{"Volume": v.get("volume"), "Destination": v.get("destination"),
                          "ReadOnly": v.get("read_only", False)}
                         for v in _bodies(t.get("volume_mount"))] or None,
        "Identity": {"Name": "default", "Env": bool(ident.get("env", False)),
                     "File": bool(ident.get("file", False))} if ident is not None else None,
        # api/tasks.go Task.Canonicalize: KillTimeout 5 s; structs: KillSignal "" = SIGINT
        "KillSignal": t.get("kill_signal", ""),
        "KillTimeout": duration_ns(t.get("kill_timeout", "5s")),
        "ShutdownDelay": duration_ns(t.get("shutdown_delay", 0)),
        "Resources": {"CPU": res.get("cpu", 100), "MemoryMB": res.get("memory", 300),
                      "Devices": devices or None}}


def _services(value: Any) -> list[dict] | None:
    return [{"Name": s.get("name", ""), "PortLabel": s.get("port", ""),
             "Provider": s.get("provider", "consul"), "Tags": s.get("tags"),
             "Checks": [{"Type": c.get("type", ""), "Path": c.get("path", ""),
                         "Interval": duration_ns(c.get("interval")),
                         "Timeout": duration_ns(c.get("timeout"))}
                        for c in _bodies(s.get("check"))] or None}
            for s in _bodies(value)] or None


def _restart(jtype: str, r: dict) -> dict:
    """``defaultServiceJobRestartPolicy`` / ``defaultBatchJobRestartPolicy`` merged with the
    group's block (api/tasks.go)."""
    service = jtype in ("service", "system")
    return {"Attempts": r.get("attempts", 2 if service else 3),
            "Interval": duration_ns(r.get("interval", "30m" if service else "24h")),
            "Delay": duration_ns(r.get("delay", "15s")), "Mode": r.get("mode", "fail"),
            "RenderTemplates": bool(r.get("render_templates", False))}


def _reschedule(jtype: str, r: dict | None) -> dict | None:
    """``NewDefaultReschedulePolicy(jobType)`` merged with the block; none for system jobs."""
    if jtype in ("system", "sysbatch"):
        return None if r is None else _reschedule("service", r)
    batch = jtype == "batch"
    r = r or {}
    return {"Attempts": r.get("attempts", 1 if batch else 0),
            "Interval": duration_ns(r.get("interval", "24h" if batch else "0s")),
            "Delay": duration_ns(r.get("delay", "5s" if batch else "30s")),
            "DelayFunction": r.get("delay_function", "constant" if batch else "exponential"),
            "MaxDelay": duration_ns(r.get("max_delay", "0s" if batch else "1h")),
            "Unlimited": bool(r.get("unlimited", not batch))}


def _group(name: str, g: dict, job: dict, job_update: dict | None) -> dict:
    jtype = job.get("type", "service")
    net = _one(g, "network")
    ports = [{"Label": label, "Value": p.get("static", 0), "To": p.get("to", 0)}
             for label, p in _labelled(net.get("port"))]
    own_update = _one(g, "update") if "update" in g else None
    update = _update({**(job_update or {}), **(own_update or {})}) \
        if (job_update is not None or own_update is not None) else None
    resched = _one(g, "reschedule") if "reschedule" in g else (
        _one(job, "reschedule") if "reschedule" in job else None)
    out = {
        "Name": name, "Count": g.get("count", 1),
        "Constraints": _constraints(g.get("constraint")),
        "Affinities": _affinities(g.get("affinity")),
        "Networks": [{"DynamicPorts": [p for p in ports if not p["Value"]] or None,
                      "ReservedPorts": [p for p in ports if p["Value"]] or None}]
        if ports else None,
        "Services": _services(g.get("service")),
        "Volumes": {label: {"Name": label, "Type": v.get("type"), "Source": v.get("source"),
                            "ReadOnly": v.get("read_only", False)}
                    for label, v in _labelled(g.get("volume"))} or None,
        "Tasks": [_task(n, t) for n, t in _labelled(g.get("task"))],
        "Update": update,
        "RestartPolicy": _restart(jtype, _one(g, "restart")),
        "ReschedulePolicy": _reschedule(jtype, resched),
        "EphemeralDisk": {"SizeMB": 300, "Migrate": False, "Sticky": False},
        "ShutdownDelay": duration_ns(g.get("shutdown_delay")),
    }
    scaling = _one(g, "scaling") if "scaling" in g else None
    if scaling is not None:
        out["Scaling"] = {"Enabled": scaling.get("enabled", True), "Min": scaling.get("min"),
                          "Max": scaling.get("max"), "Type": "horizontal"}
    return out


def parse_job(job_hcl: str, variables_hcl: str = "") -> dict:
    """The canonicalized API JSON of the one job in ``job_hcl``; raises ParseError (400)."""
    parsed = load(job_hcl)
    given = load(variables_hcl, "variables") if variables_hcl.strip() else {}
    variables = _declared(parsed, given)
    jobs = _labelled(parsed.get("job"))
    if len(jobs) != 1:
        raise ParseError(f"Failed to parse job: expected one job block, found {len(jobs)}")
    (label, raw), = jobs
    unknown = unknown_arguments(raw)
    if unknown:
        leaf = unknown[0].rsplit(".", 1)[-1]
        raise ParseError(f'Failed to parse job: Unsupported argument; An argument named "{leaf}" '
                         f"is not expected here. ({unknown[0]})")
    job = _substitute(raw, variables)
    job_id = job.get("id", label)
    jtype = job.get("type", "service")
    job_update = _one(job, "update") if "update" in job else (
        {} if jtype in ("service", "system") else None)    # DefaultUpdateStrategy
    return {"ID": job_id, "Name": job.get("name", label), "Type": jtype,
            "Region": job.get("region", "global"), "Namespace": job.get("namespace", "default"),
            "Priority": job.get("priority", 50),
            "Datacenters": job.get("datacenters", ["*"]), "Meta": _one(job, "meta") or None,
            "Constraints": _constraints(job.get("constraint")),
            "Affinities": _affinities(job.get("affinity")),
            "Update": _update(job_update),
            "TaskGroups": [_group(n, g, job, job_update) for n, g in _labelled(job.get("group"))]}


_UPDATE_DEFAULTS = {"MaxParallel": 1, "HealthCheck": "checks", "MinHealthyTime": 10 * S,
                    "HealthyDeadline": 300 * S, "ProgressDeadline": 600 * S,
                    "AutoRevert": False, "Canary": 0, "AutoPromote": False, "Stagger": 30 * S}


def canonicalize(job: dict) -> dict:
    """``api.Job.Canonicalize`` on API JSON, as ``POST /v1/jobs`` applies it before
    validation (``command/agent/job_endpoint.go``, ``ApiJobToStructJob``): missing fields get
    the defaults :func:`parse_job` gives (same sources); a copy is returned."""
    job = json.loads(json.dumps(job))
    job.setdefault("Name", job.get("ID"))
    for key, value in (("Region", "global"), ("Namespace", "default"), ("Priority", 50),
                       ("Type", "service"), ("Datacenters", ["*"])):
        if job.get(key) is None:
            job[key] = value
    jtype = job["Type"]
    if job.get("Update") is not None:
        job["Update"] = {**_UPDATE_DEFAULTS, **job["Update"]}
    elif jtype in ("service", "system"):
        job["Update"] = dict(_UPDATE_DEFAULTS)
    for tg in job.get("TaskGroups") or []:
        if tg.get("Count") is None:
            tg["Count"] = 1
        own = tg.get("Update")
        if job["Update"] is not None or own is not None:
            tg["Update"] = {**_UPDATE_DEFAULTS, **(job["Update"] or {}), **(own or {})}
        restart = _restart(jtype, {})
        tg["RestartPolicy"] = {**restart, **(tg.get("RestartPolicy") or {})}
        if tg.get("ReschedulePolicy") is not None or jtype not in ("system", "sysbatch"):
            base = _reschedule("service" if jtype in ("system", "sysbatch") else jtype, {})
            tg["ReschedulePolicy"] = {**base, **(tg.get("ReschedulePolicy") or {})}
        tg.setdefault("EphemeralDisk", {"SizeMB": 300, "Migrate": False, "Sticky": False})
        for task in tg.get("Tasks") or []:
            if task.get("KillTimeout") is None:
                task["KillTimeout"] = 5 * S
            task.setdefault("KillSignal", "")
    return job
