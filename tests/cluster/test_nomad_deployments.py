"""The Nomad stand-in's deployments and validation, as Nomad's servers behave
(nomad_deployments.py and nomad_validate.py cite the source they follow)."""

import copy
import json
import sys
import time

import requests

RAW_EXEC = ("raw_exec",)
SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]
S = 10**9


def job(count=1, args=SLEEP, update=None):
    return {"ID": "d", "Type": "service",
            "Update": update or {"MaxParallel": 1, "MinHealthyTime": int(0.3 * S),
                                 "HealthyDeadline": 60 * S, "AutoRevert": True},
            "TaskGroups": [{"Name": "g", "Count": count,
                            "RestartPolicy": {"Attempts": 0, "Mode": "fail"},
                            "ReschedulePolicy": {"Attempts": 0, "Unlimited": False},
                            "Tasks": [{"Name": "t", "Driver": "raw_exec", "KillTimeout": S // 2,
                                       "Config": {"command": args[0], "args": args[1:]}}]}]}


def wait(cond, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def latest(base):
    return requests.get(f"{base}/v1/job/d/deployment", timeout=5).json()


def test_a_deployment_starts_blocks_scaling_and_succeeds_then_marks_the_version_stable(
        nomad_standin):
    nomad_standin.add_node("n1", "127.0.0.1", drivers=RAW_EXEC)
    base = nomad_standin.url
    assert requests.post(f"{base}/v1/jobs", json={"Job": job()}, timeout=5).status_code == 200
    dep = latest(base)
    assert dep["Status"] == "running" and dep["JobVersion"] == 0
    r = requests.post(f"{base}/v1/job/d/scale", json={"Count": 2, "Target": {"Group": "g"}},
                      timeout=5)
    assert r.status_code == 400 and r.text == "job scaling blocked due to active deployment"
    wait(lambda: latest(base)["Status"] == "successful")
    assert nomad_standin.job("d")["Stable"] is True
    # the count change writes version 1 and starts another deployment
    r = requests.post(f"{base}/v1/job/d/scale", json={"Count": 2, "Target": {"Group": "g"}},
                      timeout=5)
    assert r.status_code == 200
    dep = latest(base)
    assert dep["JobVersion"] == 1 and dep["Status"] == "running"
    assert dep["TaskGroups"]["g"]["DesiredTotal"] == 2
    wait(lambda: latest(base)["Status"] == "successful")


def test_scaling_to_zero_or_max_parallel_zero_starts_no_deployment(nomad_standin):
    base = nomad_standin.url
    off = job(update={"MaxParallel": 0})
    assert requests.post(f"{base}/v1/jobs", json={"Job": off}, timeout=5).status_code == 200
    for count in (2, 3, 0):
        assert requests.post(f"{base}/v1/job/d/scale", timeout=5,
                             json={"Count": count, "Target": {"Group": "g"}}).status_code == 200
    assert requests.get(f"{base}/v1/job/d/deployments", timeout=5).json() == []


def test_a_failed_deployment_auto_reverts_to_the_latest_stable_version(nomad_standin):
    nomad_standin.add_node("n1", "127.0.0.1", drivers=RAW_EXEC)
    base = nomad_standin.url
    requests.post(f"{base}/v1/jobs", json={"Job": job()}, timeout=5)
    wait(lambda: latest(base)["Status"] == "successful")
    broken = job(args=[sys.executable, "-c", "raise SystemExit(1)"])
    assert requests.post(f"{base}/v1/jobs", json={"Job": broken}, timeout=5).status_code == 200
    # the revert registers version 2 at once, which starts a deployment of its own
    failed, = wait(lambda: [d for d in requests.get(f"{base}/v1/job/d/deployments",
                                                     timeout=5).json() if d["Status"] == "failed"])
    assert failed["JobVersion"] == 1
    assert failed["StatusDescription"] == ("Failed due to unhealthy allocations - rolling back "
                                           "to job version 0")
    now = nomad_standin.job("d")
    assert now["Version"] == 2 and now["TaskGroups"][0]["Tasks"][0]["Config"]["args"] == SLEEP[1:]


def test_an_invalid_job_is_answered_500_with_nomads_validation_text(nomad_standin):
    bad = copy.deepcopy(job())
    bad["TaskGroups"][0]["ReschedulePolicy"] = {"Delay": 2 * S, "Unlimited": True}
    r = requests.post(f"{nomad_standin.url}/v1/jobs", json={"Job": bad}, timeout=5)
    assert r.status_code == 500
    assert r.text == ("1 error occurred:\n\t* Task group g validation failed: 1 error occurred:"
                      "\n\t* Delay cannot be less than 5s (got 2s)\n\n\n\n")
    assert nomad_standin.job("d") is None and nomad_standin.register_requests == [(500, "d")]


def test_a_job_is_canonicalized_before_validation(nomad_standin):
    bare = {"ID": "d", "TaskGroups": [{"Name": "g", "Tasks": [{"Name": "t", "Driver": "exec"}]}]}
    assert requests.post(f"{nomad_standin.url}/v1/jobs", json={"Job": bare},
                         timeout=5).status_code == 200
    stored = nomad_standin.job("d")
    g = stored["TaskGroups"][0]
    assert stored["Update"]["MaxParallel"] == 1 and g["Update"]["MinHealthyTime"] == 10 * S
    assert g["ReschedulePolicy"]["Delay"] == 30 * S and g["RestartPolicy"]["Attempts"] == 2
    assert g["Tasks"][0]["KillTimeout"] == 5 * S and json.dumps(stored)
