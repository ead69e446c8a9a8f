"""The render dry-run: a draft's effect on every workload's document (which would change, and the
rules each would gain, lose or see changed). Nothing here writes."""

from __future__ import annotations

import uuid
from typing import Any

from controlplane.validation import require_object
from fleet.models import RenderedPolicy, Workload
from fleet.rendering import outbound_failsafe
from flows.policy_drafts.draft import Draft, draft_parse
from policy.renderer import compile_policy
from policy.selectors import PolicyInputs

MAX_REPORTED = 1000


def _rule_keys(rule_index: dict) -> dict[str, tuple[str, str]]:
    return {entry["rule_id"]: (entry["ruleset_name"], entry["rule_id"]) for entry in rule_index.values()}


def _rule_definitions(policy: PolicyInputs) -> dict[str, tuple]:
    out = {}
    for ruleset in policy.rulesets:
        for rule in ruleset.rules:
            groups = tuple(
                policy.groups[s.address_group_id].members if s.address_group_id in policy.groups else None
                for s in rule.sources
            )
            # A rule kept as it is in a ruleset turned round judges other connections: changed.
            out[rule.id] = (ruleset.name, ruleset.direction, rule.action, rule.sources, rule.entries, groups)
    return out


def render_dryrun_request(*, data: Any) -> dict:
    """POST /policies/render-dryrun (and `manage.py render-dryrun`): the body's draft (draft.py) rendered."""
    return render_dryrun(draft=draft_parse(data=require_object(data)))


def render_dryrun(*, draft: Draft) -> dict:
    """Render the whole fleet under `draft`, whose rulesets replace every stored ruleset. Reports each
    workload whose document would change, with the rules it would gain, lose or see changed. Outbound
    rulesets render into their workloads' output chains; a workload's output chain also lists its
    destinations' inbound rules that name it (one rule, both ends), so an inbound change may change
    the documents of the workloads it admits as well."""
    fleet, inputs = draft.in_force.fleet, draft.in_force.workloads
    before_rules, after_rules = _rule_definitions(draft.in_force.policy), _rule_definitions(draft.policy)
    latest = dict(Workload.objects.values_list("id", "latest_policy_id"))
    indexes = dict(
        RenderedPolicy.objects.filter(version__in=set(latest.values())).values_list("version", "rule_index")
    )
    changed = []
    compiled = compile_policy(draft.policy.rulesets, draft.policy.groups, fleet, outbound_failsafe())
    for workload_id, workload in inputs.items():
        result = compiled.render(workload)
        current_version = latest.get(uuid.UUID(workload_id))
        if result.version == current_version:
            continue
        before = _rule_keys(indexes.get(current_version, {}))
        after = _rule_keys({str(k): v for k, v in result.rule_index.items()})
        changed.append(
            {
                "workload_id": workload_id,
                "mode": workload.mode,
                "current_version": current_version,
                "hypothetical_version": result.version,
                "rules_added": sorted(after[k] for k in after.keys() - before.keys()),
                "rules_removed": sorted(before[k] for k in before.keys() - after.keys()),
                "rules_changed": sorted(
                    after[k]
                    for k in after.keys() & before.keys()
                    if before_rules.get(k) != after_rules.get(k)
                ),
            }
        )
    changed.sort(key=lambda c: c["workload_id"])
    for entry in changed:
        for key in ("rules_added", "rules_removed", "rules_changed"):
            entry[key] = [{"ruleset_name": name, "rule_id": rule_id} for name, rule_id in entry[key]]
    return {
        "changed_count": len(changed),
        "unchanged_count": len(inputs) - len(changed),
        "changed": changed[:MAX_REPORTED],
        "truncated": len(changed) > MAX_REPORTED,
        "warnings": draft.warnings(),
    }
