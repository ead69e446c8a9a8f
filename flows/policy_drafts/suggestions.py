"""Suggested rules: a draft policy proposed from the stored flows that the policy in force now would
not admit. A read: it saves nothing; the operator saves the draft with `POST /policies/drafts`
(draft_save.py), all or nothing.

The evidence is the selected workloads' keys (workload, peer, peer workload, protocol, port) of the
range, summed in SQL as the rollup sums them (flows/selectors.py), whatever decision was recorded:
a key is learnt from when no rule in force now admits it (classifier.py), so a key `allowed` by a
rule disabled since is learnt from, and one `observed` that a rule saved since admits is not. The
stored port is the workload's own (local) port of an inbound connection (agent/flowwindow.py).

How the evidence becomes rules, never wider than what was asked and saying how wide:
- keys that look like noise (suggest_noise.py) are set apart with the reason, unless asked for;
- the scope of a ruleset is the protected workload's values for `label_keys`, narrowed to stay inside
  the selection (its own label requirements, then labels the scope's workloads share); a scope that
  cannot be narrowed enough is refused, its keys listed as not generalised with the reason;
- a peer that is a workload of the fleet becomes a selector of its values for `label_keys`; a peer
  outside the fleet becomes a member of the rule's own address group of exactly the addresses seen
  (or, when asked, of the CIDRs of a given prefix length that hold them);
- within a scope, the sources seen on exactly the same set of services share one rule, its services
  as port entries (runs of ports as ranges: suggest_shape.py), cut at every limit of a ruleset write;
- each rule states its breadth: the combinations it admits against those seen.

Outbound (`direction: outbound`): the evidence is the selected workloads' outgoing connections, whose
stored peer is the destination and port the destination's (never the local ephemeral one). The same
steps propose outbound rulesets: the scope is the selected (originating) workload's values, a
destination of the fleet becomes a selector and one outside it a member of the rule's own address
group of exactly those seen, under `destinations`. A key is learnt from when the output chain would
refuse it now: neither the source's outbound rules, nor the destination's inbound rules (one rule,
both ends), nor the fail-safe list admit it. Noise for outbound is in suggest_noise.py.
"""

from __future__ import annotations

import ipaddress
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple

from controlplane.clock import rfc3339
from controlplane.collection_pause import without_collection
from controlplane.problems import ValidationFailed, pointer
from controlplane.validation import Findings, parsed_together, reject_unknown, require_object
from fleet.models import Workload
from flows.choices import Direction
from flows.policy_drafts import suggest_noise as noise
from flows.policy_drafts.classifier import FlowKeyClassifier, Judged
from flows.policy_drafts.draft import InForce, in_force_load
from flows.policy_drafts.suggest_proposal import Proposal, parsed_address
from flows.policy_drafts.suggest_scope import ScopeNarrowing
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

KEYS_LISTED = 1000
KEY_COLUMNS = ["workload_id", "peer", "peer_workload_id", "protocol", "port"]
MAX_EXCLUDED_PEERS = 1000


def _values_selector(labels, label_keys: list[str]) -> tuple[str | None, list[str]]:
    """The selector of `labels`' values for `label_keys`, or None and the keys it lacks."""
    missing = [key for key in label_keys if key not in labels]
    if missing:
        return None, missing
    return str(Selector(tuple(Requirement(key, "=", (labels[key],)) for key in label_keys))), []


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


class _Workload(NamedTuple):
    """What the suggestion reads of a workload of the evidence."""

    id: uuid.UUID
    hostname: str
    labels: dict


@dataclass
class _SortedOut:
    """The range's keys sorted out: admitted now, set apart as noise, not generalised (and why), and
    by base scope, source and service those that generalise."""

    seen: dict = field(default_factory=lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list))))
    scope_workloads: dict = field(default_factory=lambda: defaultdict(set))
    # (row, what the entry adds to it): made entries only when listed (`_most`), as a fleet's range
    # may hold many thousands of each.
    not_generalised: list[tuple[dict, dict]] = field(default_factory=list)
    admitted_now: list[tuple[dict, dict]] = field(default_factory=list)
    set_apart: list[tuple[dict, dict]] = field(default_factory=list)


