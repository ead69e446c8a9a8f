"""Suggested rules: a draft ruleset proposed from the stored flows that no rule admitted. A read: it
saves nothing; the operator saves the draft with the ordinary writes.

The evidence is the selected workloads' keys (workload, peer, peer workload, protocol, port) decided
`observed`, `would_block` or `blocked` in the range, summed in SQL as the rollup sums them
(flows/selectors.py). The stored port is the workload's own (local) port of an inbound connection
(agent/flowwindow.py), so a service is never a client's ephemeral port.

How the evidence becomes rules, never wider than what was seen:
- the scope of a ruleset is the protected workload's values for `label_keys` (one ruleset per scope);
- a peer that is a workload of the fleet becomes a selector of its values for `label_keys`; a peer
  outside the fleet becomes a member of an address group of exactly the addresses seen (or, when
  asked, of the CIDRs of a given prefix length that hold them, with the count of unseen addresses
  that admits);
- within a scope, the sources that were seen on exactly the same set of services share one rule: a
  rule admits every source on every service, so sources seen on different services get their own.
"""

from __future__ import annotations

import ipaddress
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from controlplane.clock import rfc3339
from controlplane.problems import ValidationFailed, pointer
from controlplane.validation import Findings, parsed_together, reject_unknown, require_object
from fleet.models import Workload
from flows.choices import Decision
from flows.policy_drafts.classifier import FlowKeyClassifier
from flows.policy_drafts.draft import in_force_load
from flows.representations import coverage_data, keys_read_data
from flows.selectors import coverage, flow_keys_summed, flow_range_plan, workloads_selected
from flows.validation import (
    BODY,
    DEFAULT_LABEL_KEYS,
    FlowSelection,
    flow_selection_parse,
    label_keys_parse,
)
from policy.grammar import Requirement, Selector
from policy.models import AddressGroup, Ruleset, Service
from policy.validation import MAX_NAME, MAX_RULES_PER_RULESET, MAX_SOURCES_PER_RULE

DESCRIPTION = "Suggested from observed traffic."
KEYS_LISTED = 1000
UNADMITTED = (Decision.OBSERVED, Decision.WOULD_BLOCK, Decision.BLOCKED)
KEY_COLUMNS = ["workload_id", "peer", "peer_workload_id", "protocol", "port"]


def _values_selector(labels: dict, label_keys: list[str]) -> tuple[str | None, list[str]]:
    """The selector of `labels`' values for `label_keys`, or None and the keys it lacks."""
    missing = [key for key in label_keys if key not in labels]
    if missing:
        return None, missing
    return str(Selector(tuple(Requirement(key, "=", (labels[key],)) for key in label_keys))), []


def _service_entry(protocol: str, port: int) -> dict:
    return {"protocol": protocol, "port": port} if protocol in ("tcp", "udp") else {"protocol": protocol}


def _aggregated(addresses: list[str], prefix: int | None, prefix_v6: int | None) -> tuple[list[str], int]:
    """The members for `addresses`: themselves, or the networks of the prefix lengths asked for that
    hold them; and how many addresses those networks admit beyond the ones seen."""
    members: set[str] = set()
    for text in addresses:
        address = ipaddress.ip_address(text)
        length = prefix if address.version == 4 else prefix_v6
        if length is None or length >= address.max_prefixlen:
            members.add(str(address))
        else:
            members.add(str(ipaddress.ip_network(f"{address}/{length}", strict=False)))
    admitted = sum(ipaddress.ip_network(m).num_addresses for m in members)
    ordered = sorted(members, key=lambda m: (ipaddress.ip_network(m).version, ipaddress.ip_network(m)))
    return ordered, admitted - len(set(addresses))


class _Names:
    """Names for the draft's objects that no stored object (nor an earlier one of the draft) has."""

    def __init__(self, model) -> None:
        self.taken = set(model.objects.values_list("name", flat=True))

    def take(self, wanted: str) -> str:
        base, n = wanted[: MAX_NAME - 4], 1
        name = base
        while name in self.taken:
            n += 1
            name = f"{base} {n}"
        self.taken.add(name)
        return name


def _span(rows: list[dict]) -> dict:
    return {
        "connection_count": sum(r["connection_count"] for r in rows),
        "first_seen": rfc3339(min(r["first_seen"] for r in rows)),
        "last_seen": rfc3339(max(r["last_seen"] for r in rows)),
    }


