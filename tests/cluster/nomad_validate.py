"""What Nomad's servers and clients refuse in a parsed (canonicalized) job (tests only).

Server side, read from ``nomad/structs/structs.go`` at the commit in ``nomad_schema.json``
(each rule names the function it follows); ``Job.Register`` runs them through the
``jobValidate`` admission controller (``nomad/job_endpoint_hooks.go``) and the HTTP agent
answers an uncoded RPC error with 500 and its text (``command/agent/http.go``,
``errCodeFromHandler``).  The text is go-multierror's: ``"1 error occurred:\\n\\t* ...\\n\\n"``,
nested errors flattened by ``multierror.Append``.

Client side (a task that registers but can never run, or runs with less than it asked for):

- ``client/allocrunner/taskrunner/volume_hook.go``: a task with a host ``volume_mount`` on a
  driver whose capabilities say ``MountConfigSupportNone`` (raw_exec,
  ``drivers/rawexec/driver.go``) fails in prestart: "task driver "raw_exec" for "agent" does
  not support host volumes";
- ``client/allocrunner/taskrunner/driver_handle.go``, ``NewDriverHandle``: ``killTimeout:
  min(task.KillTimeout, maxKillTimeout)``, the client's ``max_kill_timeout`` (30 s by default,
  ``command/agent/config.go``);
- raw_exec is off unless the client's plugin config enables it (``drivers/rawexec``:
  ``enabled`` defaults to false; a node without it does not fingerprint ``driver.raw_exec``
  and the scheduler's driver checker finds no feasible node).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.cluster.nomad_jobspec import SCHEMA, ParseError, load, parse_job, unknown_arguments

S = 1_000_000_000
RESCHEDULE_MIN_DELAY_NS = 5 * S          # structs.go ReschedulePolicyMinDelay
RESCHEDULE_MIN_INTERVAL_NS = 15 * S      # ReschedulePolicyMinInterval
RESTART_MIN_INTERVAL_NS = 5 * S          # RestartPolicyMinInterval
DEFAULT_MAX_KILL_TIMEOUT_NS = 30 * S     # command/agent/config.go DefaultConfig max_kill_timeout
DELAY_FUNCTIONS = ("constant", "exponential", "fibonacci")


def go_duration(ns: int | None) -> str:
    """Go's ``time.Duration.String``: 5 s -> "5s", 60 s -> "1m0s", 0.5 s -> "500ms"."""
    ns = int(ns or 0)
    if ns == 0:
        return "0s"
    sign, ns = ("-" if ns < 0 else ""), abs(ns)
    if ns < S:
        for unit, size in (("ms", 1_000_000), ("µs", 1_000), ("ns", 1)):
            if ns >= size:
                return f"{sign}{ns / size:g}{unit}"
    h, rem = divmod(ns, 3600 * S)
    m, rem = divmod(rem, 60 * S)
    secs = f"{rem / S:.9f}".rstrip("0").rstrip(".") + "s"
    if h:
        return f"{sign}{h}h{m}m{secs}"
    if m:
        return f"{sign}{m}m{secs}"
    return sign + secs


def multierror(errors: list[str]) -> str:
    """go-multierror's ``ListFormatFunc``."""
    if len(errors) == 1:
        return f"1 error occurred:\n\t* {errors[0]}\n\n"
    points = "\n\t".join(f"* {e}" for e in errors)
    return f"{len(errors)} errors occurred:\n\t{points}\n\n"


def _restart(r: dict) -> list[str]:
    """``RestartPolicy.Validate``."""
    out = []
    if r["Mode"] not in ("delay", "fail"):
        out.append(f'Unsupported restart mode: "{r["Mode"]}"')
    if r["Attempts"] == 0 and r["Mode"] != "fail":
        out.append(f'Restart policy "{r["Mode"]}" with {r["Attempts"]} attempts is ambiguous')
    if r["Interval"] < RESTART_MIN_INTERVAL_NS:
        out.append(f"Interval can not be less than {go_duration(RESTART_MIN_INTERVAL_NS)} "
                   f"(got {go_duration(r['Interval'])})")
    if r["Attempts"] * r["Delay"] > r["Interval"]:
        out.append(f"Nomad can't restart the TaskGroup {r['Attempts']} times in an interval of "
                   f"{go_duration(r['Interval'])} with a delay of {go_duration(r['Delay'])}")
    return out


