"""Saving a draft policy (a suggestion's `services`, `address_groups` and `rulesets`, edited or not):
every object created through the API's own write functions (policy/services.py) in one transaction,
so a refusal anywhere leaves nothing behind (no address group without the ruleset that named it).

Every body is checked before anything is written, and every finding given at once, its path inside
the draft (`/rulesets/2/rules/0/services/70`); what only the database can refuse (a name taken, a
reference to nothing) is found at the first object it refuses, and nothing is written either."""

from __future__ import annotations

from typing import Any

from django.db import transaction

from controlplane.auth.actor import Actor
from controlplane.problems import Finding, ValidationFailed, pointer
from controlplane.validation import Findings, reject_unknown, require_object
from policy import services as writes
from policy.validation import address_group_input, ruleset_input, service_input

LISTS = (
    ("services", service_input, writes.service_create),
    ("address_groups", address_group_input, writes.address_group_create),
    ("rulesets", ruleset_input, writes.ruleset_create),
)
MAX_OBJECTS = 1000


def _at(error: ValidationFailed, base: str) -> list[Finding]:
    return [Finding(base + f.path, f.rule, f.message) for f in error.findings]


def _lists(data: dict, findings: Findings) -> dict[str, list]:
    found = {}
    for key, parse, _ in LISTS:
        items = data.get(key, [])
        if not isinstance(items, list) or len(items) > MAX_OBJECTS:
            findings.add(pointer(key), "type", f"{key} must be a list of at most {MAX_OBJECTS} bodies.")
            items = []
        for index, item in enumerate(items):
            try:
                parse(item)
            except ValidationFailed as error:
                findings.extend(_at(error, pointer(key, index)))
        found[key] = items
    if not found["rulesets"] and "rulesets" not in data:
        findings.add("/rulesets", "required", "rulesets is required: the rulesets to create.")
    return found


def policy_draft_save(*, actor: Actor, data: Any) -> dict:
    """POST /policies/drafts (and `manage.py policy save`): create the draft's services, then its
    address groups, then its rulesets (which may name both), all or nothing."""
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, [key for key, _, _ in LISTS], findings)
    lists = _lists(data, findings)
    findings.raise_if_any()
    created: dict[str, list[dict]] = {key: [] for key, _, _ in LISTS}
    detail = {"via": "policy draft save"}
    with transaction.atomic():
        for key, _, create in LISTS:
            for index, body in enumerate(lists[key]):
                try:
                    saved = create(actor=actor, data=body, audit_detail=detail)
                except ValidationFailed as error:
                    raise ValidationFailed(_at(error, pointer(key, index))) from None
                created[key].append({"id": str(saved.id), "name": saved.name})
    return created