def _incomplete_intervals(covered: dict, start: datetime, end: datetime) -> list[dict]:
    """The intervals of the range the suggestion could not learn from, workload by workload."""
    intervals = [
        {"workload_id": str(g.workload_id), "start": rfc3339(max(g.start, start)),
         "end": rfc3339(min(g.end, end)), "reason": f"evidence gap ({g.kind})"}
        for g in covered["gaps"]
    ]  # fmt: skip
    intervals += [
        {"workload_id": str(w), "start": rfc3339(start), "end": rfc3339(end),
         "reason": "no flow window in the range"}
        for w in covered["workloads_without_reports"]
    ]  # fmt: skip
    for listed, reason in (
        ("silent_workloads", "agent silent"),
        ("pending_workloads", "flow evidence not delivered yet"),
    ):
        intervals += [
            {"workload_id": str(w["workload_id"]), "start": rfc3339(max(w["since"], start)),
             "end": rfc3339(end), "reason": reason}
            for w in covered[listed]
        ]  # fmt: skip
    if covered["begins_before_retention"]:
        intervals.append(
            {"workload_id": None, "start": rfc3339(start), "end": rfc3339(covered["retained_from"]),
             "reason": "before the retention: removed"}
        )  # fmt: skip
    return intervals


@dataclass
class _SortedOut:
    """The range's unadmitted keys sorted out: by scope, source and service those that generalise."""

    seen: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    scope_workloads: dict = field(default_factory=lambda: defaultdict(set))
    not_generalised: list = field(default_factory=list)
    admitted_now: list = field(default_factory=list)


class _Workload(NamedTuple):
    """What the suggestion reads of a workload of the evidence."""

    id: uuid.UUID
    hostname: str
    labels: dict


def _sorted_out(rows: list[dict], workloads: dict, label_keys: list[str]) -> _SortedOut:
    """Each key: admitted now by a rule in force, not generalised (and why), or seen[scope][source]
    [(protocol, port)], a source being ("selector", text) or ("address", peer).

    Admitted now is the impact's classifier on the policy in force now (classifier.py): a
    workload in `visibility` records as `observed` what its rules would admit, and a rule added since
    may admit what was refused; the key is judged as its workload's table in `simulation` or
    `enforced` would judge a new inbound connection, selectors resolved to the fleet's addresses now."""
    judge, out = FlowKeyClassifier(in_force_load()), _SortedOut()
    # The selector of label_keys (or the keys lacking) of each set of their values, worked out once: a
    # fleet has far fewer of those than workloads.
    named: dict[tuple, tuple[str | None, list[str]]] = {}

    def selector_of(workload: _Workload) -> tuple[str | None, list[str]]:
        values = tuple((key, workload.labels[key]) for key in label_keys if key in workload.labels)
        if values not in named:
            named[values] = _values_selector(workload.labels, label_keys)
        return named[values]

    for row in rows:
        workload, peer = workloads[row["workload_id"]], workloads.get(row["peer_workload_id"])
        if judge.admitted_now(row):
            out.admitted_now.append(_row_data(row))
            continue
        refused_by = judge.refused_by_now(row)
        if refused_by is not None:
            # An operator's no: listed as refused by that deny rule, never learnt as a missing allow.
            reason = f"refused by deny rule {refused_by}"
            out.not_generalised.append({**_row_data(row), "reason": reason, "rule_number": refused_by})
            continue
        scope, missing = selector_of(workload)
        reason, source = None, ("address", row["peer"])
        if scope is None:
            reason = f"the workload {workload.hostname} has no label {', '.join(missing)}"
        elif row["peer_workload_id"] is not None:
            selector, missing = selector_of(peer) if peer else _values_selector({}, label_keys)
            source = ("selector", selector)
            if peer is None:
                reason = "the peer workload no longer exists"
            elif selector is None:
                reason = f"the peer workload {peer.hostname} has no label {', '.join(missing)}"
        if reason is not None:
            out.not_generalised.append({**_row_data(row), "reason": reason})
            continue
        out.seen[scope][source][(row["protocol"], row["port"])].append(row)
        out.scope_workloads[scope].add(str(workload.id))
    return out