def _reschedule(r: dict) -> list[str]:
    """``ReschedulePolicy.Validate`` (nothing to check unless attempts > 0 or unlimited)."""
    if not (r["Attempts"] > 0 or r["Unlimited"]):
        return []
    out = []
    if r["Attempts"] > 0:
        if r["Interval"] <= 0:
            out.append("Interval must be a non zero value if Attempts > 0")
        if r["Unlimited"]:
            out.append(f"Reschedule Policy with Attempts = {r['Attempts']}, Interval = "
                       f"{go_duration(r['Interval'])}, and Unlimited = true is ambiguous")
            out.append("If Attempts >0, Unlimited cannot also be set to true")
    if r["Delay"] < RESCHEDULE_MIN_DELAY_NS:
        out.append(f"Delay cannot be less than {go_duration(RESCHEDULE_MIN_DELAY_NS)} "
                   f"(got {go_duration(r['Delay'])})")
    if r["DelayFunction"] not in DELAY_FUNCTIONS:
        out.append(f'Invalid delay function "{r["DelayFunction"]}", must be one of '
                   '["constant" "exponential" "fibonacci"]')
    if r["DelayFunction"] != "constant":
        if r["MaxDelay"] < RESCHEDULE_MIN_DELAY_NS:
            out.append(f"Max Delay cannot be less than {go_duration(RESCHEDULE_MIN_DELAY_NS)} "
                       f"(got {go_duration(r['Delay'])})")
        if r["MaxDelay"] < r["Delay"]:
            out.append(f"Max Delay cannot be less than Delay {go_duration(r['Delay'])} "
                       f"(got {go_duration(r['MaxDelay'])})")
    if not r["Unlimited"] and r["Interval"] < RESCHEDULE_MIN_INTERVAL_NS:
        out.append(f"Interval cannot be less than {go_duration(RESCHEDULE_MIN_INTERVAL_NS)} "
                   f"(got {go_duration(r['Interval'])})")
    return out


def _update(u: dict) -> list[str]:
    """``UpdateStrategy.Validate``."""
    out = []
    if u["HealthCheck"] not in ("checks", "task_states", "manual"):
        out.append(f'Invalid health check given: "{u["HealthCheck"]}"')
    if u["MaxParallel"] < 0:
        out.append(f"Max parallel can not be less than zero: {u['MaxParallel']} < 0")
    if u["Canary"] == 0 and u["AutoPromote"]:
        out.append("Auto Promote requires a Canary count greater than zero")
    if u["HealthyDeadline"] <= 0:
        out.append(f"Healthy deadline must be greater than zero: {go_duration(u['HealthyDeadline'])}")
    if u["MinHealthyTime"] >= u["HealthyDeadline"]:
        out.append("Minimum healthy time must be less than healthy deadline: "
                   f"{go_duration(u['MinHealthyTime'])} > {go_duration(u['HealthyDeadline'])}")
    if u["ProgressDeadline"] and u["HealthyDeadline"] >= u["ProgressDeadline"]:
        out.append("Healthy deadline must be less than progress deadline: "
                   f"{go_duration(u['HealthyDeadline'])} > {go_duration(u['ProgressDeadline'])}")
    if u["Stagger"] <= 0:
        out.append(f"Stagger must be greater than zero: {go_duration(u['Stagger'])}")
    return out


def _task(t: dict) -> list[str]:
    """``Task.Validate`` (the parts a parsed job can get wrong here)."""
    out = []
    if not t.get("Driver"):
        out.append("Missing task driver")
    if (t.get("KillTimeout") or 0) < 0:
        out.append("KillTimeout must be a positive value")
    if (t.get("ShutdownDelay") or 0) < 0:
        out.append("ShutdownDelay must be a positive value")
    return out


