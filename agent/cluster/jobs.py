"""The Nomad job specs in ``jobs/``, sent through Nomad's own parser.

Operators run them as they are (``nomad job run -var model=M jobs/rewarm-replica.nomad.hcl``).
Where rewarm registers a job itself (a model's replica job that does not exist yet), it posts
the HCL and its HCL2 variables to ``POST /v1/jobs/parse`` (Nomad "Jobs HTTP API", Parse Job:
body ``JobHCL``, ``Variables`` (an HCL vars file), ``Canonicalize``; reply the job as API
JSON) and registers what Nomad answered: no HCL is converted in rewarm.

python-nomad's ``jobs.parse(hcl, canonicalize)`` sends no ``Variables``, so the same endpoint
is posted through its ``jobs.request`` (the client's own session, address, token, namespace
and TLS settings).
"""

from __future__ import annotations

import json
from pathlib import Path

import nomad
import nomad.api.exceptions as nexc

from agent.cluster.names import check_name
from agent.cluster.nomad_http import nomad_error
from agent.errors import ClusterError, ConfigError

JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"
REPLICA_TEMPLATE = JOBS_DIR / "rewarm-replica.nomad.hcl"
MODEL_NAME_CHARS = 63          # a model name is also a Consul tag and a DNS-label-sized name
MAX_REPLICAS_LIMIT = 1024
MAX_JOB_HCL_BYTES = 1 << 20


def variables_file(values: dict[str, object]) -> str:
    """An HCL vars file for ``Variables``: one ``name = value`` line each (strings quoted
    with JSON escapes, which HCL's quoted strings share; numbers and booleans bare)."""
    lines = []
    for name, value in values.items():
        check_name("variable name", name)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        elif isinstance(value, str):
            text = json.dumps(value).replace("${", "$${").replace("%{", "%%{")
        else:
            raise ConfigError(f"jobs: variable {name}={value!r} is not a string, number or "
                              "bool", name=name, value=repr(value)[:80], limit="str|int|float|bool")
        lines.append(f"{name} = {text}")
    return "".join(line + "\n" for line in lines)


def parse_job(client: nomad.Nomad, hcl: str, variables: dict[str, object] | None = None) -> dict:
    """Nomad's API JSON for the job in ``hcl`` with ``variables``.

    Raises ConfigError (HCL over 1 MiB, a bad variable), AclDenied (403: the token needs the
    ``parse-job`` capability), ClusterError (Nomad's 400 names the HCL error; other
    failures, with their cause).
    """
    if len(hcl.encode()) > MAX_JOB_HCL_BYTES:
        raise ConfigError(f"jobs: HCL has {len(hcl.encode())} bytes; limit is "
                          f"{MAX_JOB_HCL_BYTES}", name="JobHCL", value=len(hcl.encode()),
                          limit=MAX_JOB_HCL_BYTES)
    body = {"JobHCL": hcl, "Variables": variables_file(variables or {}), "Canonicalize": True}
    endpoint = "/v1/jobs/parse"
    try:
        job = client.jobs.request("parse", json=body, method="post").json()
    except nexc.BaseNomadException as exc:
        raise nomad_error(exc, endpoint, "parse-job") from exc
    except ValueError as exc:
        raise ClusterError(f"nomad: {endpoint} answered non-JSON: {exc}", service="nomad",
                           status=None, endpoint=endpoint) from exc
    if not isinstance(job, dict) or not job.get("ID"):
        raise ClusterError(f"nomad: {endpoint} answered no job", service="nomad", status=None,
                           endpoint=endpoint)
    return job


def check_model(model: object) -> str:
    """A model name fit for a job id, a Consul tag and a KV key; ConfigError otherwise."""
    return check_name("model", model, MODEL_NAME_CHARS)


def replica_job(client: nomad.Nomad, model: str, max_replicas: int = 8,
                template: Path = REPLICA_TEMPLATE, **variables: object) -> dict:
    """The replica job for ``model`` as Nomad parsed it from ``template``.

    Raises ConfigError for a model name outside 1-63 of ``[A-Za-z0-9._-]`` or
    ``max_replicas`` outside 1..1024, and what :func:`parse_job` raises.
    """
    check_model(model)
    if not isinstance(max_replicas, int) or not 1 <= max_replicas <= MAX_REPLICAS_LIMIT:
        raise ConfigError(f"jobs: max_replicas={max_replicas!r} is out of range; limit is "
                          f"1..{MAX_REPLICAS_LIMIT}", name="max_replicas", value=max_replicas,
                          limit=MAX_REPLICAS_LIMIT)
    return parse_job(client, Path(template).read_text(),
                     {"model": model, "max_replicas": max_replicas, **variables})


def register_job(client: nomad.Nomad, hcl: str, variables: dict[str, object] | None = None
                 ) -> dict:
    """Parse ``hcl`` with ``variables`` through Nomad and register the result
    (``POST /v1/jobs``); returns Nomad's answer (``EvalID``, ``JobModifyIndex``...)."""
    job = parse_job(client, hcl, variables)
    try:
        return client.jobs.register_job({"Job": job})
    except nexc.BaseNomadException as exc:
        raise nomad_error(exc, "/v1/jobs", "submit-job") from exc