class _Proposal:
    """The draft's rulesets (one per scope, more past 500 rules), the address groups to create, and
    the evidence of each rule, built scope by scope."""

    def __init__(self, prefix: int | None, prefix_v6: int | None) -> None:
        self.prefix, self.prefix_v6 = prefix, prefix_v6
        self.rulesets: list[dict] = []
        self.groups: list[dict] = []
        self.group_evidence: dict[str, dict] = {}
        self.evidence: list[dict] = []
        self.ruleset_names, self.group_names = _Names(Ruleset), _Names(AddressGroup)
        self.named_groups = {tuple(g.members): g.name for g in AddressGroup.objects.all()}
        self.named_services = _single_entry_services()

    def add_scope(self, scope: str, seen: dict, workload_ids: list[str]) -> None:
        # Sources by the exact set of services they were seen on: a rule admits every source on every
        # service, so one rule per set is as small as the evidence allows and never wider.
        by_services: dict[tuple, list] = defaultdict(list)
        for source, services in seen.items():
            by_services[tuple(sorted(services))].append(source)
        rules, rules_evidence = [], []
        for services_key, sources in sorted(by_services.items(), key=lambda i: (i[0], sorted(i[1]))):
            rule_sources = [{"selector": value} for kind, value in sorted(sources) if kind == "selector"]
            addresses = sorted((value for kind, value in sources if kind == "address"), key=_address_order)
            group_name = self._group(scope, addresses) if addresses else ""
            if group_name:
                rule_sources.append({"address_group": group_name})
            rule_services = [self.named_services.get(k) or _service_entry(*k) for k in services_key]
            # A rule holds at most so many sources: more sources of the same services, more rules.
            for first in range(0, len(rule_sources), MAX_SOURCES_PER_RULE):
                part = rule_sources[first : first + MAX_SOURCES_PER_RULE]
                rules.append({"description": DESCRIPTION, "sources": part, "services": rule_services})
                held = [s for s in sources if _draft_source(s, group_name) in part]
                every = [row for s in held for k in services_key for row in seen[s][k]]
                rules_evidence.append(_rule_evidence(every, services_key))
        for first in range(0, len(rules), MAX_RULES_PER_RULESET):
            name = self.ruleset_names.take(f"suggested {scope}")
            last = first + MAX_RULES_PER_RULESET
            self.rulesets.append(
                {
                    "name": name,
                    "description": DESCRIPTION,
                    "enabled": True,
                    "scope": scope,
                    "rules": rules[first:last],
                }
            )
            self.evidence.append(
                {"ruleset": name, "workloads": workload_ids, "rules": rules_evidence[first:last]}
            )

    def _group(self, scope: str, addresses: list[str]) -> str:
        """The name of the address group for these outside peers: a stored or proposed group of exactly
        the members, else a new one proposed."""
        members, unseen = _aggregated(addresses, self.prefix, self.prefix_v6)
        name = self.named_groups.get(tuple(members))
        if name is None:
            name = self.group_names.take(f"suggested {scope} peers")
            self.named_groups[tuple(members)] = name
            self.groups.append(
                {
                    "name": name,
                    "description": f"Peers seen by {scope} in the suggested range.",
                    "members": members,
                }
            )
        self.group_evidence.setdefault(
            name, {"name": name, "addresses_seen": 0, "unseen_addresses_admitted": unseen}
        )["addresses_seen"] += len(addresses)
        return name


def _most(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: -r["connection_count"])[:KEYS_LISTED]


def _address_order(text: str) -> tuple:
    address = ipaddress.ip_address(text)
    return (address.version, address)


def policy_suggest(
    *,
    selected,
    start: datetime,
    end: datetime,
    label_keys: list[str] | None = None,
    aggregate_prefix: int | None = None,
    aggregate_prefix_v6: int | None = None,
) -> dict:
    """Rules proposed from the selected workloads' (`selected` as flows.selectors.workloads_selected
    gives it; None: the whole fleet) unadmitted connections in [start, end), with their evidence, the
    connections that could not be generalised, and the range's coverage. Saves nothing."""
    label_keys = label_keys_parse(list(label_keys) if label_keys is not None else list(DEFAULT_LABEL_KEYS))
    planned = flow_range_plan(selected=selected, start=start, end=end)
    covered = coverage(selected, start, end, lookback=planned.lookback)
    # The keys of most connections, up to a bound (the aggregate key left out in the query): past it
    # the answer says how many keys and connections it did not learn from.
    read = flow_keys_summed(planned, KEY_COLUMNS, decision__in=list(UNADMITTED))
    rows = read.rows
    ids = {r["workload_id"] for r in rows} | {r["peer_workload_id"] for r in rows if r["peer_workload_id"]}
    workloads = {
        row[0]: _Workload(*row)
        for row in Workload.objects.filter(id__in=ids).values_list("id", "hostname", "labels")
    }

    sorted_out = _sorted_out(rows, workloads, label_keys)
    proposal = _Proposal(aggregate_prefix, aggregate_prefix_v6)
    for scope in sorted(sorted_out.seen):
        proposal.add_scope(scope, sorted_out.seen[scope], sorted(sorted_out.scope_workloads[scope]))
    intervals = _incomplete_intervals(covered, start, end)
    return {
        "from": rfc3339(start),
        "to": rfc3339(end),
        "label_keys": label_keys,
        "complete": covered["complete"],
        "warning": None
        if covered["complete"]
        else (
            "The range is incomplete: the suggestion did not learn from the intervals listed in "
            "incomplete_intervals, and traffic seen only then is missing from it."
        ),
        # The draft: one ruleset body as POST /rulesets takes it when the evidence has one scope (the
        # usual selection: the workloads of one group); `rulesets` has every scope's.
        "draft": proposal.rulesets[0] if len(proposal.rulesets) == 1 else None,
        "rulesets": proposal.rulesets,
        "address_groups": proposal.groups,
        "services": [],
        "address_group_evidence": list(proposal.group_evidence.values()),
        "evidence": proposal.evidence,
        # Listed up to a bound, most connections first, and counted exactly: a fleet's day may hold
        # many thousands of keys that rules admit already.
        "not_generalised_count": len(sorted_out.not_generalised),
        "not_generalised": _most(sorted_out.not_generalised),
        "admitted_now_count": len(sorted_out.admitted_now),
        "admitted_now": _most(sorted_out.admitted_now),
        "coverage": coverage_data(covered),
        "incomplete_intervals": intervals,
        # The keys read stopped at their bound: the proposal lacks the keys of fewest connections.
        "truncated": read.truncated,
        **keys_read_data(read),
    }


