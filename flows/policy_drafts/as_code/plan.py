"""The plan of a policy file: `policy_plan` compares the file with the stored policy object by object
and field by field, and says what a render dry-run and the impact over past traffic make of it.

A rule written without a number (by hand) is matched to a stored rule no number claims by content
(then by one side, then by position), so a rule that did not change keeps its id and lifetime
number: flow evidence stays attributed to it, and its documents do not move.
"""

from __future__ import annotations

import json
from collections import defaultdict, deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import transaction

from controlplane import clock
from controlplane.clock import rfc3339
from controlplane.conditional import version_text
from controlplane.validation import Findings
from flows.policy_drafts.as_code.format import (
    GROUP_KEYS,
    KINDS,
    RULE_FIELDS,
    RULESET_KEYS,
    SERVICE_KEYS,
    StoredObject,
    policy_version_lock,
    stored_policy_load,
)
from flows.policy_drafts.as_code.parse import PolicyFileInvalid, file_parse, file_rulesets_resolve
from flows.policy_drafts.draft import draft_parse
from flows.policy_drafts.dryrun import render_dryrun
from flows.policy_drafts.impact import draft_impact
from flows.validation import BODY, flow_selection_parse

IMPACT_DAYS = 7


# --- the plan -----------------------------------------------------------------------------------


def _content(rule: dict) -> dict:
    return {key: value for key, value in rule.items() if key != "number"}


def _match_rules(old: list[dict], new: list[dict]) -> list[int | None]:
    """For each new rule, the stored rule it keeps (its index) or None for a new one. A numbered rule
    is the stored rule of its number (or new, with that number). An unnumbered one takes, among the
    stored rules no number of the file claims: an identical one not taken yet; else one with the same
    sources or the same services (an edit of one side); else the one at the same position, if free.
    Each pass looks the stored rules up by what it compares (the first free one of that content, in
    stored order), so a ruleset of 500 rules is matched in linear time, not 500 x 500 comparisons."""
    matched: list[int | None] = [None] * len(new)
    by_number = {rule["number"]: j for j, rule in enumerate(old)}
    for i, rule in enumerate(new):
        if "number" in rule:
            matched[i] = by_number.get(rule["number"])
    claimed = {rule["number"] for rule in new if "number" in rule}
    taken = {j for j, rule in enumerate(old) if rule["number"] in claimed}

    def first_free(index: dict[str, deque], key: str) -> int | None:
        candidates = index.get(key)
        while candidates and candidates[0] in taken:
            candidates.popleft()
        return candidates[0] if candidates else None

    def indexed(part) -> dict[str, deque]:
        index: dict[str, deque] = defaultdict(deque)
        for j, candidate in enumerate(old):
            if j not in taken:
                index[_key(part(candidate))].append(j)
        return index

    unnumbered = [i for i, rule in enumerate(new) if "number" not in rule]
    contents = indexed(_content)
    for i in unnumbered:
        j = first_free(contents, _key(new[i]))
        if j is not None:
            matched[i] = j
            taken.add(j)

    def peers(rule: dict) -> list:
        return rule.get("sources", rule.get("destinations", []))

    by_sources, by_services = indexed(peers), indexed(lambda r: r["services"])
    for i in unnumbered:
        if matched[i] is None:
            found = [
                j
                for j in (
                    first_free(by_sources, _key(peers(new[i]))),
                    first_free(by_services, _key(new[i]["services"])),
                )
                if j is not None
            ]
            if found:
                matched[i] = min(found)
                taken.add(min(found))
    for i in unnumbered:
        if matched[i] is None and i < len(old) and i not in taken:
            matched[i] = i
            taken.add(i)
    return matched


def _key(value: Any) -> str:
    """A rule's content (or one side of it) as a dictionary key: equal data, equal text."""
    return json.dumps(value, sort_keys=True)