def _group(job: dict, tg: dict) -> list[str]:
    """``TaskGroup.Validate``."""
    out = []
    if tg["Count"] < 0:
        out.append("Task group count can't be negative")
    tg.setdefault("Tasks", [])
    if not tg["Tasks"]:
        out.append("Missing tasks for task group")
    out += _restart(tg["RestartPolicy"])
    if job["Type"] in ("system", "sysbatch"):
        if tg.get("ReschedulePolicy") is not None:
            out.append("System or sysbatch jobs should not have a reschedule policy")
    elif tg.get("ReschedulePolicy") is None:
        out.append(f"Task Group {tg['Name']} should have a reschedule policy")
    else:
        out += _reschedule(tg["ReschedulePolicy"])
    if tg.get("Update") is not None:
        if job["Type"] not in ("service", "system"):
            out.append(f'Job type "{job["Type"]}" does not allow update block')
        out += _update(tg["Update"])
    scaling = tg.get("Scaling")
    if scaling is not None:                 # TaskGroup.validateScalingPolicy
        if scaling.get("Max") is None:
            out.append("Scaling policy invalid: maximum count must be specified")
        elif scaling["Max"] < tg["Count"]:
            out.append("Scaling policy invalid: task group count must not be greater than "
                       "maximum count in scaling policy")
        if tg["Count"] < (scaling.get("Min") or 0):
            out.append("Scaling policy invalid: task group count must not be less than "
                       "minimum count in scaling policy")
    for task in tg["Tasks"]:
        errs = _task(task)
        if errs:
            out.append(f"Task {task['Name']} validation failed: {multierror(errs)}")
    return out


def validate(job: dict) -> list[str]:
    """``Job.Validate``'s errors (top level; a group's are one entry, as Nomad nests them)."""
    out = []
    if not job.get("Region"):
        out.append("Missing job region")
    if not job.get("ID"):
        out.append("Missing job ID")
    elif " " in job["ID"]:
        out.append("Job ID contains a space")
    if not job.get("Name"):
        out.append("Missing job name")
    if not job.get("Namespace"):
        out.append("Job must be in a namespace")
    if job.get("Type") not in ("service", "batch", "system", "sysbatch"):
        out.append(f"Invalid job type: {job.get('Type')!r}")
    if not job.get("TaskGroups"):
        out.append("Missing job task groups")
    for tg in job.get("TaskGroups") or []:
        if job.get("Type") == "system" and tg["Count"] > 1:
            out.append(f"Job task group {tg['Name']} has count {tg['Count']}. Count cannot "
                       "exceed 1 with system scheduler")
        if (tg.get("ShutdownDelay") or 0) < 0:
            out.append("ShutdownDelay must be a positive value")
    for tg in job.get("TaskGroups") or []:
        errs = _group(job, tg)
        if errs:
            out.append(f"Task group {tg['Name']} validation failed: {multierror(errs)}")
    return out


def client_problems(job: dict, max_kill_timeout_ns: int = DEFAULT_MAX_KILL_TIMEOUT_NS,
                    schema: dict = SCHEMA) -> list[str]:
    """What a client with default settings does not run as written (see the module doc)."""
    out = []
    for tg in job.get("TaskGroups") or []:
        for t in tg["Tasks"]:
            mounts = (schema["drivers"].get(t["Driver"]) or {}).get("mount_configs")
            if t.get("VolumeMounts") and mounts == "drivers.MountConfigSupportNone":
                out.append(f'task driver "{t["Driver"]}" for "{t["Name"]}" does not support '
                           "host volumes")
            if (t.get("KillTimeout") or 0) > max_kill_timeout_ns:
                out.append(f"task {t['Name']}: kill_timeout {go_duration(t['KillTimeout'])} is "
                           f"capped at the client's max_kill_timeout "
                           f"{go_duration(max_kill_timeout_ns)}")
    return out


def jobspec_check(path: Path, variables: dict[str, Any] | None = None) -> dict:
    """``{"parsed", "unknown_arguments", "validation_errors"}`` for one file of ``jobs/``:
    HCL2 syntax (pygohcl), the api structs' arguments, then the server's validation and the
    client's refusals (``validation_errors``), the latter only when the job parsed."""
    text = Path(path).read_text()
    try:
        raw = load(text)
    except ParseError as exc:
        return {"parsed": False, "unknown_arguments": [], "validation_errors": [str(exc)]}
    unknown = [u for _label, body in ((k, v) for item in [raw.get("job") or {}]
                                      for k, v in item.items())
               for u in unknown_arguments(body)]
    if unknown:
        return {"parsed": True, "unknown_arguments": unknown, "validation_errors": []}
    from agent.cluster.jobs import variables_file

    try:
        job = parse_job(text, variables_file(variables or {}))
    except ParseError as exc:
        return {"parsed": True, "unknown_arguments": [], "validation_errors": [str(exc)]}
    return {"parsed": True, "unknown_arguments": [],
            "validation_errors": validate(job) + client_problems(job)}