@dataclass(frozen=True)
class _Asked:
    """What the request asks beyond the range: the label keys, the selection (to stay inside it), the
    noise to include anyway and the peers to exclude, the prefixes to aggregate outside peers to."""

    label_keys: list[str]
    selected_ids: frozenset[str] | None  # None: the whole fleet
    selection_labels: tuple[Selector, ...] = ()
    include_noise: frozenset[str] = frozenset()
    exclude_peers: tuple[str, ...] = ()
    prefix: int | None = None
    prefix_v6: int | None = None


def _learnt_from(now: Judged | None) -> bool:
    """Whether the suggestion learns from a key the policy in force now judges so (None: no table can
    judge it): the policy in force now does not admit it (by a rule, or outbound by the fail-safe list,
    which names none), whatever decision was recorded (a rule disabled since admitted it; a rule saved
    since admits what was refused). As `FlowKeyClassifier.admitted_now`."""
    return now is None or not now.admitted


def _sorted_out(
    rows: list[dict], workloads: dict, asked: _Asked, in_force: InForce, direction: str = Direction.INBOUND
) -> _SortedOut:
    """Each key: admitted now, set apart as noise, not generalised (and why), or
    seen[scope][source][(protocol, port)], a source being ("selector", text) or ("address", peer).

    Admitted now is the impact's classifier on the policy in force now (classifier.py): the key is
    judged as its workload's table in `simulation` or `enforced` would judge a new inbound connection,
    selectors resolved to the fleet's addresses now."""
    judge, out = FlowKeyClassifier(in_force), _SortedOut()
    label_keys = asked.label_keys
    # The selector of label_keys (or the keys lacking) of each set of their values, worked out once: a
    # fleet has far fewer of those than workloads.
    named: dict[tuple, tuple[str | None, list[str]]] = {}

    def selector_of(workload: _Workload) -> tuple[str | None, list[str]]:
        values = tuple((key, workload.labels[key]) for key in label_keys if key in workload.labels)
        found = named.get(values)
        if found is None:
            found = named[values] = _values_selector(workload.labels, label_keys)
        return found

    # What is read of each workload of the range, looked up once (a range repeats them, and a key's
    # look-ups by id were a fifth of the sorting): [workload or None, its selector, the label keys it
    # lacks, whether a key of it was learnt into a scope].
    facts: dict = {}

    def facts_of(workload_id) -> list:
        workload = workloads.get(workload_id)
        selector, missing = selector_of(workload) if workload is not None else (None, [])
        found = facts[workload_id] = [workload, selector, missing, False]
        return found

    learnt = []  # (row, the deny rule in force now that refuses it, if one does)
    for row in rows:
        found = judge.judged(row)
        now = None if found is None else found[0]
        if _learnt_from(now):
            learnt.append((row, now.rule if now is not None and not now.admitted else None))
        else:
            out.admitted_now.append((row, {}))
    # Noise is judged on every key of the range, admitted or not: what a peer did is the same
    # whatever rules were saved since, so a scanner stays a scanner once some of its ports are admitted.
    noisy = noise.NoiseJudge(
        rows,
        lookalikes=noise.lookalike_values((w.labels for w in in_force.workloads.values()), label_keys),
        excluded=noise.excluded_networks(asked.exclude_peers),
        label_keys=label_keys,
        direction=direction,
    )
    for row, refused_by in learnt:
        of_workload = facts.get(row["workload_id"]) or facts_of(row["workload_id"])
        workload = of_workload[0]
        if workload is None:
            out.not_generalised.append((row, {"reason": "the workload no longer exists"}))
            continue
        peer_id = row["peer_workload_id"]
        of_peer = None if peer_id is None else (facts.get(peer_id) or facts_of(peer_id))
        peer = None if of_peer is None else of_peer[0]
        if refused_by is not None:
            # An operator's no: listed as refused by that deny rule, never learnt as a missing allow.
            reason = f"refused by deny rule {refused_by}"
            out.not_generalised.append((row, {"reason": reason, "rule_number": refused_by}))
            continue
        found = noisy.judge(row, workload.labels, peer.labels if peer else None)
        if found is not None and (found[0] == noise.EXCLUDED_PEER or found[0] not in asked.include_noise):
            out.set_apart.append((row, {"kind": found[0], "reason": found[1]}))
            continue
        scope = of_workload[1]
        reason, source = None, ("address", row["peer"])
        if row["protocol"] in _ICMP_FAMILIES and _family_mismatch(row):
            towards = "to" if direction == Direction.OUTBOUND else "from"
            reason = f"{row['protocol']} {towards} {row['peer']}: no rule admits it (the other family's ICMP)"
        elif scope is None:
            reason = f"the workload {workload.hostname} has no label {', '.join(of_workload[2])}"
        elif of_peer is not None:
            selector, missing = (of_peer[1], of_peer[2]) if peer else _values_selector({}, label_keys)
            source = ("selector", selector)
            if peer is None:
                reason = "the peer workload no longer exists"
            elif selector is None:
                reason = f"the peer workload {peer.hostname} has no label {', '.join(missing)}"
        if reason is not None:
            out.not_generalised.append((row, {"reason": reason}))
            continue
        out.seen[scope][source][(row["protocol"], row["port"])].append(row)
        of_workload[3] = True
    # The scopes' workloads: those with a key learnt into their scope.
    for of_workload in facts.values():
        if of_workload[3]:
            out.scope_workloads[of_workload[1]].add(of_workload[0].id)
    return out


