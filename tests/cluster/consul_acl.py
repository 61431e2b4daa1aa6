"""Consul's ACL rules for the stand-in (tests only).

Written from Consul's source and documentation ("ACL Rules", ``acl/policy.go``,
``acl/policy_authorizer.go``):

- a token's rules are HCL (parsed here with HashiCorp's HCL2 library, pygohcl):
  ``service "NAME" { policy = "read" }``, ``service_prefix "P" {...}``, and the same for
  ``key``, ``session``, ``node`` and ``agent``; ``policy`` is ``read``, ``write`` or ``deny``;
- the rule for a resource is the exact one if present, else the longest matching prefix
  (``policyAuthorizer``'s radix trees: ``exact`` then ``longest prefix``); write implies
  read; no matching rule falls back to the default policy, ``deny`` in a secured cluster;
- a refusal is 403 "Permission denied: token with AccessorID '...' lacks permission
  'key:write' on "rewarm/x"" (``acl/errors.go``, ``PermissionDeniedError``); list results
  (health, recursive KV) are filtered instead of refused (``agent/consul/acl.go``,
  ``filterCheckServiceNodes`` needs node:read and service:read for each entry).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pygohcl

KINDS = ("service", "key", "session", "node", "agent")


class AclRulesError(ValueError):
    """Rules Consul would refuse."""


@dataclass
class Rules:
    exact: dict[str, dict[str, str]] = field(default_factory=dict)    # kind -> name -> policy
    prefix: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Rules:
        try:
            body = pygohcl.loads(text) if text.strip() else {}
        except (pygohcl.HCLParseError, pygohcl.HCLInternalError) as exc:
            raise AclRulesError(f"Failed to parse ACL rules: {exc}") from exc
        out = cls()
        for block, items in body.items():
            kind, _, pre = block.partition("_")
            if kind not in KINDS or pre not in ("", "prefix"):
                raise AclRulesError(f"Failed to parse ACL rules: unknown rule {block!r}")
            table = out.prefix if pre else out.exact
            for name, rule in items.items():
                policy = rule.get("policy")
                if policy not in ("read", "write", "deny", "list"):
                    raise AclRulesError(f"Invalid {block} policy for {name!r}: {policy!r}")
                table.setdefault(kind, {})[name] = policy
        return out

    def allows(self, kind: str, name: str, write: bool) -> bool:
        policy = self.exact.get(kind, {}).get(name)
        if policy is None:
            matches = [p for p in self.prefix.get(kind, {}) if name.startswith(p)]
            if matches:
                policy = self.prefix[kind][max(matches, key=len)]
        if policy in (None, "deny"):
            return False
        return policy == "write" or not write


class ConsulAcl:
    """Tokens of one stand-in; ``management_token`` None means ACLs are off."""

    def __init__(self, management_token: str | None) -> None:
        self.management_token = management_token
        self.tokens: dict[str, Rules] = {}

    def add_token(self, secret: str, rules: str) -> None:
        self.tokens[secret] = Rules.parse(rules)

    def check(self, token: str | None, kind: str, name: str, write: bool) -> str | None:
        """None if allowed, else Consul's 403 text."""
        if self.management_token is None or token == self.management_token:
            return None
        rules = self.tokens.get(token or "")
        if rules is None:
            return "ACL not found"
        if rules.allows(kind, name, write):
            return None
        op = "write" if write else "read"
        return (f"Permission denied: token with AccessorID '{(token or '')[:8]}' lacks "
                f"permission '{kind}:{op}' on \"{name}\"")
