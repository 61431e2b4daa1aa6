"""Derive ``nomad_schema.json`` (the jobspec's blocks and arguments) from Nomad's own source.

    python tests/cluster/derive_nomad_schema.py NOMAD_GIT_DIR [--commit REV] > tests/cluster/nomad_schema.json

Reads, at one commit of ``github.com/hashicorp/nomad`` (``git show REV:PATH``, no work tree):

- ``api/*.go``: every struct field with an ``hcl:"name,kind"`` tag.  ``kind`` ``block``
  makes ``name`` a nested block whose schema is the field's struct type (``[]*T``,
  ``map[string]*T`` and ``*T`` all give ``T``; ``map[string]string`` and ``map[string]any``
  give a free-form body: ``meta``, ``env``, ``config``); ``label`` names a block label;
  ``optional`` (or no kind) an attribute (gohcl's tag grammar, hcl/v2/gohcl/doc.go);
- ``jobspec2/types.config.go`` and ``jobspec2/hcl_conversions.go``: what the jobspec2 decoder
  adds to the structs (a job also takes ``vault``, ``secret`` and ``task`` blocks; a group
  ``vault`` and ``secret``; a task's ``scaling`` blocks carry a label; ``meta`` and ``env``
  may be written as an attribute or a block, ``decodeAsAttribute``; ``constraint`` and
  ``affinity`` decode through ``constraintSpec``/``affinitySpec``, whose argument names are
  listed here as they are in that file);
- ``drivers/rawexec/driver.go``, ``drivers/exec/driver.go``, ``drivers/docker/config.go``:
  each driver's ``taskConfigSpec`` (``hclspec.NewAttr("name", ...)`` / ``NewBlock``), the
  arguments its ``config`` block takes, and its ``capabilities`` (``MountConfigs``,
  ``drivers.MountConfigSupportNone`` meaning no volume_mount).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

_STRUCT = re.compile(r"^type (\w+) struct \{\n(.*?)^\}", re.S | re.M)
_FIELD = re.compile(r"^\s*(\w+)\s+([^`\n]+?)\s*`([^`]*)`", re.M)
_HCL_TAG = re.compile(r'hcl:"([^"]*)"')
_SPEC_KEY = re.compile(r'^\s*(?:"(\w+)"|api\.(\w+)):\s*&hcldec\.AttrSpec\{Name:\s*(?:"(\w+)"|api\.(\w+))',
                       re.M)
_CONST = re.compile(r'^\s*(Constraint\w+)\s*=\s*"([^"]+)"', re.M)
_DRIVER_ATTR = re.compile(r'hclspec\.New(?:Attr|Default|Block|BlockList|BlockAttrs|BlockSet)\(\s*"(\w+)"')


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, *args], check=True, capture_output=True,
                          text=True).stdout


def element_type(go_type: str) -> str:
    """``[]*TaskGroup`` -> ``TaskGroup``; ``map[string]*VolumeRequest`` -> ``VolumeRequest``;
    ``map[string]string`` -> ``map``."""
    t = go_type.strip()
    if t.startswith("map["):
        value = t[t.index("]") + 1:].lstrip("*")
        return "map" if value in ("string", "any", "interface{}") else value
    return t.lstrip("[]*")


def structs(sources: dict[str, str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path, text in sources.items():
        for name, body in _STRUCT.findall(text):
            fields: dict[str, dict] = {}
            labels: list[str] = []
            for _go_name, go_type, tag in _FIELD.findall(body):
                m = _HCL_TAG.search(tag)
                if not m:
                    continue
                hname, _, kind = m.group(1).partition(",")
                if kind == "label":
                    labels.append(hname or _go_name.lower())
                elif kind == "block":
                    fields[hname] = {"kind": "block", "type": element_type(go_type)}
                elif kind in ("remain",):
                    fields["*"] = {"kind": "remain"}
                elif hname:
                    fields[hname] = {"kind": "attr"}
            if fields or labels:
                out[name] = {"file": path, "labels": labels, "fields": fields}
    return out


def spec_names(text: str, spec: str, constants: dict[str, str]) -> list[str]:
    """Argument names of ``var <spec> = hcldec.ObjectSpec{...}`` in hcl_conversions.go."""
    start = text.index(f"var {spec} = hcldec.ObjectSpec{{")
    body = text[start:text.index("\n}\n", start)]
    names = []
    for plain, const, _n1, _n2 in _SPEC_KEY.findall(body):
        names.append(plain or constants[const])
    return names


def driver_spec(text: str) -> dict:
    start = text.index("taskConfigSpec = hclspec.NewObject(map[string]*hclspec.Spec{")
    body = text[start:text.index("\n\t})", start)]
    # only the top-level keys: lines indented by exactly two tabs
    keys = re.findall(r'^\t\t"(\w+)":', body, re.M)
    mounts = re.search(r"MountConfigs:\s*(drivers\.\w+)", text)
    return {"config": sorted(keys), "mount_configs": mounts.group(1) if mounts else
            "drivers.MountConfigSupportAll (the default: the field is not set)"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("git_dir")
    p.add_argument("--commit", default="HEAD")
    args = p.parse_args(argv)
    commit = git(args.git_dir, "rev-parse", args.commit).strip()
    files = [f for f in git(args.git_dir, "ls-tree", "--name-only", commit, "api/").split()
             if f.endswith(".go") and not f.endswith("_test.go")]
    sources = {f: git(args.git_dir, "show", f"{commit}:{f}") for f in files}
    extra_src = git(args.git_dir, "show", f"{commit}:jobspec2/types.config.go")
    conv = git(args.git_dir, "show", f"{commit}:jobspec2/hcl_conversions.go")
    schema = structs(sources)
    jobcfg = structs({"jobspec2/types.config.go": extra_src})
    constants = dict(_CONST.findall(sources["api/constraint.go"]))
    schema["Job"]["fields"].update({k: v for k, v in jobcfg["jobConfig"]["fields"].items()
                                    if k in ("vault", "secret", "task")})
    schema["Job"]["labels"] = jobcfg["jobConfig"]["labels"] or ["id"]
    schema["TaskGroup"]["fields"].update({"vault": {"kind": "block", "type": "Vault"},
                                          "secret": {"kind": "block", "type": "Secret"}})
    schema["Constraint"]["fields"] = {n: {"kind": "attr"} for n in
                                      spec_names(conv, "constraintSpec", constants)}
    schema["Affinity"]["fields"] = {n: {"kind": "attr"} for n in
                                    spec_names(conv, "affinitySpec", constants)}
    drivers = {}
    for name, path in (("raw_exec", "drivers/rawexec/driver.go"),
                       ("exec", "drivers/exec/driver.go"),
                       ("docker", "drivers/docker/config.go")):
        drivers[name] = {"file": path, **driver_spec(git(args.git_dir, "show", f"{commit}:{path}"))}
    doc = {"source": "github.com/hashicorp/nomad", "commit": commit,
           "derived_by": "tests/cluster/derive_nomad_schema.py",
           "root": "Job",
           "attribute_or_block": {"TaskGroup": ["meta"], "Task": ["env", "meta"]},
           "labelled_blocks": {"Task.scaling": ["name"]},
           "structs": schema, "drivers": drivers}
    json.dump(doc, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
