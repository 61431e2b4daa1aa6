"""The Nomad stand-in's scheduler: which node an allocation goes to (tests only).

Written from Nomad's documentation:

- "constraint block" (docs/job-specification/constraint): ``attribute`` interpolated from
  ``${node.unique.id}``, ``${node.unique.name}``, ``${node.class}``, ``${node.datacenter}``,
  ``${attr.<name>}``, ``${meta.<name>}``; operators ``=``/``==``/``is``, ``!=``/``not``,
  ``regexp``, ``set_contains`` (every comma-separated value of ``value`` is in the
  attribute's list), ``set_contains_any``, ``is_set``, ``is_not_set``, ``distinct_hosts``
  (no two allocations of the group on one node); a missing attribute fails every
  operator but ``is_not_set`` and ``!=``;
- "affinity block": the same operators; a matching affinity adds its ``weight``; Nomad
  normalises a node's affinity score by the sum of the absolute weights (so it lies in
  [-1, 1]) and adds it to the node's score;
- "device block" (docs/job-specification/device): ``nvidia/gpu`` asks for that many
  instances of a device of type ``gpu`` from vendor ``nvidia``; a node without enough free
  instances is infeasible;
- "Scheduling: placement" (docs/concepts/scheduling/placement): feasibility first, then
  ranking; a rescheduled allocation's previous nodes get a penalty (the scheduler's "node
  reschedule penalty"), so a failed allocation moves to another node when one is feasible.

Ranking ties go to the node with fewer allocations of the job (spread), then by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_INTERP = re.compile(r"\$\{([^}]+)\}")
RESCHEDULE_PENALTY = 2.0
"""Larger than any normalised affinity score (at most 1): a rescheduled allocation goes back
to a node it failed on only when no other node is feasible ("reschedule block": the
replacement is placed away from the failed allocation's node where possible)."""


@dataclass
class Node:
    """A registered client node. ``devices``: device name (``nvidia/gpu``) -> instance ids."""

    id: str
    name: str
    address: str
    node_class: str = ""
    datacenter: str = "dc1"
    netns: str | None = None
    attributes: dict[str, str] = field(default_factory=dict)
    meta: dict[str, str] = field(default_factory=dict)            # static (client config)
    dynamic_meta: dict[str, str | None] = field(default_factory=dict)   # /v1/client/metadata
    devices: dict[str, list[str]] = field(default_factory=dict)
    max_kill_timeout_s: float = 30.0      # the client's max_kill_timeout (its default)

    def merged_meta(self) -> dict[str, str]:
        out = dict(self.meta)
        for k, v in self.dynamic_meta.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
        return out

    def lookup(self, target: str) -> str | None:
        """The value of one interpolation target (``node.class``, ``attr.x``, ``meta.x``)."""
        if target == "node.unique.id":
            return self.id
        if target == "node.unique.name":
            return self.name
        if target == "node.class":
            return self.node_class
        if target == "node.datacenter":
            return self.datacenter
        if target.startswith("attr."):
            return self.attributes.get(target[5:])
        if target.startswith("meta."):
            return self.merged_meta().get(target[5:])
        return None


def interpolate(text: str, node: Node) -> str | None:
    """``text`` with node targets replaced; None when one of them is not set."""
    missing = False

    def one(m: re.Match) -> str:
        nonlocal missing
        value = node.lookup(m.group(1))
        if value is None:
            missing = True
            return ""
        return value
    out = _INTERP.sub(one, text)
    return None if missing else out


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def matches(operand: str, left: str | None, right: str) -> bool:
    """One constraint or affinity test."""
    if operand == "is_set":
        return left is not None
    if operand == "is_not_set":
        return left is None
    if operand in ("!=", "not"):
        return left != right
    if left is None:
        return False
    if operand in ("=", "==", "is"):
        return left == right
    if operand == "regexp":
        return re.search(right, left) is not None
    if operand == "set_contains":
        return set(_split(right)) <= set(_split(left))
    if operand == "set_contains_any":
        return bool(set(_split(right)) & set(_split(left)))
    raise ValueError(f"unsupported operand {operand!r}")


def feasible(node: Node, constraints: list[dict], *, group_nodes: set[str],
             device_need: dict[str, int], devices_used: dict[str, set[str]]) -> bool:
    """Whether ``node`` can take one more allocation of the group."""
    for c in constraints:
        if c["Operand"] == "distinct_hosts":
            if str(c.get("RTarget", "true")).lower() != "false" and node.id in group_nodes:
                return False
            continue
        if not matches(c["Operand"], interpolate(c["LTarget"], node), c["RTarget"]):
            return False
    for name, count in device_need.items():
        free = [d for d in node.devices.get(name, []) if d not in devices_used.get(node.id, set())]
        if len(free) < count:
            return False
    return True


def affinity_score(node: Node, affinities: list[dict]) -> float:
    total = sum(abs(a.get("Weight", 50)) for a in affinities)
    if not total:
        return 0.0
    got = sum(a.get("Weight", 50) for a in affinities
              if matches(a["Operand"], interpolate(a["LTarget"], node), a["RTarget"]))
    return got / total


def choose(nodes: list[Node], *, constraints: list[dict], affinities: list[dict],
           group_nodes: set[str], device_need: dict[str, int],
           devices_used: dict[str, set[str]], job_allocs: dict[str, int],
           penalty_nodes: set[str], drivers: set[str] = frozenset()) -> Node | None:
    """The best feasible node, or None (the allocation stays pending).  ``drivers``: the task
    drivers the group needs; a node qualifies only when it fingerprints each as
    ``driver.<name>`` (``scheduler/feasible``: DriverChecker; raw_exec fingerprints only when
    the client enables it)."""
    ranked = []
    for node in nodes:
        if any(node.attributes.get(f"driver.{d}") not in ("1", "true") for d in drivers):
            continue
        if not feasible(node, constraints, group_nodes=group_nodes, device_need=device_need,
                        devices_used=devices_used):
            continue
        score = affinity_score(node, affinities)
        if node.id in penalty_nodes:
            score -= RESCHEDULE_PENALTY
        ranked.append((-score, job_allocs.get(node.id, 0), node.name, node))
    if not ranked:
        return None
    ranked.sort(key=lambda r: r[:3])
    return ranked[0][3]
