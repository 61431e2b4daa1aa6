"""The Nomad stand-in's client half: templates from Nomad Variables, NOMAD_* environment,
raw_exec run, kill signal then SIGKILL after kill_timeout, restart policy."""

import json
import sys
import time

import pytest
import requests

from tests.cluster.nomad_runner import TemplateError, env_lines, render_template

RAW_EXEC = ("raw_exec",)      # clients enable it in their plugin config; off by default
# Update MaxParallel 0: no deployment, so the test may scale at once (see nomad_deployments)
JOB = {"ID": "j", "Name": "j", "Type": "service", "Meta": {"k": "v"},
       "Update": {"MaxParallel": 0}, "TaskGroups": [{
    "Name": "g", "Count": 1, "RestartPolicy": {"Attempts": 0, "Mode": "fail"},
    "ReschedulePolicy": {"Delay": int(60e9), "DelayFunction": "constant", "Unlimited": True},
    "Networks": [{"DynamicPorts": [{"Label": "http", "Value": 0}]}],
    "Tasks": [{"Name": "t", "Driver": "raw_exec", "KillSignal": "SIGTERM",
               "KillTimeout": int(0.5e9), "Identity": {"Env": True},
               "Env": {"FROM_ENV": "${NOMAD_PORT_http}-${node.unique.name}"},
               "Config": {"command": sys.executable, "args": ["-c", "PROGRAM"]},
               "Templates": [{"EmbeddedTmpl": 'SECRET={{ with nomadVar "nomad/jobs" }}'
                                              '{{ .s }}{{ end }}\n',
                              "DestPath": "secrets/s.env", "Envvars": True}],
               "Resources": {"CPU": 100, "MemoryMB": 64, "Devices": [
                   {"Name": "nvidia/gpu", "Count": 1}]}}]}]}

# Writes its environment, then ignores SIGTERM (so the kill needs the SIGKILL) and sleeps.
PROGRAM = ("import json, os, signal, time; "
           "json.dump(dict(os.environ), open('env.json', 'w')); "
           "signal.signal(signal.SIGTERM, lambda *a: open('term', 'w').close()); "
           "time.sleep(600)")


def test_templates_render_variables_the_task_may_read():
    read = {"nomad/jobs": {"s": "x1"}}.get
    assert render_template('A={{ with nomadVar "nomad/jobs" }}{{ .s }}{{ end }}', read,
                           lambda p: True) == "A=x1"
    assert render_template('A={{ with nomadVar "nomad/jobs/none" }}{{ .s }}{{ end }}', read,
                           lambda p: True) == "A="
    with pytest.raises(TemplateError):
        render_template('{{ with nomadVar "nomad/jobs/other" }}{{ end }}', read,
                        lambda p: p == "nomad/jobs")
    assert env_lines("A=1\n# c\n\nB = two\n") == {"A": "1", "B": "two"}


