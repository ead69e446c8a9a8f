"""Stored flow keys judged by the classifier (policy/classify.py), for the impact of a draft (impact.py)
and for what suggestions leave out as admitted now (suggestions.py). Nothing here writes.

The inputs are a render's: the fleet's workloads and addresses now (selectors resolve to them, as in
the table) and the enabled policy in force now (draft.py `InForce`, loaded once by the caller), plus
any drafts the caller judges beside it. A key is judged as a table in `simulation` or `enforced`
judges a new connection, whatever the workload's mode now: a workload in `visibility` has no rules,
and the question is what its rules would do. A key's `direction` (inbound when it carries none) says
which: an outbound key is judged by the output chain (the workload's outbound rules, its destination's
inbound rules, the fail-safe list of the settings now).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fleet.rendering import outbound_failsafe
from flows.policy_drafts.draft import InForce
from policy.classify import Connection, classify
from policy.render_inputs import PROTOCOLS, WorkloadInput, parse_host_address
from policy.selectors import PolicyInputs


def flow_key_connection(row: dict) -> Connection | None:
    """A stored flow key (`peer`, `protocol`, `port`) as the first packet of a new connection; None
    for what no rule can admit (a protocol other than tcp, udp, icmp and icmpv6, a scoped address)."""
    protocol = row["protocol"]
    if protocol not in PROTOCOLS:
        return None
    try:
        peer = parse_host_address(row["peer"])
        # icmp keys carry no type (0): echo and the other queries that open a connection.
        port = row["port"] if protocol in ("tcp", "udp") else None
        direction = row.get("direction") or "inbound"
        return Connection(row["peer"], protocol, port, loopback=peer.is_loopback, direction=direction)
    except ValueError:
        return None


def _judged(workload: WorkloadInput) -> WorkloadInput:
    judged = workload if workload.mode != "visibility" else dataclasses.replace(workload, mode="simulation")
    if judged.outbound_mode == "visibility":
        judged = dataclasses.replace(judged, outbound_mode="simulation")
    return judged


@dataclasses.dataclass(frozen=True)
class Judged:
    """How one policy judges a key: `admitted` (by `rule`), or refused (by the deny rule `rule`, or by
    no rule: `rule` None)."""

    admitted: bool
    rule: int | None


class FlowKeyClassifier:
    """The fleet and the policy in force now (`in_force`) and `drafts` beside it: for a key, how each
    policy judges it (`judged`) and the rule of each that admits it (`rules`)."""

    def __init__(self, in_force: InForce, *, drafts: Sequence[PolicyInputs] = ()) -> None:
        self.fleet, self.workloads = in_force.fleet, in_force.workloads
        self.policies = (in_force.policy, *drafts)
        # A workload's labels decide which rulesets apply to it: workloads with the same labels judge
        # a connection alike, and a fleet has far fewer label sets than keys. A range's keys repeat
        # their workloads and services too: each is looked up or parsed once.
        self._outcomes: dict[tuple, tuple[Judged, ...]] = {}
        self._connections: dict[tuple, Connection | None] = {}
        self._by_id: dict = {}
        self._failsafe = outbound_failsafe()

    def workload(self, row: dict) -> WorkloadInput | None:
        workload_id = row["workload_id"]
        try:
            return self._by_id[workload_id]
        except KeyError:
            found = self._by_id[workload_id] = self.workloads.get(str(workload_id))
            return found

    def rules(self, row: dict) -> tuple[int | None, ...] | None:
        """The lifetime number of the rule of each policy (now first, then the drafts) that admits the
        key (`workload_id`, `peer`, `protocol`, `port`), None where none does (a deny rule refusing it
        included); None for a key that no table can judge (its workload gone, a connection no rule can
        admit)."""
        found = self.judged(row)
        return None if found is None else tuple(j.rule if j.admitted else None for j in found)

    def judged(self, row: dict) -> tuple[Judged, ...] | None:
        """How each policy (now first, then the drafts) judges the key; None as for `rules`."""
        workload = self.workload(row)
        if workload is None:
            return None
        service = (row["peer"], row["protocol"], row["port"], row.get("direction") or "inbound")
        if service in self._connections:
            connection = self._connections[service]
        else:
            connection = self._connections[service] = flow_key_connection(row)
        if connection is None:
            return None
        key = (workload.labels, service)
        found = self._outcomes.get(key)
        if found is None:
            judged = _judged(workload)
            outcomes = (
                classify(
                    judged, policy.rulesets, policy.groups, self.fleet, connection, failsafe=self._failsafe
                )
                for policy in self.policies
            )
            found = self._outcomes[key] = tuple(Judged(o.decision == "allowed", o.rule) for o in outcomes)
        return found

    def refused_by_now(self, row: dict) -> int | None:
        """The deny rule in force now that refuses the key, if one does."""
        found = self.judged(row)
        return found[0].rule if found is not None and not found[0].admitted else None

    def admitted_now(self, row: dict) -> bool:
        """Whether the policy in force now admits the key, as the workload's table would: by a rule,
        or (outbound) by the fail-safe list, which names none."""
        found = self.judged(row)
        return found is not None and found[0].admitted
