"""The job specs in jobs/, parsed by Nomad's parser (the stand-in's /v1/jobs/parse), have
what the code and an operator rely on; rewarm sends HCL to Nomad and converts none itself."""

import argparse
import json
import re
from pathlib import Path

import pytest

from agent.cluster.cli import register
from agent.cluster.jobs import (JOBS_DIR, parse_job, replica_job,
                                variables_file)
from agent.cluster.nomad_http import nomad_client
from agent.cluster.nomad_scaler import GROUP, JOB_PREFIX
from agent.cluster.node_meta import SNAPSHOTS_META_KEY
from agent.errors import ClusterError, ConfigError

JOBS = ["rewarm-agent.nomad.hcl", "rewarm-frontdoor.nomad.hcl", "rewarm-predictor.nomad.hcl",
        "rewarm-replica.nomad.hcl"]
DRAIN_GRACE_S = 25          # --drain-grace-s of the front door and agent in jobs/
MAX_KILL_TIMEOUT_S = 30     # a Nomad client's default max_kill_timeout (command/agent/config.go)


def parsed(standin, name, **variables):
    if name == "rewarm-replica.nomad.hcl":
        variables.setdefault("model", "smollm2")
    return parse_job(nomad_client(address=standin.url), (JOBS_DIR / name).read_text(), variables)


def groups(job):
    return job["TaskGroups"]


@pytest.mark.parametrize("name", JOBS)
def test_every_job_parses_with_its_variables_and_has_operator_stanzas(nomad_standin, name):
    job = parsed(nomad_standin, name)
    assert job["ID"].startswith("rewarm-")
    sent = nomad_standin.parse_requests[-1]
    assert sent["JobHCL"] == (JOBS_DIR / name).read_text() and sent["Canonicalize"] is True
    if job["Type"] != "system":
        # the replica job opts out of deployments (max_parallel 0, see its comment); the
        # others roll one allocation at a time
        want = 0 if name == "rewarm-replica.nomad.hcl" else 1
        assert job["Update"]["MaxParallel"] == want
        assert all(g["Update"]["MaxParallel"] == want for g in groups(job))
    for g in groups(job):
        assert g["RestartPolicy"]["Mode"] in ("fail", "delay")
        if job["Type"] == "service":
            assert g["ReschedulePolicy"]["Unlimited"] is True
        labels = [p["Label"] for n in g.get("Networks") or []
                  for p in (n.get("DynamicPorts") or []) + (n.get("ReservedPorts") or [])]
        served = [s["PortLabel"] for s in g.get("Services") or []]
        assert sorted(labels) == sorted(served)          # every port by label, each a service
        for svc in g.get("Services") or []:
            assert svc["Checks"], svc["Name"]            # a health check on every service
            assert svc["Checks"][0]["Type"] in ("tcp", "http")
        for task in g["Tasks"]:
            assert task["KillSignal"] == "SIGTERM"
            assert "${" not in json.dumps(task["Config"]).replace("${attr.", "").replace(
                "${NOMAD_", "").replace("${node.", "")   # every var.* was resolved


@pytest.mark.parametrize("name", ["rewarm-agent.nomad.hcl", "rewarm-frontdoor.nomad.hcl",
                                  "rewarm-replica.nomad.hcl"])
def test_kill_timeout_is_the_drain_grace_plus_a_margin_within_the_clients_cap(nomad_standin,
                                                                              name):
    task = groups(parsed(nomad_standin, name))[0]["Tasks"][0]
    assert task["KillTimeout"] == (DRAIN_GRACE_S + 5) * 10**9 <= MAX_KILL_TIMEOUT_S * 10**9
    assert "--drain-grace-s" in (JOBS_DIR / name).read_text()   # the comment says why
    agent = groups(parsed(nomad_standin, "rewarm-agent.nomad.hcl"))[0]["Tasks"][0]
    args = agent["Config"]["args"]
    assert float(args[args.index("--drain-grace-s") + 1]) == DRAIN_GRACE_S


def test_shutdown_delay_is_on_the_groups_clients_route_to(nomad_standin):
    for name, seconds in (("rewarm-frontdoor.nomad.hcl", 5), ("rewarm-agent.nomad.hcl", 2)):
        g = groups(parsed(nomad_standin, name))[0]
        assert g["ShutdownDelay"] == seconds * 10**9