def _rule_changes(old: list[dict], new: list[dict], matched: list[int | None]) -> list[dict]:
    changes: list[dict] = []
    for i, j in enumerate(matched):
        if j is None:
            changes.append({"field": f"rules[{i}]", "action": "add", "new": new[i]})
            continue
        for key in RULE_FIELDS:
            absent = "allow" if key == "action" else ""
            before, after = old[j].get(key, absent), new[i].get(key, absent)
            if before != after:
                changes.append(
                    {"field": f"rules[{i}].{key}", "action": "change", "old": before, "new": after}
                )
    kept = {j for j in matched if j is not None}
    for j, rule in enumerate(old):
        if j not in kept:
            changes.append({"field": f"rules[{j}]", "action": "remove", "old": rule})  # its stored place
    order = [j for j in matched if j is not None]
    if order != sorted(order):
        changes.append(
            {
                "field": "rules",
                "action": "reorder",
                "old": sorted(order),
                "new": order,
            }
        )
    return changes


def _field_changes(kind: str, old: dict, new: dict, matched: list[int | None] | None) -> list[dict]:
    changes = []
    keys = {"service": SERVICE_KEYS, "address_group": GROUP_KEYS, "ruleset": RULESET_KEYS}[kind]
    for key in keys:
        if key == "name":
            continue
        absent = "inbound" if key == "direction" else ""
        before, after = old.get(key, absent), new.get(key, absent)
        if key == "rules":
            assert matched is not None  # noqa: S101
            changes.extend(_rule_changes(old["rules"], new["rules"], matched))
        elif before != after:
            changes.append({"field": key, "action": "change", "old": before, "new": after})
    return changes


@dataclass
class Step:
    kind: str
    action: str  # create, change, delete
    name: str
    fields: list[dict]
    body: dict | None = None  # the API's write body (create, change)
    stored: StoredObject | None = None  # change, delete
    rule_numbers: dict[tuple[str, int], int] = field(default_factory=dict)  # created rules' numbers


@dataclass
class Plan:
    policy_version: int
    steps: list[Step]
    kept: list[tuple[str, str]]
    dryrun_rulesets: list[dict]
    services: list[dict]
    groups: list[dict]
    ruleset_paths: dict[str, str]  # name -> pointer in the file
    rule_numbers: dict[tuple[str, int], int]  # (ruleset name, position) -> a created rule's number


def _ruleset_body(data: dict, rule_ids: list[str | None]) -> dict:
    """The API's body: kept rules by id; numbers go beside it (`_created_numbers`), the API ignores
    a body's."""
    rules = [
        {**_content(rule), "id": rule_id} if rule_id else _content(rule)
        for rule, rule_id in zip(data["rules"], rule_ids, strict=True)
    ]
    return {**data, "rules": rules}


def _created_numbers(data: dict, rule_ids: list[str | None]) -> dict[tuple[str, int], int]:
    return {
        (data["name"], position): rule["number"]
        for position, (rule, rule_id) in enumerate(zip(data["rules"], rule_ids, strict=True))
        if rule_id is None and "number" in rule
    }


