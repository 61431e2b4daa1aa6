"""Nomad's ACL for the stand-in: policies, workload identities, one capability per endpoint.

Written from Nomad's source at the commit in ``nomad_schema.json``:

- ``acl/policy.go``: a policy's rules are HCL: ``namespace "NAME" { policy = "read|write|
  scale|deny"  capabilities = [...] }`` and ``node { policy = "read|write" }``;
  ``expandNamespacePolicy`` turns a policy word into capabilities (``read``: list-jobs,
  parse-job, read-job, read-job-scaling, ...; ``write``: read plus scale-job, submit-job,
  dispatch-job, ...; ``scale``: read-job, read-job-scaling, scale-job, ...); ``deny`` wins.
  The rules are parsed with HashiCorp's HCL2 library (pygohcl), as the server parses them.
- ``nomad/acl.go`` and ``nomad/structs/acl.go``: a workload identity carries only the
  policies an operator attached to its job (``nomad acl policy apply -job J [-group G]
  [-task T]``, the policy's ``JobACL``); without one it may do nothing beyond its implicit
  rights (its own job's variables, enforced by the template renderer); the management token
  may do everything; any other token is "Permission denied" (403,
  ``command/agent/http.go`` ``errCodeFromHandler``).
- The capability each endpoint checks: ``Job.Register`` submit-job; ``JobsParseRequest``
  parse-job or submit-job; ``Job.Scale`` scale-job or submit-job; ``Job.ScaleStatus``
  read-job or read-job-scaling; ``Job.GetJob``, ``Job.Allocations``, ``Alloc.GetAlloc`` read-job;
  ``Job.Deregister`` submit-job; ``Node.List``/``Node.GetNode`` node read;
  ``NodeMeta.Apply`` node write, ``NodeMeta.Read`` node read (``nomad/node_meta_endpoint.go``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pygohcl

_READ = ["list-jobs", "parse-job", "read-job", "csi-list-volume", "csi-read-volume",
         "read-job-scaling", "list-scaling-policies", "read-scaling-policy", "host-volume-read"]
_WRITE = _READ + ["scale-job", "submit-job", "dispatch-job", "read-logs", "read-fs",
                  "alloc-exec", "alloc-lifecycle", "csi-mount-volume", "csi-write-volume",
                  "submit-recommendation", "host-volume-create"]
_SCALE = ["list-scaling-policies", "read-scaling-policy", "read-job-scaling", "scale-job",
          "read-job", "submit-recommendation"]
EXPAND = {"read": _READ, "write": _WRITE, "scale": _SCALE, "deny": ["deny"]}


class PolicyError(ValueError):
    """A policy whose rules Nomad would refuse (400 on ``PUT /v1/acl/policy/:name``)."""


@dataclass
class Policy:
    name: str
    namespaces: dict[str, set[str]] = field(default_factory=dict)   # namespace -> capabilities
    node: str = ""                                                   # "", read, write, deny
    job_acl: dict | None = None                                      # {Namespace, JobID, ...}

    @classmethod
    def parse(cls, name: str, rules: str, job_acl: dict | None = None) -> Policy:
        try:
            body = pygohcl.loads(rules) if rules.strip() else {}
        except (pygohcl.HCLParseError, pygohcl.HCLInternalError) as exc:
            raise PolicyError(f"Failed to parse ACL Policy: {exc}") from exc
        unknown = set(body) - {"namespace", "node", "agent", "operator", "quota", "plugin",
                               "host_volume", "node_pool"}
        if unknown:
            raise PolicyError(f"Failed to parse ACL Policy: unknown rules {sorted(unknown)}")
        out = cls(name, job_acl=job_acl)
        for ns, rule in (body.get("namespace") or {}).items():
            caps = set(EXPAND.get(rule.get("policy", ""), []))
            for cap in rule.get("capabilities") or []:
                caps.add(cap)
            out.namespaces[ns] = caps
        node = body.get("node") or {}
        out.node = node.get("policy", "") if isinstance(node, dict) else ""
        return out

    def applies_to(self, alloc: dict, task: str) -> bool:
        """``JobACL`` matching (``nomad/state/state_store_acl.go``, ACLPolicyByJob): the job,
        and the group and task when the policy names them."""
        acl = self.job_acl or {}
        if not acl.get("JobID"):
            return False
        return (acl.get("Namespace", "default") == alloc["Namespace"]
                and acl["JobID"] == alloc["JobID"]
                and acl.get("Group", "") in ("", alloc["TaskGroup"])
                and acl.get("Task", "") in ("", task))


@dataclass
class Grant:
    """What one request's token may do."""
    management: bool = False
    policies: list[Policy] = field(default_factory=list)

    def ns_allows(self, namespace: str, *capabilities: str) -> bool:
        """Any of ``capabilities`` in ``namespace``; a deny capability wins."""
        if self.management:
            return True
        held: set[str] = set()
        for p in self.policies:
            caps = p.namespaces.get(namespace) or p.namespaces.get("*") or set()
            held |= caps
        if "deny" in held:
            return False
        return any(c in held for c in capabilities)

    def node_allows(self, write: bool) -> bool:
        if self.management:
            return True
        levels = {p.node for p in self.policies}
        if "deny" in levels:
            return False
        return "write" in levels or (not write and "read" in levels)


class NomadAcl:
    """Tokens and policies of one stand-in. ``management_token`` None: ACLs are off."""

    def __init__(self, management_token: str | None) -> None:
        self.management_token = management_token
        self.policies: dict[str, Policy] = {}
        self.identities: dict[str, tuple[str, str]] = {}    # token -> (alloc id, task)

    @property
    def enabled(self) -> bool:
        return self.management_token is not None

    def apply(self, name: str, rules: str, job_acl: dict | None = None) -> Policy:
        policy = Policy.parse(name, rules, job_acl)
        self.policies[name] = policy
        return policy

    def grant(self, token: str | None, allocs: dict[str, dict]) -> Grant | None:
        """The grant for ``token``; None when the token is unknown (403)."""
        if not self.enabled or token == self.management_token:
            return Grant(management=True)
        who = self.identities.get(token or "")
        if who is None:
            return None
        alloc = allocs.get(who[0])
        if alloc is None:
            return None
        return Grant(policies=[p for p in self.policies.values() if p.applies_to(alloc, who[1])])
