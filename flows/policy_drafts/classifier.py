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
from policy.classify import Connection, PeerClasses, classify
from policy.render_inputs import PROTOCOLS, WorkloadInput, parse_host_address
from policy.renderer import compile_policy
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


def _judgement(outcome) -> Judged:
    return Judged(outcome.decision == "allowed", outcome.rule)


class FlowKeyClassifier:
    """The fleet and the policy in force now (`in_force`) and `drafts` beside it: for a key, how each
    policy judges it (`judged`) and the rule of each that admits it (`rules`)."""

    def __init__(self, in_force: InForce, *, drafts: Sequence[PolicyInputs] = ()) -> None:
        self.fleet, self.workloads = in_force.fleet, in_force.workloads
        self.policies = (in_force.policy, *drafts)
        # A key is judged once per class of alike keys: workloads with the same labels (and, judged
        # outbound, addresses) have the same rules applied, and peers held by the same sets
        # (policy/classify.py `PeerClasses`) match the same lines. A fleet's range has far fewer
        # classes than keys: most of its peers are held by no set, or by those of one group or tier.
        self._outcomes: dict[tuple, tuple[Judged, ...] | None] = {}
        self._classes: dict[str, PeerClasses] = {}
        # Each class as a small number, so that a key's lookup hashes numbers, not labels and sets.
        self._numbers: dict[tuple, int] = {}
        self._peer_classes: dict[tuple[str, str], int | None] = {}
        # workload id -> (workload, the number of its inbound class, of its outbound class)
        self._by_id: dict = {}
        self._failsafe = outbound_failsafe()

    def _number(self, found: tuple) -> int:
        return self._numbers.setdefault(found, len(self._numbers))

    def _of(self, workload_id) -> tuple:
        try:
            return self._by_id[workload_id]
        except KeyError:
            pass
        workload = self.workloads.get(str(workload_id))
        found: tuple = (None, None, None)
        if workload is not None:
            # Inbound, the rules applied follow the labels; outbound, the destinations' rules that
            # name the workload follow its addresses too. Its mode is not read: `_judged` sets one.
            inbound = self._number(("workload", workload.labels))
            found = (workload, inbound, self._number(("workload", workload.labels, workload.addresses)))
        self._by_id[workload_id] = found
        return found

    def workload(self, row: dict) -> WorkloadInput | None:
        return self._of(row["workload_id"])[0]

    def rules(self, row: dict) -> tuple[int | None, ...] | None:
        """The lifetime number of the rule of each policy (now first, then the drafts) that admits the
        key (`workload_id`, `peer`, `protocol`, `port`), None where none does (a deny rule refusing it
        included); None for a key that no table can judge (its workload gone, a connection no rule can
        admit)."""
        found = self.judged(row)
        return None if found is None else tuple(j.rule if j.admitted else None for j in found)

    def _peer_class(self, peer: str, direction: str) -> int | None:
        key = (peer, direction)
        try:
            return self._peer_classes[key]
        except KeyError:
            pass
        classes = self._classes.get(direction)
        if classes is None:
            # Built for a direction when a key of it comes: inbound tests rules' sources only.
            classes = self._classes[direction] = PeerClasses(
                (compile_policy(p.rulesets, p.groups, self.fleet, self._failsafe) for p in self.policies),
                direction,
            )
        of = classes.of(peer)
        found = self._peer_classes[key] = None if of is None else self._number(("peer", direction, of))
        return found

    def judged(self, row: dict) -> tuple[Judged, ...] | None:
        """How each policy (now first, then the drafts) judges the key; None as for `rules`."""
        workload, inbound, outbound = self._of(row["workload_id"])
        if workload is None:
            return None
        direction = row.get("direction") or "inbound"
        peer_class = self._peer_class(row["peer"], direction)
        if peer_class is None:
            return None
        key = (
            inbound if direction == "inbound" else outbound,
            peer_class,
            row["protocol"],
            row["port"],
            direction,
        )
        try:
            return self._outcomes[key]
        except KeyError:
            pass
        # The key's own connection stands for its class.
        connection = flow_key_connection(row)
        found = None
        if connection is not None:
            judged = _judged(workload)
            found = tuple(
                _judgement(
                    classify(
                        judged,
                        policy.rulesets,
                        policy.groups,
                        self.fleet,
                        connection,
                        failsafe=self._failsafe,
                    )
                )
                for policy in self.policies
            )
        self._outcomes[key] = found
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