_ICMP_FAMILIES = {"icmp": 4, "icmpv6": 6}


def _family_mismatch(row: dict) -> bool:
    """icmp from an IPv6 peer or icmpv6 from an IPv4 one: a table's icmp lines are of one family."""
    wanted = _ICMP_FAMILIES.get(row["protocol"])
    if wanted is None:
        return False
    try:
        return parsed_address(row["peer"]).version != wanted
    except ValueError:
        return True


def _most(entries: list[tuple[dict, dict]]) -> list[dict]:
    listed = sorted(entries, key=lambda entry: -entry[0]["connection_count"])[:KEYS_LISTED]
    return [{**_row_data(row), **more} for row, more in listed]


def default_label_keys(selection_labels) -> list[str]:
    """`app`, and the keys the selection requires a value of: selecting `app=db,env=prod` learns
    sources by app and env, so that `app=api` of staging is not admitted into prod."""
    keys = list(DEFAULT_LABEL_KEYS)
    for selector in selection_labels:
        for requirement in selector.requirements:
            if requirement.op in ("=", "==", "in") and requirement.key not in keys:
                keys.append(requirement.key)
    return keys


@without_collection
def policy_suggest(
    *,
    selected,
    start: datetime,
    end: datetime,
    label_keys: list[str] | None = None,
    aggregate_prefix: int | None = None,
    aggregate_prefix_v6: int | None = None,
    selection_labels=(),
    include_noise=(),
    exclude_peers=(),
    direction: str = Direction.INBOUND,
) -> dict:
    """Rules proposed from the selected workloads' (`selected` as flows.selectors.workloads_selected
    gives it; None: the whole fleet) connections in [start, end) that no rule in force now admits,
    with their evidence, the keys set apart as noise, those that could not be generalised, and the
    range's coverage. Saves nothing. `selection_labels` are the selectors that chose `selected`;
    `direction` whose connections are learnt from: received (inbound rulesets) or opened (outbound)."""
    label_keys = label_keys_parse(
        list(label_keys) if label_keys is not None else default_label_keys(selection_labels)
    )
    selected_ids = (
        None
        if selected is None
        else frozenset(str(i) for i in Workload.objects.filter(id__in=selected).values_list("id", flat=True))
    )
    asked = _Asked(
        label_keys=label_keys,
        selected_ids=selected_ids,
        selection_labels=tuple(selection_labels),
        include_noise=frozenset(include_noise),
        exclude_peers=tuple(exclude_peers),
        prefix=aggregate_prefix,
        prefix_v6=aggregate_prefix_v6,
    )
    planned = flow_range_plan(selected=selected, start=start, end=end, direction=direction)
    covered = coverage(selected, start, end, lookback=planned.lookback)
    # Every decision: what is learnt from is what the policy in force now would refuse. The keys of
    # most connections, up to a bound (the aggregate key left out in the query): past it the answer
    # says how many keys and connections it did not learn from.
    read = flow_keys_summed(planned, KEY_COLUMNS)
    rows = read.rows
    if direction != Direction.INBOUND:
        # The classifier judges a key by its direction (inbound when it carries none).
        rows = [{**row, "direction": direction} for row in rows]
    ids = {r["workload_id"] for r in rows} | {r["peer_workload_id"] for r in rows if r["peer_workload_id"]}
    workloads = {
        row[0]: _Workload(*row)
        for row in Workload.objects.filter(id__in=ids).values_list("id", "hostname", "labels")
    }
    in_force = in_force_load()
    sorted_out = _sorted_out(rows, workloads, asked, in_force, direction)
    scopes = ScopeNarrowing(in_force.fleet, asked.selected_ids, asked.selection_labels, workloads)
    narrowed: dict[str, dict] = defaultdict(
        lambda: {"seen": defaultdict(lambda: defaultdict(list)), "ids": set()}
    )
    for base in sorted(sorted_out.seen):
        ids_of_scope = {str(i) for i in sorted_out.scope_workloads[base]}
        scope, refused = scopes.narrowed(base, ids_of_scope)
        if scope is None:
            sorted_out.not_generalised += [
                (row, {"reason": refused})
                for by_service in sorted_out.seen[base].values()
                for rows_of in by_service.values()
                for row in rows_of
            ]
            continue
        for source, by_service in sorted_out.seen[base].items():
            for service, rows_of in by_service.items():
                narrowed[scope]["seen"][source][service].extend(rows_of)
        narrowed[scope]["ids"] |= ids_of_scope
    proposal = Proposal(in_force.fleet, asked.prefix, asked.prefix_v6, direction=direction)
    for scope in sorted(narrowed):
        proposal.add_scope(scope, narrowed[scope]["seen"], sorted(narrowed[scope]["ids"]))
    intervals = _incomplete_intervals(covered, start, end)
    named_ids = {str(i): w.hostname for i, w in workloads.items()}
    unnamed = {i["workload_id"] for i in intervals if i["workload_id"] and i["workload_id"] not in named_ids}
    named_ids.update(
        (str(i), name) for i, name in Workload.objects.filter(id__in=unnamed).values_list("id", "hostname")
    )
    return {
        "from": rfc3339(start),
        "to": rfc3339(end),
        "direction": str(direction),
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
        "breadth_warnings": proposal.warnings,
        "scope_notes": scopes.notes,
        # Listed up to a bound, most connections first, and counted exactly: a fleet's day may hold
        # many thousands of keys that rules admit already.
        "not_generalised_count": len(sorted_out.not_generalised),
        "not_generalised": _most(sorted_out.not_generalised),
        "set_apart_count": len(sorted_out.set_apart),
        "set_apart_summary": _set_apart_summary(sorted_out.set_apart),
        "set_apart": _most(sorted_out.set_apart),
        "admitted_now_count": len(sorted_out.admitted_now),
        "admitted_now": _most(sorted_out.admitted_now),
        "hostnames": named_ids,
        "coverage": coverage_data(covered),
        "incomplete_intervals": intervals,
        # The keys read stopped at their bound: the proposal lacks the keys of fewest connections.
        "truncated": read.truncated,
        **keys_read_data(read),
    }