def plan_make(data: Any, *, prune: bool) -> Plan:
    """The steps from the stored policy to the file's; call under the policy lock."""
    findings = Findings()
    desired, ruleset_specs = file_parse(data, findings)
    stored = stored_policy_load()
    file_rulesets_resolve(desired, ruleset_specs, stored, prune, findings)
    if findings:
        # The file's own key check and the API's parser may both refuse an unknown key: once is enough.
        raise PolicyFileInvalid(list(dict.fromkeys(findings.items)))
    steps: list[Step] = []
    kept: list[tuple[str, str]] = []
    kept_rulesets: list[dict] = []
    for kind in KINDS:
        wanted, current = desired.objects[kind], stored.objects[kind]
        for name in sorted(wanted.keys() | current.keys()):
            new, old = wanted.get(name), current.get(name)
            if old is None:
                assert new is not None  # noqa: S101
                body, numbers = new, {}
                if kind == "ruleset":
                    body = _ruleset_body(new, [None] * len(new["rules"]))
                    numbers = _created_numbers(new, [None] * len(new["rules"]))
                fields = [{"field": k, "action": "set", "new": v} for k, v in new.items() if k != "name"]
                steps.append(Step(kind, "create", name, fields, body, rule_numbers=numbers))
            elif new is None:
                if prune:
                    steps.append(Step(kind, "delete", name, [], stored=old))
                else:
                    kept.append((kind, name))
                    if kind == "ruleset":
                        kept_rulesets.append(_ruleset_body(old.data, list(old.rule_ids)))
            else:
                matched = _match_rules(old.data["rules"], new["rules"]) if kind == "ruleset" else None
                fields = _field_changes(kind, old.data, new, matched)
                body, numbers = new, {}
                if kind == "ruleset":
                    assert matched is not None  # noqa: S101
                    ids = [old.rule_ids[j] if j is not None else None for j in matched]
                    body, numbers = _ruleset_body(new, ids), _created_numbers(new, ids)
                if fields:
                    steps.append(Step(kind, "change", name, fields, body, stored=old, rule_numbers=numbers))
                elif kind == "ruleset":
                    kept_rulesets.append(body)
    # The dry-run numbers new rules in the order the apply creates them: created rulesets, then
    # changed ones, each by name.
    dryrun_rulesets = [s.body for s in steps if s.kind == "ruleset" and s.action == "create"]
    dryrun_rulesets += [s.body for s in steps if s.kind == "ruleset" and s.action == "change"]
    dryrun_rulesets += kept_rulesets
    return Plan(
        policy_version=stored.policy_version,
        steps=steps,
        kept=kept,
        dryrun_rulesets=[b for b in dryrun_rulesets if b is not None],
        services=list(desired.objects["service"].values()),
        groups=list(desired.objects["address_group"].values()),
        ruleset_paths=desired.paths["ruleset"],
        rule_numbers={key: n for step in steps for key, n in step.rule_numbers.items()},
    )


def step_data(step: Step) -> dict:
    return {"action": step.action, "type": step.kind, "name": step.name, "fields": step.fields}


def policy_plan(
    *, data: Any, prune: bool = False, impact_from: str | None = None, impact_to: str | None = None
) -> dict:
    """What applying the file would do, and the policy version it was planned against (what
    `policy_apply` must be given as `expected_version`). Writes nothing."""
    with transaction.atomic():
        policy_version_lock()
        plan = plan_make(data, prune=prune)
    answer: dict = {
        "policy_version": version_text(plan.policy_version),
        "prune": prune,
        "changes": [step_data(s) for s in plan.steps],
        "kept": [{"type": kind, "name": name} for kind, name in plan.kept],
        "render": None,
        "impact": None,
        "warnings": [],
    }
    if not plan.steps:
        return answer
    end = clock.now()
    selection = flow_selection_parse(
        start=impact_from or rfc3339(end - timedelta(days=IMPACT_DAYS)),
        end=impact_to or rfc3339(end),
        labels=[],
        workloads=[],
        at=BODY,
    )
    # The policy after the apply, parsed once, with the fleet and the policy in force loaded once: what
    # the dry-run and the impact both judge.
    draft = draft_parse(
        data={"rulesets": plan.dryrun_rulesets, "services": plan.services, "address_groups": plan.groups},
        rule_numbers=plan.rule_numbers,
    )
    dryrun = render_dryrun(draft=draft)
    answer["render"] = {
        "changed_count": dryrun["changed_count"],
        "unchanged_count": dryrun["unchanged_count"],
    }
    answer["warnings"] = _file_warnings(dryrun["warnings"], plan)
    impact = draft_impact(draft=draft, selection=selection)
    answer["impact"] = {
        key: impact[key]
        for key in (
            "from",
            "to",
            "keys_classified",
            "newly_refused_summary",
            "newly_admitted_summary",
            "keys_total",
            "keys_left_out",
            "connections_left_out",
            "coverage",
        )
    }
    return answer


def _file_warnings(warnings: list[dict], plan: Plan) -> list[dict]:
    """The dry-run's warnings (pointers into its own body) as pointers into the file, for the rulesets
    the plan creates or changes: the others are not the plan's concern."""
    touched = {s.name for s in plan.steps if s.kind == "ruleset" and s.action != "delete"}
    out = []
    for warning in warnings:
        _, _, index, tail = (warning["path"].split("/", 3) + [""])[:4]
        name = plan.dryrun_rulesets[int(index)]["name"]
        if name in touched and name in plan.ruleset_paths:
            out.append({**warning, "path": plan.ruleset_paths[name] + ("/" + tail if tail else "")})
    return out
