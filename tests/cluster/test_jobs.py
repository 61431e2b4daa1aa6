"""Every job spec parses (python-hcl2) and has the fields the code relies on."""

import argparse
import json

import pytest

from agent.cluster.cli import register
from agent.cluster.jobs import JOBS_DIR, load_hcl, render_replica_job
from agent.cluster.nomad_scaler import GROUP, JOB_PREFIX, SNAPSHOTS_META_KEY
from agent.errors import ConfigError


def parse(name):
    return load_hcl((JOBS_DIR / name).read_text().replace("__MAX__", "8"))


def job_body(parsed):
    (label, body), = parsed["job"][0].items()
    return label, body


def test_agent_is_a_system_job_with_gpu_and_volume():
    label, job = job_body(parse("rewarm-agent.nomad.hcl"))
    assert label == "rewarm-agent" and job["type"] == "system"
    (gname, group), = job["group"][0].items()
    assert "snapshots" in group["volume"][0]
    (tname, task), = group["task"][0].items()
    assert task["volume_mount"][0]["volume"] == "snapshots"
    assert "nvidia/gpu" in task["resources"][0]["device"][0]


@pytest.mark.parametrize("name,service", [("rewarm-frontdoor.nomad.hcl", "rewarm-frontdoor"),
                                          ("rewarm-predictor.nomad.hcl", "rewarm-predictor")])
def test_services_register_with_consul_and_a_check(name, service):
    _, job = job_body(parse(name))
    assert job["type"] == "service"
    (_, group), = job["group"][0].items()
    svc = group["service"][0]
    assert svc["name"] == service and svc["provider"] == "consul"
    assert svc["check"][0]["interval"]


def test_replica_template_renders_for_the_api():
    job = render_replica_job("smollm2", max_replicas=6)
    assert job["ID"] == JOB_PREFIX + "smollm2" and job["Type"] == "service"
    tg, = job["TaskGroups"]
    assert tg["Name"] == GROUP and tg["Count"] == 0
    assert tg["Scaling"]["Min"] == 0 and tg["Scaling"]["Max"] == 6
    aff, = tg["Affinities"]
    assert aff["LTarget"] == "${meta.%s}" % SNAPSHOTS_META_KEY
    assert aff["Operand"] == "set_contains" and aff["RTarget"] == "smollm2"
    task, = tg["Tasks"]
    assert task["Resources"]["Devices"] == [{"Name": "nvidia/gpu", "Count": 1}]
    assert "model=smollm2" in tg["Services"][0]["Tags"]


@pytest.mark.parametrize("model,mx", [("", 4), ("bad/name", 4), ("x" * 64, 4), ("m", 0),
                                      ("m", 1025)])
def test_render_limits(model, mx):
    with pytest.raises(ConfigError):
        render_replica_job(model, mx)


def test_render_limits_at_their_values():
    render_replica_job("x" * 63, 1)
    render_replica_job("m", 1024)


def test_cli_prints_the_job(capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["jobs", "render", "--model", "m", "--max-replicas", "3"])
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["Job"]["TaskGroups"][0]["Scaling"]["Max"] == 3


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


def test_hcl_strings_are_unescaped_like_hcl():
    parsed = load_hcl('x = "a\\"b\\\\c $${y}\\n"\n'
                      'h = <<-EOT\n    one "q"\n      two $${z}\n    EOT\n'
                      'k = <<EOT\nraw\nEOT\n')
    assert parsed == {"x": 'a"b\\c ${y}\n', "h": 'one "q"\n  two ${z}\n', "k": "raw\n"}


def test_replica_task_restores_through_the_agent_and_drains_on_stop():
    task = render_replica_job("m", 2)["TaskGroups"][0]["Tasks"][0]
    assert task["Config"]["command"] == "/bin/sh"
    script = task["Config"]["args"][1]
    assert script.startswith("set -e\n") and "EOT" not in script
    assert "rewarm agent restore m " in script and "rewarm agent drain" in script
    assert "${attr.unique.network.ip-address}:7733" in script   # Nomad interpolates it
    assert task["KillTimeout"] == 60 * 10**9


def test_predictor_job_meta_feeds_its_model_flag():
    from agent.cluster.jobs import to_api_job

    job = to_api_job(parse("rewarm-predictor.nomad.hcl"))
    assert job["Meta"]["models"].count(":") == 2
    args = job["TaskGroups"][0]["Tasks"][0]["Config"]["args"]
    assert args[args.index("--model") + 1] == "${NOMAD_META_models}"


def test_durations_convert_to_nanoseconds():
    from agent.cluster.jobs import _duration_ns

    assert _duration_ns("500ms") == 500_000_000 and _duration_ns("2m") == 120 * 10**9
    assert _duration_ns(None) is None
    with pytest.raises(ConfigError):
        _duration_ns("soon")


@pytest.mark.parametrize("name", ["rewarm-agent.nomad.hcl", "rewarm-replica.nomad.hcl"])
def test_agent_and_replica_tasks_get_the_control_token_from_nomad_variables(name):
    _, job = job_body(parse(name))
    (_, group), = job["group"][0].items()
    (_, task), = group["task"][0].items()
    template = task["template"][0]
    assert template["env"] is True and template["destination"].startswith("secrets/")
    assert template["data"].strip().startswith("REWARM_CONTROL_TOKEN={{ with nomadVar")