def _set_apart_summary(entries: list[tuple[dict, dict]]) -> list[dict]:
    by_kind: dict[str, list[tuple[dict, dict]]] = defaultdict(list)
    for entry in entries:
        by_kind[entry[1]["kind"]].append(entry)
    return [
        {
            "kind": kind,
            "count": len(items),
            "connection_count": sum(row["connection_count"] for row, _ in items),
            "peer_count": len({row["peer"] for row, _ in items}),
            "reasons": sorted({more["reason"] for _, more in items})[:20],
        }
        for kind, items in sorted(by_kind.items())
    ]


REQUEST_FIELDS = (
    "label",
    "workload",
    "from",
    "to",
    "label_keys",
    "aggregate_prefix",
    "aggregate_prefix_v6",
    "include_noise",
    "exclude_peers",
    "direction",
)
# Rules are of one direction: a suggestion proposes inbound rulesets or outbound ones, not both.
SUGGEST_DIRECTIONS = tuple(Direction.values)


def _prefix(data, name: str, longest: int, findings: Findings) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= longest:
        findings.add(pointer(name), "out-of-range", f"{name} is a prefix length from 0 to {longest}.")
        return None
    return value


def _include_noise(data, findings: Findings) -> list[str]:
    value = data.get("include_noise", [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        findings.add(pointer("include_noise"), "type", "include_noise must be a list of kinds of noise.")
        return []
    for index, kind in enumerate(value):
        if kind not in noise.KINDS:
            findings.add(
                pointer("include_noise", index), "unknown-kind",
                f"include_noise names one of {', '.join(noise.KINDS)}.",
            )  # fmt: skip
    return value


def _exclude_peers(data, findings: Findings) -> list[str]:
    value = data.get("exclude_peers", [])
    if not isinstance(value, list) or len(value) > MAX_EXCLUDED_PEERS:
        findings.add(
            pointer("exclude_peers"), "type",
            f"exclude_peers must be a list of at most {MAX_EXCLUDED_PEERS} addresses or CIDRs.",
        )  # fmt: skip
        return []
    peers = []
    for index, text in enumerate(value):
        try:
            peers.append(str(ipaddress.ip_network(text, strict=False)))
        except (TypeError, ValueError):
            findings.add(pointer("exclude_peers", index), "address", "An address or a CIDR is expected.")
    return peers


def _direction(data, findings: Findings) -> str:
    value = data.get("direction", Direction.INBOUND)
    if value not in SUGGEST_DIRECTIONS:
        findings.add(
            pointer("direction"), "direction",
            f"direction is one of {', '.join(SUGGEST_DIRECTIONS)}: the rulesets proposed are of one direction.",
        )  # fmt: skip
        return Direction.INBOUND
    return value


def policy_suggest_request(*, data: Any) -> dict:
    """POST /policies/suggestions (and `manage.py policy suggest`): the body parsed, every finding at
    once, then `policy_suggest`. The body: `label` (selectors, ANDed) and `workload` (ids) select the
    workloads to protect (neither: the whole fleet), `from` and `to` the range (as the rollup's),
    `label_keys` (default: `app` and the keys the selection requires), optionally `aggregate_prefix`
    (IPv4) and `aggregate_prefix_v6`, `include_noise` (kinds of noise to propose rules for anyway) and
    `exclude_peers` (addresses or CIDRs never learnt from), `direction` (`inbound`, the default, or
    `outbound`: the selected workloads' outgoing connections, proposed as outbound rulesets)."""
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, REQUEST_FIELDS, findings)
    prefix = _prefix(data, "aggregate_prefix", 32, findings)
    prefix_v6 = _prefix(data, "aggregate_prefix_v6", 128, findings)
    include = _include_noise(data, findings)
    exclude = _exclude_peers(data, findings)
    direction = _direction(data, findings)
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
            lambda: label_keys_parse(data["label_keys"]) if "label_keys" in data else None,
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
        selection_labels=selection.labels,
        include_noise=include,
        exclude_peers=exclude,
        direction=direction,
    )


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
