"""Every job in jobs/ as Nomad's own parser and validator take it.

The syntax is checked by HashiCorp's HCL2 library (the Go ``hashicorp/hcl/v2`` through
``pygohcl``), the blocks and arguments against the ``hcl:"..."`` tags of Nomad's ``api/*.go``
(``tests/cluster/nomad_schema.json``, derived by ``tests/cluster/derive_nomad_schema.py`` at
the commit it records), and the parsed job against ``nomad/structs/structs.go``'s validation
and the client's refusals (``tests/cluster/nomad_validate.py``).
"""

import re
from pathlib import Path

import pygohcl
import pytest

from tests.cluster.nomad_jobspec import SCHEMA, ParseError, parse_job, unknown_arguments
from tests.cluster.nomad_validate import (client_problems, go_duration, jobspec_check,
                                          multierror, validate)

JOBS_DIR = Path(__file__).resolve().parents[2] / "jobs"
JOBS = sorted(p.name for p in JOBS_DIR.glob("*.nomad.hcl"))
VARIABLES = {"rewarm-replica.nomad.hcl": {"model": "smollm2"}}


def test_the_jobs_directory_holds_the_four_jobs():
    assert JOBS == ["rewarm-agent.nomad.hcl", "rewarm-frontdoor.nomad.hcl",
                    "rewarm-predictor.nomad.hcl", "rewarm-replica.nomad.hcl"]


def test_the_schema_records_where_it_came_from():
    assert SCHEMA["source"] == "github.com/hashicorp/nomad"
    assert re.fullmatch(r"[0-9a-f]{40}", SCHEMA["commit"])
    job = SCHEMA["structs"]["Job"]["fields"]
    assert job["id"] == {"kind": "attr"} and job["group"]["type"] == "TaskGroup"
    assert "shutdown_delay" in SCHEMA["structs"]["TaskGroup"]["fields"]
    assert "shutdown_delay" in SCHEMA["structs"]["Task"]["fields"]
    assert "shutdown_delay" not in SCHEMA["structs"]["Service"]["fields"]
    assert SCHEMA["drivers"]["raw_exec"]["mount_configs"] == "drivers.MountConfigSupportNone"


@pytest.mark.parametrize("name", JOBS)
def test_every_job_parses_with_hcl2_and_has_no_unknown_argument_or_validation_error(name):
    text = (JOBS_DIR / name).read_text()
    body = pygohcl.loads(text, keep_interpolations=True)     # raises on invalid HCL2
    assert len(body["job"]) == 1
    assert jobspec_check(JOBS_DIR / name, VARIABLES.get(name)) == {
        "parsed": True, "unknown_arguments": [], "validation_errors": []}


@pytest.mark.parametrize("name", JOBS)
def test_one_bogus_argument_is_refused(name):
    text = (JOBS_DIR / name).read_text()
    bogus = re.sub(r'(\n    task "[a-z]+" \{\n)', r'\1      bogus_argument = "x"\n', text, count=1)
    assert bogus != text
    (label, job), = pygohcl.loads(bogus, keep_interpolations=True)["job"].items()
    unknown = unknown_arguments(job)
    assert len(unknown) == 1 and unknown[0].endswith(".bogus_argument")
    with pytest.raises(ParseError, match='An argument named "bogus_argument" is not expected'):
        parse_job(bogus, "".join(f'{k} = "{v}"\n' for k, v in VARIABLES.get(name, {}).items()))


def test_interpolation_in_a_job_label_is_refused_by_hcl2():
    with pytest.raises(ParseError, match="Template sequences are not allowed in this string"):
        parse_job('variable "m" { type = string }\njob "r-${var.m}" {\n}\n', 'm = "x"\n')


def test_shutdown_delay_in_a_service_is_an_unknown_argument():
    job = {"group": {"g": {"service": [{"name": "s", "shutdown_delay": "5s"}],
                           "shutdown_delay": "5s"}}}
    assert unknown_arguments(job) == ["job.group[g].service.shutdown_delay"]


def test_a_drivers_config_takes_only_its_own_keys():
    job = {"group": {"g": {"task": {"t": {"driver": "raw_exec",
                                          "config": {"command": "x", "image": "y"}}}}}}
    assert unknown_arguments(job) == ["job.group[g].task[t].config.image"]
    job["group"]["g"]["task"]["t"]["driver"] = "docker"
    assert unknown_arguments(job) == []