def test_agent_system_job_reserves_no_gpu_and_publishes_node_metadata(nomad_standin):
    job = parsed(nomad_standin, "rewarm-agent.nomad.hcl")
    assert job["Type"] == "system"
    task = groups(job)[0]["Tasks"][0]
    assert task["Resources"]["Devices"] is None
    args = task["Config"]["args"]
    assert "--nomad-metadata" in args and args[args.index("--nomad-node-id") + 1] == "${node.unique.id}"
    assert task["Identity"]["Env"] is True
    # raw_exec has no mounts (MountConfigSupportNone): the cache is a host path, no volume
    assert task["Driver"] == "raw_exec" and task["VolumeMounts"] is None
    assert groups(job)[0]["Volumes"] is None


def test_replica_job_from_the_template(nomad_standin):
    job = replica_job(nomad_client(address=nomad_standin.url), "smollm2", max_replicas=6)
    assert job["ID"] == JOB_PREFIX + "smollm2" and job["Type"] == "service"
    tg, = groups(job)
    assert tg["Name"] == GROUP and tg["Count"] == 0
    assert tg["Scaling"] == {"Enabled": True, "Min": 0, "Max": 6, "Type": "horizontal"}
    aff, = tg["Affinities"]
    assert aff["LTarget"] == "${meta.%s}" % SNAPSHOTS_META_KEY
    assert aff["Operand"] == "set_contains" and aff["RTarget"] == "smollm2"
    task, = tg["Tasks"]
    assert task["Resources"]["Devices"] == [{"Name": "nvidia/gpu", "Count": 1}]
    assert task["Config"]["command"] == "rewarm"
    assert task["Config"]["args"][:2] == ["hold", "smollm2"]
    assert task["Config"]["args"][3] == "${attr.unique.network.ip-address}:7733"
    assert tg["RestartPolicy"]["Attempts"] == 0 and tg["RestartPolicy"]["Mode"] == "fail"
    assert "model = \"smollm2\"" in nomad_standin.parse_requests[-1]["Variables"]


@pytest.mark.parametrize("model,mx", [("", 4), ("bad/name", 4), ("x" * 64, 4), ("m", 0),
                                      ("m", 1025), (None, 4), ("m#frag", 4), ("..", 4),
                                      ("a/../../acl/bootstrap", 4)])
def test_replica_job_limits_are_checked_before_any_request(nomad_standin, model, mx):
    with pytest.raises(ConfigError):
        replica_job(nomad_client(address=nomad_standin.url), model, mx)
    assert nomad_standin.requests == []


def test_replica_job_limits_at_their_values(nomad_standin):
    client = nomad_client(address=nomad_standin.url)
    assert replica_job(client, "x" * 63, 1)["TaskGroups"][0]["Scaling"]["Max"] == 1
    assert replica_job(client, "m", 1024)["TaskGroups"][0]["Scaling"]["Max"] == 1024


def test_variables_file_quotes_and_escapes_template_sequences():
    text = variables_file({"model": 'a"b', "n": 3, "on": True, "t": "${x} %{y}"})
    assert text == 'model = "a\\"b"\nn = 3\non = true\nt = "$${x} %%{y}"\n'
    with pytest.raises(ConfigError):
        variables_file({"bad name": "x"})
    with pytest.raises(ConfigError):
        variables_file({"x": [1]})


def test_nomads_parse_errors_are_typed(nomad_standin):
    client = nomad_client(address=nomad_standin.url)
    with pytest.raises(ClusterError) as err:                  # no value for "model"
        parse_job(client, (JOBS_DIR / "rewarm-replica.nomad.hcl").read_text(), {})
    assert err.value.status == 400 and "model" in str(err.value)
    with pytest.raises(ClusterError) as err:
        parse_job(client, "job {", {})
    assert err.value.status == 400
    with pytest.raises(ConfigError):
        parse_job(client, "#" * ((1 << 20) + 1), {})


def test_parse_needs_the_acl_capability(nomad_standin):
    from agent.errors import AclDenied

    nomad_standin.acl_token = "right"
    with pytest.raises(AclDenied) as err:
        parse_job(nomad_client(address=nomad_standin.url, token="wrong"), "job \"x\" {}", {})
    assert err.value.status == 403 and "parse-job" in str(err.value)


