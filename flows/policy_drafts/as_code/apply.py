"""The apply of a policy file: `policy_apply` performs the plan (plan.py) through the API's own write
functions (policy/services.py) in one transaction, refusing when the policy version moved since the
plan.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from controlplane.auth.actor import Actor
from controlplane.conditional import version_text
from controlplane.problems import Finding, Problem, ValidationFailed
from controlplane.validation import quoted
from flows.policy_drafts.as_code.format import LISTS, policy_version_lock
from flows.policy_drafts.as_code.parse import PolicyFileInvalid
from flows.policy_drafts.as_code.plan import Step, plan_make, step_data
from policy import services as writes
from policy.models import PolicyState


def _expected(version: str) -> str:
    return version.strip().strip('"')


def policy_apply(*, actor: Actor, data: Any, prune: bool = False, expected_version: str, source: str) -> dict:
    """Perform the plan of `data` in one transaction through the API's write functions, each write an
    audit event whose detail names `source`; refused, with nothing written, when the policy version is
    not `expected_version` (the policy moved since the plan)."""
    detail = {"source": source, "via": "policy apply"}
    with transaction.atomic():
        current = policy_version_lock()
        if version_text(current) != _expected(expected_version):
            raise Problem(
                "precondition-failed",
                f"The policy moved since the plan: it is at version {version_text(current)}, the plan was "
                f"made at {quoted(_expected(expected_version))}; plan again.",
                current_version=version_text(current),
            )
        plan = plan_make(data, prune=prune)
        # The file's numbers for the rules it creates, set aside before any rule is created, so that
        # an unnumbered new rule is numbered past them (as the plan's dry-run numbered it).
        numbers = writes.rule_numbers_claim(requested=plan.rule_numbers)
        by_kind_action: dict[tuple[str, str], list[Step]] = {}
        for step in plan.steps:
            by_kind_action.setdefault((step.kind, step.action), []).append(step)

        def run(kind: str, action: str) -> None:
            for step in by_kind_action.get((kind, action), []):
                _perform(step, actor=actor, audit_detail=detail, rule_numbers=numbers)

        # Deleted rulesets first (room for new ones, and their references go), then the services and
        # groups the rulesets may name, then rulesets, then the services and groups no longer named.
        run("ruleset", "delete")
        for kind in ("service", "address_group"):
            run(kind, "create")
            run(kind, "change")
        run("ruleset", "create")
        run("ruleset", "change")
        for kind in ("service", "address_group"):
            run(kind, "delete")
        after = PolicyState.objects.filter(id=1).values_list("version", flat=True).first() or 1
    return {
        "applied": len(plan.steps),
        "changes": [step_data(s) for s in plan.steps],
        "kept": [{"type": kind, "name": name} for kind, name in plan.kept],
        "policy_version_before": version_text(plan.policy_version),
        "policy_version": version_text(after),
    }


_WRITES = {
    ("service", "create"): lambda step, **kw: writes.service_create(data=step.body, **kw),
    ("service", "change"): lambda step, **kw: writes.service_replace(
        service_id=step.stored.id, expected_version=step.stored.version, data=step.body, **kw
    ),
    ("service", "delete"): lambda step, **kw: writes.service_delete(
        service_id=step.stored.id, expected_version=step.stored.version, **kw
    ),
    ("address_group", "create"): lambda step, **kw: writes.address_group_create(data=step.body, **kw),
    ("address_group", "change"): lambda step, **kw: writes.address_group_replace(
        group_id=step.stored.id, expected_version=step.stored.version, data=step.body, **kw
    ),
    ("address_group", "delete"): lambda step, **kw: writes.address_group_delete(
        group_id=step.stored.id, expected_version=step.stored.version, **kw
    ),
    ("ruleset", "create"): lambda step, **kw: writes.ruleset_create(data=step.body, **kw),
    ("ruleset", "change"): lambda step, **kw: writes.ruleset_replace(
        ruleset_id=step.stored.id, expected_version=step.stored.version, data=step.body, **kw
    ),
    ("ruleset", "delete"): lambda step, **kw: writes.ruleset_delete(
        ruleset_id=step.stored.id, expected_version=step.stored.version, **kw
    ),
}


def _perform(step: Step, *, actor: Actor, audit_detail: dict, rule_numbers: writes.RuleNumbers) -> None:
    """One write; a problem it raises names the object, since the file's paths no longer apply."""
    more = {"rule_numbers": rule_numbers} if step.kind == "ruleset" and step.action != "delete" else {}
    try:
        _WRITES[(step.kind, step.action)](step, actor=actor, audit_detail=audit_detail, **more)
    except ValidationFailed as error:
        raise PolicyFileInvalid(
            [Finding(f"/{LISTS[step.kind]}/{step.name}{f.path}", f.rule, f.message) for f in error.findings]
        ) from None
    except Problem as problem:
        raise Problem(
            problem.name,
            f"{step.action} {step.kind.replace('_', ' ')} {quoted(step.name)}: {problem.detail}",
        ) from None