def wait(cond, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_an_allocation_runs_with_its_environment_and_is_killed_after_kill_timeout(nomad_standin):
    node = nomad_standin.add_node("n1", "127.0.0.1", gpus=1, drivers=RAW_EXEC)
    nomad_standin.variables[("default", "nomad/jobs")] = {"Path": "nomad/jobs",
                                                         "Items": {"s": "sekrit"}}
    job = json.loads(json.dumps(JOB).replace("PROGRAM", PROGRAM.replace('"', '\\"')))
    r = requests.post(f"{nomad_standin.url}/v1/jobs", json={"Job": job}, timeout=5)
    assert r.status_code == 200
    wait(lambda: nomad_standin.job_allocs("j")
         and nomad_standin.job_allocs("j")[0]["ClientStatus"] == "running")
    alloc = nomad_standin.job_allocs("j")[0]
    task_dir = nomad_standin.data_dir / alloc["ID"] / "t"
    wait(lambda: (task_dir / "env.json").exists() and (task_dir / "env.json").stat().st_size)
    env = json.loads((task_dir / "env.json").read_text())
    port = alloc["AllocatedResources"]["Shared"]["Ports"][0]["Value"]
    assert env["NOMAD_ALLOC_ID"] == alloc["ID"] and env["NOMAD_JOB_ID"] == "j"
    assert env["NOMAD_GROUP_NAME"] == "g" and env["NOMAD_TASK_NAME"] == "t"
    assert env["NOMAD_PORT_http"] == str(port) and env["NOMAD_ADDR_http"] == f"127.0.0.1:{port}"
    assert env["NOMAD_META_k"] == "v" and env["SECRET"] == "sekrit"
    assert env["FROM_ENV"] == f"{port}-n1"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-n1-0" and env["NOMAD_TOKEN"]
    assert (task_dir / "secrets" / "s.env").read_text() == "SECRET=sekrit\n"
    # the device is held: a second allocation stays pending
    requests.post(f"{nomad_standin.url}/v1/job/j/scale",
                  json={"Count": 2, "Target": {"Group": "g"}}, timeout=5)
    time.sleep(0.5)
    assert [a["ClientStatus"] for a in nomad_standin.job_allocs("j")] == ["running"]
    # scale to 0: SIGTERM (ignored by the task), then SIGKILL after kill_timeout
    requests.post(f"{nomad_standin.url}/v1/job/j/scale",
                  json={"Count": 0, "Target": {"Group": "g"}}, timeout=5)
    wait(lambda: nomad_standin.job_allocs("j")[0]["ClientStatus"] == "complete")
    events = [e["Type"] for e in nomad_standin.job_allocs("j")[0]["TaskStates"]["t"]["Events"]]
    assert events[:1] == ["Started"] and "Killing" in events and events[-1] == "Killed"
    assert (task_dir / "term").exists()                    # it got the kill signal first
    runner = nomad_standin.runner(alloc["ID"])
    assert runner.proc.returncode == -9                    # and SIGKILL after kill_timeout
    assert node.id == alloc["NodeID"]


def test_a_task_that_exits_fails_its_allocation_and_is_rescheduled(nomad_standin):
    nomad_standin.add_node("n1", "127.0.0.1", gpus=1, drivers=RAW_EXEC)
    nomad_standin.add_node("n2", "127.0.0.1", gpus=1, drivers=RAW_EXEC)
    job = json.loads(json.dumps(JOB).replace("PROGRAM", "import sys; sys.exit(3)"))
    job["TaskGroups"][0]["ReschedulePolicy"]["Delay"] = int(5e9)    # Nomad's minimum
    job["TaskGroups"][0]["Tasks"][0]["Templates"] = None
    requests.post(f"{nomad_standin.url}/v1/jobs", json={"Job": job}, timeout=5)
    wait(lambda: len(nomad_standin.job_allocs("j")) >= 2)
    first, second = sorted(nomad_standin.job_allocs("j"), key=lambda a: a["CreateIndex"])[:2]
    assert first["ClientStatus"] == "failed" and first["NextAllocation"] == second["ID"]
    assert second["NodeID"] != first["NodeID"]             # away from the failed node
    assert second["RescheduleTracker"]["Events"][0]["PrevAllocID"] == first["ID"]
    requests.delete(f"{nomad_standin.url}/v1/job/j", timeout=5)


def test_a_template_the_task_may_not_read_fails_the_allocation(nomad_standin):
    nomad_standin.add_node("n1", "127.0.0.1", gpus=1, drivers=RAW_EXEC)
    job = json.loads(json.dumps(JOB).replace("PROGRAM", "pass"))
    job["TaskGroups"][0]["Tasks"][0]["Templates"][0]["EmbeddedTmpl"] = (
        '{{ with nomadVar "nomad/jobs/other-job" }}{{ .s }}{{ end }}')
    requests.post(f"{nomad_standin.url}/v1/jobs", json={"Job": job}, timeout=5)
    wait(lambda: nomad_standin.job_allocs("j"))
    wait(lambda: nomad_standin.job_allocs("j")[0]["ClientStatus"] == "failed")
    events = nomad_standin.job_allocs("j")[0]["TaskStates"]["t"]["Events"]
    assert events[0]["Type"] == "Template Failure" and "Permission denied" in events[0][
        "DisplayMessage"]


def test_raw_exec_runs_only_on_clients_that_enable_it(nomad_standin):
    nomad_standin.add_node("n1", "127.0.0.1", gpus=1)          # default drivers: exec only
    job = json.loads(json.dumps(JOB).replace("PROGRAM", "pass"))
    assert requests.post(f"{nomad_standin.url}/v1/jobs", json={"Job": job},
                         timeout=5).status_code == 200
    time.sleep(0.5)                                             # a few scheduler ticks
    assert nomad_standin.job_allocs("j") == []                  # no feasible node
    nomad_standin.add_node("n2", "127.0.0.1", gpus=1, drivers=RAW_EXEC)
    wait(lambda: [a["NodeName"] for a in nomad_standin.job_allocs("j")] == ["n2"])


def test_kill_timeout_is_capped_at_the_clients_max_kill_timeout(nomad_standin):
    nomad_standin.add_node("n1", "127.0.0.1", gpus=1, drivers=RAW_EXEC, max_kill_timeout_s=0.25)
    job = json.loads(json.dumps(JOB).replace("PROGRAM", PROGRAM.replace('"', '\\"')))
    job["TaskGroups"][0]["Tasks"][0]["KillTimeout"] = int(35e9)
    requests.post(f"{nomad_standin.url}/v1/jobs", json={"Job": job}, timeout=5)
    wait(lambda: nomad_standin.job_allocs("j")
         and nomad_standin.job_allocs("j")[0]["ClientStatus"] == "running")
    runner = nomad_standin.runner(nomad_standin.job_allocs("j")[0]["ID"])
    assert runner.kill_timeout_s == 0.25                        # min(35 s, max_kill_timeout)


def test_a_host_volume_on_raw_exec_fails_the_task_in_prestart(nomad_standin):
    nomad_standin.add_node("n1", "127.0.0.1", gpus=1, drivers=RAW_EXEC)
    job = json.loads(json.dumps(JOB).replace("PROGRAM", "pass"))
    job["TaskGroups"][0]["Volumes"] = {"v": {"Name": "v", "Type": "host", "Source": "v"}}
    job["TaskGroups"][0]["Tasks"][0]["VolumeMounts"] = [{"Volume": "v", "Destination": "/d"}]
    requests.post(f"{nomad_standin.url}/v1/jobs", json={"Job": job}, timeout=5)
    wait(lambda: nomad_standin.job_allocs("j")
         and nomad_standin.job_allocs("j")[0]["ClientStatus"] == "failed")
    event = nomad_standin.job_allocs("j")[0]["TaskStates"]["t"]["Events"][0]
    assert event["DisplayMessage"] == 'task driver "raw_exec" for "t" does not support host volumes'