def test_cli_render_and_run(nomad_standin, capsys, monkeypatch):
    monkeypatch.setenv("NOMAD_ADDR", nomad_standin.url)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["jobs", "render", "--model", "m", "--max-replicas", "3"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["Job"]["TaskGroups"][0]["Scaling"]["Max"] == 3
    args = parser.parse_args(["jobs", "run", str(JOBS_DIR / "rewarm-replica.nomad.hcl"),
                              "-var", "model=m2", "-var", "max_replicas=2"])
    assert args.func(args) == 0
    job = nomad_standin.job("rewarm-replica-m2")
    assert job["TaskGroups"][0]["Scaling"]["Max"] == 2
    args = parser.parse_args(["jobs", "render", "--model", "bad/name"])
    assert args.func(args) == 2 and "model" in capsys.readouterr().err


def test_no_hcl_is_converted_inside_agent():
    root = Path(__file__).resolve().parents[2] / "agent"
    offenders = [str(p) for p in root.rglob("*.py")
                 if re.search(r"^\s*(import hcl2|from hcl2|import pygohcl|from pygohcl)",
                              p.read_text(), re.M)]
    assert offenders == []


@pytest.mark.parametrize("name", ["rewarm-agent.nomad.hcl", "rewarm-replica.nomad.hcl",
                                  "rewarm-frontdoor.nomad.hcl"])
def test_tasks_get_the_control_token_from_nomad_variables(nomad_standin, name):
    task = groups(parsed(nomad_standin, name))[0]["Tasks"][0]
    tmpl, = [t for t in task["Templates"] if "REWARM_CONTROL_TOKEN" in t["EmbeddedTmpl"]]
    assert tmpl["Envvars"] is True and tmpl["DestPath"].startswith("secrets/")
    assert tmpl["EmbeddedTmpl"].strip().startswith("REWARM_CONTROL_TOKEN={{ with nomadVar")


@pytest.mark.parametrize("name,job", [("rewarm-agent.nomad.hcl", "rewarm-agent"),
                                      ("rewarm-frontdoor.nomad.hcl", "rewarm-frontdoor"),
                                      ("rewarm-predictor.nomad.hcl", "rewarm-predictor")])
def test_consul_callers_get_their_consul_token_from_a_template(nomad_standin, name, job):
    task = groups(parsed(nomad_standin, name))[0]["Tasks"][0]
    tmpl, = [t for t in task["Templates"] if "CONSUL_HTTP_TOKEN" in t["EmbeddedTmpl"]]
    assert tmpl["Envvars"] is True and tmpl["DestPath"] == "secrets/consul.env"
    assert f'nomadVar "nomad/jobs/{job}"' in tmpl["EmbeddedTmpl"]
    assert "{{ .consul_token }}" in tmpl["EmbeddedTmpl"]


@pytest.mark.parametrize("name", ["rewarm-predictor.nomad.hcl", "rewarm-frontdoor.nomad.hcl"])
def test_nomad_callers_get_a_workload_identity_token(nomad_standin, name):
    task = groups(parsed(nomad_standin, name))[0]["Tasks"][0]
    assert task["Identity"]["Env"] is True          # NOMAD_TOKEN in the task's environment
    assert "--scaler" in task["Config"]["args"]
    assert "--model" not in task["Config"]["args"] or name.startswith("rewarm-predictor")


def test_systemd_units_restart_and_read_the_environment_file():
    units = sorted((JOBS_DIR / "systemd").glob("rewarm-*.service"))
    assert [u.name for u in units] == ["rewarm-agent.service", "rewarm-frontdoor.service",
                                       "rewarm-predictor.service"]
    for unit in units:
        text = unit.read_text()
        assert "Restart=on-failure" in text and "EnvironmentFile=" in text
        assert "ExecStart=" in text
    env = (JOBS_DIR / "systemd" / "rewarm.env.example").read_text()
    defined = {line.split("=", 1)[0].lstrip("# ") for line in env.splitlines() if "=" in line}
    import re
    for unit in units:
        used = set(re.findall(r"\$\{(\w+)\}", unit.read_text()))
        assert used <= defined, (unit.name, used - defined)




def test_cli_exit_statuses_nomad_unreachable_69_missing_file_66(tmp_path, capsys, monkeypatch):
    """The README's exit statuses: both exited 2 (usage) before."""
    import socket

    from agent import exitcodes

    with socket.socket() as s:       # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setenv("NOMAD_ADDR", f"http://127.0.0.1:{free}")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["jobs", "render", "--model", "m"])
    assert args.func(args) == exitcodes.EX_UNAVAILABLE and "nomad" in capsys.readouterr().err
    args = parser.parse_args(["jobs", "run", str(tmp_path / "nope.nomad.hcl")])
    assert args.func(args) == exitcodes.EX_NOINPUT and "nope.nomad.hcl" in capsys.readouterr().err
