"""What a draft policy would have done to past traffic. Nothing here writes.

Each stored flow key (workload, peer, service) of a range of the selected workloads is classified
twice, by the policy in force now and by the draft, as the workload's table would judge a new
inbound connection (policy/classify.py, the renderer's own semantics: selectors resolve to the
fleet's addresses now). The answer lists the keys whose outcome changes: newly refused (admitted by
a rule now; in the draft by none, or refused by a deny rule, which `rule_draft` names: `enforced`
would block them) and newly admitted, with the range's
coverage as the rollup states it, so that "nothing would change" never reads as complete when the
evidence is not.

Keys are judged as a table in `simulation` or `enforced` judges them, whatever the workload's mode
now: a workload in `visibility` has no rules, and the question is what its rules would do. The
classifier's inputs are built in flows/policy_drafts/classifier.py, which the suggestions share.

The draft's direction decides which evidence it is judged against (`direction`, as the flow reads
take it): given, as given; else `outbound` when the draft holds rulesets and every one is outbound,
`inbound` otherwise. A draft is the complete set, so one that holds both directions is usually the
policy in force with an edit: it is judged on inbound evidence, as every such body was before outbound
existed (the console's panels post the whole set); ask `outbound` or `any` for the rest. An outbound key is judged by
the output chain (the workload's outbound mode's meanings): its own outbound rules, its destination's
inbound rules (one rule, both ends: a draft changing only inbound rules changes outbound keys too,
read with `direction: outbound`) and the fail-safe list.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from controlplane.clock import rfc3339
from controlplane.collection_pause import without_collection
from controlplane.problems import ValidationFailed
from controlplane.validation import Findings, require_object
from flows.choices import ANY_DIRECTION, Direction
from flows.policy_drafts.classifier import FlowKeyClassifier
from flows.policy_drafts.draft import Draft, draft_parse
from flows.representations import coverage_data, keys_read_data
from flows.selectors import coverage, flow_keys_summed, flow_range_plan, workloads_selected
from flows.validation import BODY, FlowSelection, flow_selection_parse
from policy.selectors import PolicyInputs

MAX_LISTED = 1000
KEY_COLUMNS = ["workload_id", "peer", "peer_workload_id", "protocol", "port"]
SELECTION_KEYS = frozenset({"from", "to", "label", "workload", "direction"})


def _rules_by_number(policy: PolicyInputs) -> dict[int, dict]:
    return {
        rule.number: {
            "number": rule.number,
            "ruleset_id": ruleset.id,
            "ruleset_name": ruleset.name,
            "rule_id": rule.id,
            "position": rule.position,
            "action": rule.action,
        }
        for ruleset in policy.rulesets
        for rule in ruleset.rules
    }


def _summary(entries: list[dict]) -> dict:
    return {
        "count": len(entries),
        "connection_count": sum(e["connection_count"] for e in entries),
        "peer_count": len({e["peer"] for e in entries}),
        "service_count": len({(e["protocol"], e["port"]) for e in entries}),
        "workload_count": len({e["workload_id"] for e in entries}),
    }


def policy_impact(*, data: Any) -> dict:
    """POST /policies/impact (and `manage.py policy impact`): the body's draft (a render dry-run's body)
    and its range and selection (`from`, `to`, `label`, `workload`, `direction`, as the rollup's; no
    `direction`: the draft's, see the module), every finding at once, then `draft_impact`."""
    data = require_object(data)
    findings = Findings()
    selection = None
    try:
        selection = flow_selection_parse(
            start=data.get("from"),
            end=data.get("to"),
            labels=data.get("label", []),
            workloads=data.get("workload", []),
            direction=data.get("direction"),
            at=BODY,
        )
    except ValidationFailed as failed:
        findings.extend(failed.findings)
    draft = draft_parse(data=data, findings=findings, more_keys=SELECTION_KEYS)
    assert selection is not None  # noqa: S101  # else draft_parse raised its findings
    if data.get("direction") in (None, ""):
        selection = dataclasses.replace(selection, direction=draft_direction(draft))
    return draft_impact(draft=draft, selection=selection)


def draft_direction(draft: Draft) -> str:
    """The evidence a draft is judged against when the request does not say: outbound for a draft of
    outbound rulesets only, else inbound (see the module)."""
    held = {spec.direction for spec in draft.specs}
    return Direction.OUTBOUND if held == {Direction.OUTBOUND} else Direction.INBOUND


@without_collection
def draft_impact(*, draft: Draft, selection: FlowSelection) -> dict:
    """The keys of the selection's range whose outcome `draft` changes; see the module."""
    selected = workloads_selected(workload_ids=selection.workload_ids, labels=selection.labels)
    start, end = selection.start, selection.end
    direction = selection.direction
    planned = flow_range_plan(selected=selected, start=start, end=end, direction=direction)
    covered = coverage(selected, start, end, lookback=planned.lookback)
    # The keys of most connections, up to a bound (the aggregate key left out in the query): past it
    # the answer says how many keys and connections were not judged. Read both ways, each key says its
    # own direction; read one way, the classifier is told it.
    both = direction == ANY_DIRECTION
    read = flow_keys_summed(planned, [*KEY_COLUMNS, "direction"] if both else KEY_COLUMNS)
    rows = read.rows
    if direction == Direction.OUTBOUND:
        rows = [{**row, "direction": direction} for row in rows]

    judge = FlowKeyClassifier(draft.in_force, drafts=[draft.policy])
    rules_now, rules_draft = _rules_by_number(draft.in_force.policy), _rules_by_number(draft.policy)
    # The keys whose outcome changes, as (row, workload, rule now, rule in the draft): a rule names each
    # side, the allow rule that admits the key or the deny rule that refuses it (None: no rule admits
    # it). Only those listed are made entries: a fleet's draft may change every key of the range.
    refused: list[tuple] = []
    admitted: list[tuple] = []
    for row in rows:
        workload, found = judge.workload(row), judge.judged(row)
        if workload is None or found is None:
            continue
        now, draft_judged = found
        if now.admitted == draft_judged.admitted:
            continue
        (admitted if draft_judged.admitted else refused).append((row, workload, now.rule, draft_judged.rule))

    ids: dict = {}

    def text(workload_id) -> str:
        found = ids.get(workload_id)
        if found is None:
            found = ids[workload_id] = str(workload_id)
        return found

    def order(changed: tuple) -> tuple:
        row = changed[0]
        return (
            -row["connection_count"],
            text(row["workload_id"]),
            row["peer"],
            row["protocol"],
            row["port"],
            row.get("direction") or Direction.INBOUND,
        )

    def entry(changed: tuple) -> dict:
        row, workload, before, after = changed
        outbound = row.get("direction") == Direction.OUTBOUND
        return {
            "workload_id": text(row["workload_id"]),
            "direction": row.get("direction") or Direction.INBOUND,
            # The mode that decides the key: the outbound mode for a connection the workload opened.
            "mode": workload.outbound_mode if outbound else workload.mode,
            "peer": row["peer"],
            "peer_workload_id": str(row["peer_workload_id"]) if row["peer_workload_id"] else None,
            "protocol": row["protocol"],
            "port": row["port"],
            "connection_count": row["connection_count"],
            "first_seen": rfc3339(row["first_seen"]),
            "last_seen": rfc3339(row["last_seen"]),
            "rule_now": rules_now.get(before) if before is not None else None,
            "rule_draft": rules_draft.get(after) if after is not None else None,
        }

    refused.sort(key=order)
    admitted.sort(key=order)
    return {
        "from": rfc3339(start),
        "to": rfc3339(end),
        "direction": str(direction),
        "keys_classified": len(rows),
        "newly_refused_summary": _summary([changed[0] for changed in refused]),
        "newly_refused": [entry(changed) for changed in refused[:MAX_LISTED]],
        "newly_admitted_summary": _summary([changed[0] for changed in admitted]),
        "newly_admitted": [entry(changed) for changed in admitted[:MAX_LISTED]],
        # The lists stop at MAX_LISTED entries (their summaries count every one); `keys_left_out` says
        # the keys themselves stopped at their bound, and then the summaries too are of the keys read.
        "truncated": len(refused) > MAX_LISTED or len(admitted) > MAX_LISTED or read.truncated,
        **keys_read_data(read),
        "coverage": coverage_data(covered),
        "warnings": draft.warnings(),
    }