REQUEST_FIELDS = ("label", "workload", "from", "to", "label_keys", "aggregate_prefix", "aggregate_prefix_v6")


def _prefix(data, name: str, longest: int, findings: Findings) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= longest:
        findings.add(pointer(name), "out-of-range", f"{name} is a prefix length from 0 to {longest}.")
        return None
    return value


def policy_suggest_request(*, data: Any) -> dict:
    """POST /policies/suggestions (and `manage.py policy suggest`): the body parsed, every finding at
    once, then `policy_suggest`. The body: `label` (selectors, ANDed) and `workload` (ids) select the
    workloads to protect (neither: the whole fleet), `from` and `to` the range (as the rollup's),
    `label_keys`, and optionally `aggregate_prefix` (IPv4) and `aggregate_prefix_v6`."""
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, REQUEST_FIELDS, findings)
    prefix = _prefix(data, "aggregate_prefix", 32, findings)
    prefix_v6 = _prefix(data, "aggregate_prefix_v6", 128, findings)
    parsed = [None, None]
    try:
        parsed = parsed_together(
            lambda: flow_selection_parse(
                start=data.get("from"),
                end=data.get("to"),
                labels=data.get("label", []),
                workloads=data.get("workload", []),
                at=BODY,
            ),
            lambda: label_keys_parse(data.get("label_keys", list(DEFAULT_LABEL_KEYS))),
        )
    except ValidationFailed as failed:
        findings.extend(failed.findings)
    findings.raise_if_any()
    selection, label_keys = parsed
    assert isinstance(selection, FlowSelection)  # noqa: S101  # else the findings were raised
    return policy_suggest(
        selected=workloads_selected(workload_ids=selection.workload_ids, labels=selection.labels),
        start=selection.start,
        end=selection.end,
        label_keys=label_keys,
        aggregate_prefix=prefix,
        aggregate_prefix_v6=prefix_v6,
    )


def _single_entry_services() -> dict[tuple, dict]:
    """Stored services of exactly one single-port entry, by (protocol, port): what a suggested service
    reuses by name (the first by name when several match)."""
    found: dict[tuple, dict] = {}
    for service in Service.objects.prefetch_related("entries").order_by("name"):
        entries = list(service.entries.all())
        if len(entries) == 1 and entries[0].port_to is None:
            key = (entries[0].protocol, entries[0].port or 0)
            found.setdefault(key, {"service": service.name})
    return found


def _row_data(row: dict) -> dict:
    return {
        "workload_id": str(row["workload_id"]),
        "peer": row["peer"],
        "peer_workload_id": str(row["peer_workload_id"]) if row["peer_workload_id"] else None,
        "service": {"protocol": row["protocol"], "port": row["port"]},
        "connection_count": row["connection_count"],
        "first_seen": rfc3339(row["first_seen"]),
        "last_seen": rfc3339(row["last_seen"]),
    }


def _draft_source(source: tuple, group_name: str) -> dict:
    """The draft's source that holds this source of the evidence (an address: the rule's group)."""
    kind, value = source
    return {"selector": value} if kind == "selector" else {"address_group": group_name}


def _rule_evidence(rows: list[dict], services_key: tuple) -> dict:
    by_peer: dict[tuple, list] = defaultdict(list)
    by_service: dict[tuple, list] = defaultdict(list)
    for row in rows:
        by_peer[(row["peer"], row["peer_workload_id"])].append(row)
        by_service[(row["protocol"], row["port"])].append(row)
    return {
        **_span(rows),
        "peers": [
            {"peer": peer, "peer_workload_id": str(pw) if pw else None, **_span(by_peer[(peer, pw)])}
            for peer, pw in sorted(by_peer, key=lambda k: k[0])
        ],
        "services": [{"protocol": p, "port": n, **_span(by_service[(p, n)])} for p, n in services_key],
        "workload_ids": sorted({str(r["workload_id"]) for r in rows}),
    }