def _job(group_hcl: str, jtype: str = "service", task_hcl: str = "") -> dict:
    return parse_job(f'job "j" {{\n  type = "{jtype}"\n  group "g" {{\n{group_hcl}\n'
                     f'    task "t" {{\n      driver = "raw_exec"\n{task_hcl}\n'
                     '      config {\n        command = "true"\n      }\n    }\n  }\n}\n')


def test_reschedule_delay_below_five_seconds_is_nomads_validation_error():
    job = _job('    reschedule {\n      delay = "2s"\n      unlimited = true\n    }')
    errors = validate(job)
    assert errors == ["Task group g validation failed: "
                      + multierror(["Delay cannot be less than 5s (got 2s)"])]
    assert validate(_job('    reschedule {\n      delay = "5s"\n    }')) == []


def test_restart_and_update_rules_per_job_type():
    ambiguous = _job('    restart {\n      attempts = 0\n      mode = "delay"\n    }')
    assert 'Restart policy "delay" with 0 attempts is ambiguous' in validate(ambiguous)[0]
    short = _job('    restart {\n      interval = "4s"\n      attempts = 1\n      delay = "1s"\n    }')
    assert "Interval can not be less than 5s (got 4s)" in validate(short)[0]
    batch = _job('    update {\n      max_parallel = 1\n    }', jtype="batch")
    assert 'Job type "batch" does not allow update block' in validate(batch)[0]
    system = _job('    reschedule {\n      delay = "5s"\n    }', jtype="system")
    assert "System or sysbatch jobs should not have a reschedule policy" in validate(system)[0]


def test_raw_exec_with_a_host_volume_and_a_long_kill_timeout_fail_on_the_client():
    job = _job('    volume "v" {\n      type = "host"\n      source = "v"\n    }',
               task_hcl='      kill_timeout = "35s"\n      volume_mount {\n        volume = "v"\n'
                        '        destination = "/d"\n      }')
    assert validate(job) == []                   # the server takes it ...
    assert client_problems(job) == [             # ... the client cannot run it as written
        'task driver "raw_exec" for "t" does not support host volumes',
        "task t: kill_timeout 35s is capped at the client's max_kill_timeout 30s"]


def test_go_duration_strings():
    assert [go_duration(n * 10**9) for n in (0, 2, 5, 60, 90, 3600)] == [
        "0s", "2s", "5s", "1m0s", "1m30s", "1h0m0s"]
    assert go_duration(500_000_000) == "500ms"


def test_a_service_job_without_update_block_gets_nomads_default_strategy():
    # api.Job.Canonicalize: DefaultUpdateStrategy (max_parallel 1), so deployments happen
    job = _job("")
    assert job["Update"]["MaxParallel"] == 1 and job["TaskGroups"][0]["Update"]["MaxParallel"] == 1
    off = parse_job('job "j" {\n  update {\n    max_parallel = 0\n  }\n  group "g" {\n'
                    '    task "t" {\n      driver = "exec"\n    }\n  }\n}\n')
    assert off["TaskGroups"][0]["Update"]["MaxParallel"] == 0 and validate(off) == []


ACL_DIR = JOBS_DIR / "acl"


def test_the_acl_policies_parse_as_the_servers_parse_them():
    from tests.cluster.consul_acl import Rules
    from tests.cluster.nomad_acl import Policy

    names = sorted(p.name for p in ACL_DIR.glob("*.policy.hcl"))
    assert names == [f"{kind}-rewarm-{job}.policy.hcl" for kind in ("consul", "nomad")
                     for job in ("agent", "frontdoor", "predictor")]
    predictor = Policy.parse("p", (ACL_DIR / "nomad-rewarm-predictor.policy.hcl").read_text())
    assert {"scale-job", "submit-job", "parse-job", "read-job"} <= predictor.namespaces["default"]
    agent = Policy.parse("a", (ACL_DIR / "nomad-rewarm-agent.policy.hcl").read_text())
    assert agent.node == "write" and agent.namespaces == {}
    door = Rules.parse((ACL_DIR / "consul-rewarm-frontdoor.policy.hcl").read_text())
    assert door.allows("service", "rewarm-frontdoor-http", write=True)
    assert not door.allows("key", "rewarm/models/m", write=True)
    lock = Rules.parse((ACL_DIR / "consul-rewarm-predictor.policy.hcl").read_text())
    assert lock.allows("key", "rewarm/predictor/leader", write=True)
    assert lock.allows("service", "rewarm-predictor-leader-x", write=True)
    assert not lock.allows("key", "rewarm/snapshots/m", write=True)
