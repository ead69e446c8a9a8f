"""Writes of authored policy. Each write runs in one transaction that first locks the policy state
row, so policy writes are serialised and the policy version moves exactly once per write."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import IntegrityError, transaction

from controlplane import clock
from controlplane.audit import audit_record
from controlplane.auth.actor import Actor
from controlplane.conditional import locked_for_write
from controlplane.lookups import get_or_not_found
from controlplane.problems import Finding, Problem, ValidationFailed
from controlplane.validation import Findings
from fleet.rendering import rerender_for_scopes
from policy.choices import SourceKind
from policy.models import (
    AddressGroup,
    PolicyState,
    Rule,
    RuleService,
    Ruleset,
    RuleSource,
    Service,
    ServiceEntry,
)
from policy.renderer import MAX_RULES as MAX_RULE_NUMBER
from policy.validation import (
    MAX_ADDRESS_GROUPS,
    MAX_RULES_PER_RULESET,
    MAX_RULESETS,
    MAX_SERVICES,
    RuleSpec,
    address_group_input,
    ruleset_input,
    service_input,
    single_rule_input,
)


def policy_lock() -> PolicyState:
    """Lock the policy state row until the transaction ends, creating it if it is missing: every
    policy write and every plan's read takes it first, so nothing commits a policy change while it
    is held (a missing row would lock nothing)."""
    return PolicyState.objects.select_for_update().get_or_create(id=1)[0]


def _policy_changed(state: PolicyState, *, scopes: Iterable[str] = ()) -> None:
    """Move the policy version and re-render the workloads in the scopes of the touched rulesets,
    inside the write's transaction so documents commit with the change that caused them."""
    state.version += 1
    state.save(update_fields=["version"])
    scopes = set(scopes)
    if scopes:
        rerender_for_scopes(scopes=scopes)


def _take_rule_number(state: PolicyState) -> int:
    """The next lifetime rule number (the caller holds the policy lock): never given twice."""
    number = state.next_rule_number
    if number > MAX_RULE_NUMBER:
        raise ValidationFailed(
            [
                Finding(
                    "",
                    "too-many",
                    f"All {MAX_RULE_NUMBER:,} rule numbers have been given out; no rule can be added.",
                )
            ]
        )
    state.next_rule_number = number + 1
    state.save(update_fields=["next_rule_number"])
    return number


@dataclass
class RuleNumbers:
    """Lifetime numbers set aside by `rule_numbers_claim` for rules a caller creates afterwards (policy
    as code recreating rules under the numbers its file gives them), by ruleset name and the rule's
    position in the write's body. Each was never given when claimed, and is given at most once."""

    requested: dict[tuple[str, int], int] = field(default_factory=dict)

    def take(self, ruleset_name: str, position: int) -> int | None:
        return self.requested.pop((ruleset_name, position), None)


def rule_numbers_claim(*, requested: Mapping[tuple[str, int], int]) -> RuleNumbers:
    """Claim the numbers `requested` (by ruleset name and position) for rules created later; the next
    number given to any other rule is past the highest of them. A number already given (below
    next_rule_number, held or not: a deleted rule's evidence must never name a new one) is refused.
    Internal: the API never lets a body choose a rule's number."""
    numbers = list(requested.values())
    if not numbers:
        return RuleNumbers()
    with transaction.atomic():
        state = policy_lock()
        findings = Findings()
        for number in sorted(set(numbers)):
            if isinstance(number, bool) or not isinstance(number, int) or not 0 < number <= MAX_RULE_NUMBER:
                findings.add("", "out-of-range", f"A rule number is 1-{MAX_RULE_NUMBER}, not {number!r}.")
            elif number < state.next_rule_number:
                findings.add("", "number-given", f"Rule number {number} has been given already.")
        if len(set(numbers)) != len(numbers):
            findings.add("", "duplicate-number", "A rule number is claimed twice.")
        findings.raise_if_any()
        state.next_rule_number = max(numbers) + 1
        state.save(update_fields=["next_rule_number"])
    return RuleNumbers(dict(requested))


def _number_for(
    state: PolicyState, rule_numbers: RuleNumbers | None, ruleset_name: str, position: int
) -> int:
    claimed = rule_numbers.take(ruleset_name, position) if rule_numbers else None
    return claimed if claimed is not None else _take_rule_number(state)


def _scopes_using(rules) -> set[str]:
    return {rule.ruleset.scope for rule in rules}


def _uuid_or_none(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(text))
    except ValueError:
        return None


def _get(model, object_id, what: str):
    return get_or_not_found(model, object_id, what=what)


def _check_room(model, maximum: int, findings: Findings) -> None:
    if model.objects.count() >= maximum:
        findings.add("", "too-many", f"At most {maximum} {model._meta.verbose_name_plural} may exist.")


def _check_unique_name(model, name: str, findings: Findings, *, exclude_id=None) -> None:
    clash = model.objects.filter(name=name)
    if exclude_id is not None:
        clash = clash.exclude(id=exclude_id)
    if clash.exists():
        findings.add("/name", "duplicate-name", f"The name {name!r} is taken.")


def _save_unique(obj) -> None:
    """Save, turning a name clash that slipped past the check into the same finding."""
    try:
        with transaction.atomic():
            obj.save()
    except IntegrityError:
        findings = Findings()
        findings.add("/name", "duplicate-name", f"The name {obj.name!r} is taken.")
        findings.raise_if_any()


# --- the audit of authored objects ---


_AUDITED_TYPES = {Service: "service", AddressGroup: "address_group", Ruleset: "ruleset", Rule: "rule"}


def _audit(
    verb: str,
    obj: Service | AddressGroup | Ruleset | Rule,
    *,
    actor: Actor,
    detail=None,
    audit_detail: Mapping[str, Any] | None = None,
) -> None:
    """Record the create, replace or delete of an authored object in its write's transaction: after
    a create, before a replace moves the version (the new one is the next), before a delete.
    `audit_detail` is the caller's context (policy as code names the file it applies)."""
    object_type = _AUDITED_TYPES[type(obj)]
    versions = {
        "create": {"version_after": obj.version},
        "replace": {"version_before": obj.version, "version_after": obj.version + 1},
        "delete": {"version_before": obj.version},
    }[verb]
    audit_record(
        actor=actor,
        action=f"{object_type}.{verb}",
        object_type=object_type,
        object_id=obj.id,
        object_name="" if isinstance(obj, Rule) else obj.name,  # a rule is named by its ruleset and number
        detail={**(detail or {}), **(audit_detail or {})},
        **versions,
    )


# --- services and address groups: their create, replace and delete, written once ---


def _write_service_entries(service: Service, spec) -> None:
    ServiceEntry.objects.filter(service=service).delete()
    ServiceEntry.objects.bulk_create(
        ServiceEntry(service=service, position=i, protocol=e.protocol, port=e.port, port_to=e.port_to)
        for i, e in enumerate(spec.entries)
    )


@dataclass(frozen=True)
class _Named:
    """A kind of named object that rules use (a service, an address group): what its create, replace
    and delete, written once below, need to know of it."""

    model: type[Service] | type[AddressGroup]
    what: str
    maximum: int
    parse: Callable[[Any], Any]  # a write's body -> its spec
    fields: Callable[[Any], dict[str, Any]]  # a spec -> the row's fields
    write_rows: Callable[[Any, Any], None]  # (object, spec): the rows it owns (a service's entries)
    users: Callable[[Any], Any]  # object -> the rules that use it


_SERVICES = _Named(
    model=Service,
    what="service",
    maximum=MAX_SERVICES,
    parse=service_input,
    fields=lambda spec: {"name": spec.name, "description": spec.description},
    write_rows=_write_service_entries,
    users=lambda service: Rule.objects.filter(services__service=service),
)
_ADDRESS_GROUPS = _Named(
    model=AddressGroup,
    what="address group",
    maximum=MAX_ADDRESS_GROUPS,
    parse=address_group_input,
    fields=lambda spec: {"name": spec.name, "description": spec.description, "members": list(spec.members)},
    write_rows=lambda group, spec: None,
    users=lambda group: Rule.objects.filter(sources__address_group=group),
)


def _named_create(
    kind: _Named, *, actor: Actor, data: Mapping[str, Any], audit_detail: Mapping[str, Any] | None
):
    spec = kind.parse(data)
    with transaction.atomic():
        state = policy_lock()
        findings = Findings()
        _check_room(kind.model, kind.maximum, findings)
        _check_unique_name(kind.model, spec.name, findings)
        findings.raise_if_any()
        now = clock.now()
        named = kind.model(**kind.fields(spec), created_at=now, updated_at=now)
        _save_unique(named)
        kind.write_rows(named, spec)
        _audit("create", named, actor=actor, audit_detail=audit_detail)
        _policy_changed(state)
    return named


def _named_replace(
    kind: _Named,
    *,
    actor: Actor,
    object_id: str,
    expected_version: str,
    data: Mapping[str, Any],
    audit_detail: Mapping[str, Any] | None,
):
    _get(kind.model, object_id, kind.what)
    spec = kind.parse(data)
    with transaction.atomic():
        state = policy_lock()
        named = locked_for_write(
            kind.model.objects, pk=object_id, expected_version=expected_version, what=kind.what
        )
        findings = Findings()
        _check_unique_name(kind.model, spec.name, findings, exclude_id=named.id)
        findings.raise_if_any()
        for field_name, value in kind.fields(spec).items():
            setattr(named, field_name, value)
        _audit("replace", named, actor=actor, audit_detail=audit_detail)
        named.version += 1
        named.updated_at = clock.now()
        _save_unique(named)
        kind.write_rows(named, spec)
        _policy_changed(state, scopes=_scopes_using(kind.users(named).select_related("ruleset")))
    return named


def _named_delete(
    kind: _Named,
    *,
    actor: Actor,
    object_id: str,
    expected_version: str,
    audit_detail: Mapping[str, Any] | None,
) -> None:
    _get(kind.model, object_id, kind.what)
    with transaction.atomic():
        state = policy_lock()
        named = locked_for_write(
            kind.model.objects, pk=object_id, expected_version=expected_version, what=kind.what
        )
        _refuse_if_used(named, kind.users(named).select_related("ruleset").distinct(), kind.what)
        _audit("delete", named, actor=actor, audit_detail=audit_detail)
        named.delete()
        _policy_changed(state)


def _referencing_rules(rules: Iterable[Rule]) -> list[dict[str, str]]:
    return [
        {"ruleset_id": str(r.ruleset_id), "ruleset_name": r.ruleset.name, "rule_id": str(r.id)}
        for r in sorted(rules, key=lambda r: (r.ruleset.name, r.position))
    ]


def _refuse_if_used(obj, rules, what: str) -> None:
    referencing = _referencing_rules(rules)
    if referencing:
        names = ", ".join(sorted({r["ruleset_name"] for r in referencing}))
        raise Problem(
            "in-use",
            f"The {what} {obj.name!r} is used by {len(referencing)} rule(s) in ruleset(s) {names}; "
            "remove those references first.",
            referenced_by=referencing,
        )


def service_create(
    *, actor: Actor, data: Mapping[str, Any], audit_detail: Mapping[str, Any] | None = None
) -> Service:
    return _named_create(_SERVICES, actor=actor, data=data, audit_detail=audit_detail)


def service_replace(
    *,
    actor: Actor,
    service_id: str,
    expected_version: str,
    data: Mapping[str, Any],
    audit_detail: Mapping[str, Any] | None = None,
) -> Service:
    return _named_replace(
        _SERVICES,
        actor=actor,
        object_id=service_id,
        expected_version=expected_version,
        data=data,
        audit_detail=audit_detail,
    )


def service_delete(
    *, actor: Actor, service_id: str, expected_version: str, audit_detail: Mapping[str, Any] | None = None
) -> None:
    _named_delete(
        _SERVICES,
        actor=actor,
        object_id=service_id,
        expected_version=expected_version,
        audit_detail=audit_detail,
    )


def address_group_create(
    *, actor: Actor, data: Mapping[str, Any], audit_detail: Mapping[str, Any] | None = None
) -> AddressGroup:
    return _named_create(_ADDRESS_GROUPS, actor=actor, data=data, audit_detail=audit_detail)


def address_group_replace(
    *,
    actor: Actor,
    group_id: str,
    expected_version: str,
    data: Mapping[str, Any],
    audit_detail: Mapping[str, Any] | None = None,
) -> AddressGroup:
    return _named_replace(
        _ADDRESS_GROUPS,
        actor=actor,
        object_id=group_id,
        expected_version=expected_version,
        data=data,
        audit_detail=audit_detail,
    )


def address_group_delete(
    *, actor: Actor, group_id: str, expected_version: str, audit_detail: Mapping[str, Any] | None = None
) -> None:
    _named_delete(
        _ADDRESS_GROUPS,
        actor=actor,
        object_id=group_id,
        expected_version=expected_version,
        audit_detail=audit_detail,
    )


# --- rulesets and rules ---


def _resolve(model, reference: str, findings: Findings, path: str, what: str):
    key = _uuid_or_none(reference)
    obj = model.objects.filter(id=key).first() if key else model.objects.filter(name=reference).first()
    if obj is None:
        findings.add(path, "unknown-reference", f"No {what} {reference!r}.")
    return obj


def _resolve_rule(spec: RuleSpec, findings: Findings):
    """The rows of a rule's sources and services, with references resolved (unsaved, no rule yet)."""
    sources, services = [], []
    for position, source in enumerate(spec.sources):
        group = None
        if source.kind == SourceKind.ADDRESS_GROUP:
            group = _resolve(
                AddressGroup, source.reference, findings, source.path + "/address_group", "address group"
            )
        sources.append(
            RuleSource(position=position, kind=source.kind, selector=source.selector, address_group=group)
        )
    for position, ref in enumerate(spec.services):
        if ref.entry is None:
            service = _resolve(Service, ref.reference, findings, ref.path + "/service", "service")
            services.append(RuleService(position=position, service=service))
        else:
            e = ref.entry
            services.append(
                RuleService(position=position, protocol=e.protocol, port=e.port, port_to=e.port_to)
            )
    return sources, services


def _rule_content(sources, services) -> list:
    """What a rule admits, to tell whether a replace changed it."""
    return [
        [(s.kind, s.selector, s.address_group_id) for s in sources],
        [(s.service_id, s.protocol, s.port, s.port_to) for s in services],
    ]


def _write_rule(rule: Rule, sources, services) -> None:
    RuleSource.objects.filter(rule=rule).delete()
    RuleService.objects.filter(rule=rule).delete()
    for row in sources:
        row.rule = rule
    for row in services:
        row.rule = rule
    RuleSource.objects.bulk_create(sources)
    RuleService.objects.bulk_create(services)


def _current_rule_content(rule: Rule) -> list:
    return _rule_content(list(rule.sources.all()), list(rule.services.all()))


def ruleset_create(
    *,
    actor: Actor,
    data: Mapping[str, Any],
    audit_detail: Mapping[str, Any] | None = None,
    rule_numbers: RuleNumbers | None = None,
) -> Ruleset:
    """Create a ruleset with its rules; each rule is given the next lifetime number, or the one
    `rule_numbers` (claimed by the caller) holds for its position."""
    spec = ruleset_input(data)
    with transaction.atomic():
        state = policy_lock()
        findings = Findings()
        _check_room(Ruleset, MAX_RULESETS, findings)
        _check_unique_name(Ruleset, spec.name, findings)
        resolved = [_resolve_rule(rule, findings) for rule in spec.rules]
        for rule in spec.rules:
            if rule.id:
                findings.add(
                    rule.path + "/id", "unknown-rule", "A new ruleset has no rules yet: leave out rule ids."
                )
        findings.raise_if_any()
        now = clock.now()
        ruleset = Ruleset(
            name=spec.name,
            description=spec.description,
            enabled=spec.enabled,
            scope=spec.scope,
            direction=spec.direction,
            created_at=now,
            updated_at=now,
        )
        _save_unique(ruleset)
        for position, (rule, (sources, services)) in enumerate(zip(spec.rules, resolved, strict=True)):
            row = Rule.objects.create(
                ruleset=ruleset,
                number=_number_for(state, rule_numbers, spec.name, position),
                position=position,
                description=rule.description,
                action=rule.action,
                created_at=now,
                updated_at=now,
            )
            _write_rule(row, sources, services)
        _audit("create", ruleset, actor=actor, detail={"rules": len(spec.rules)}, audit_detail=audit_detail)
        _policy_changed(state, scopes=[ruleset.scope])
    return ruleset


def ruleset_replace(
    *,
    actor: Actor,
    ruleset_id: str,
    expected_version: str,
    data: Mapping[str, Any],
    audit_detail: Mapping[str, Any] | None = None,
    rule_numbers: RuleNumbers | None = None,
) -> Ruleset:
    """Replace a ruleset whole: rules whose ids the body carries are kept (their version moves only if
    they changed), rules without an id are added (with the next lifetime number, or the one
    `rule_numbers` holds for their position), and the ruleset's other rules are removed."""
    _get(Ruleset, ruleset_id, "ruleset")
    spec = ruleset_input(data)
    with transaction.atomic():
        state = policy_lock()
        ruleset = locked_for_write(
            Ruleset.objects, pk=ruleset_id, expected_version=expected_version, what="ruleset"
        )
        findings = Findings()
        _check_unique_name(Ruleset, spec.name, findings, exclude_id=ruleset.id)
        existing = {str(r.id): r for r in ruleset.rules.prefetch_related("sources", "services")}
        for rule in spec.rules:
            if rule.id and rule.id not in existing:
                findings.add(
                    rule.path + "/id", "unknown-rule", f"Rule {rule.id} is not a rule of this ruleset."
                )
        resolved = [_resolve_rule(rule, findings) for rule in spec.rules]
        findings.raise_if_any()
        now = clock.now()
        kept = {rule.id for rule in spec.rules if rule.id}
        Rule.objects.filter(ruleset=ruleset).exclude(id__in=[uuid.UUID(i) for i in kept]).delete()
        for position, (rule, (sources, services)) in enumerate(zip(spec.rules, resolved, strict=True)):
            if rule.id:
                row = existing[rule.id]
                changed = (
                    row.position != position
                    or row.description != rule.description
                    or row.action != rule.action
                    or _current_rule_content(row) != _rule_content(sources, services)
                )
                if changed:
                    row.position, row.description, row.action = position, rule.description, rule.action
                    row.version += 1
                    row.updated_at = now
                    row.save()
                    _write_rule(row, sources, services)
            else:
                row = Rule.objects.create(
                    ruleset=ruleset,
                    number=_number_for(state, rule_numbers, spec.name, position),
                    position=position,
                    description=rule.description,
                    action=rule.action,
                    created_at=now,
                    updated_at=now,
                )
                _write_rule(row, sources, services)
        scope_before = ruleset.scope
        ruleset.name, ruleset.description = spec.name, spec.description
        ruleset.enabled, ruleset.scope, ruleset.direction = spec.enabled, spec.scope, spec.direction
        _audit("replace", ruleset, actor=actor, detail={"rules": len(spec.rules)}, audit_detail=audit_detail)
        ruleset.version += 1
        ruleset.updated_at = now
        _save_unique(ruleset)
        _policy_changed(state, scopes=[scope_before, ruleset.scope])
    return ruleset


def ruleset_delete(
    *, actor: Actor, ruleset_id: str, expected_version: str, audit_detail: Mapping[str, Any] | None = None
) -> None:
    _get(Ruleset, ruleset_id, "ruleset")
    with transaction.atomic():
        state = policy_lock()
        ruleset = locked_for_write(
            Ruleset.objects, pk=ruleset_id, expected_version=expected_version, what="ruleset"
        )
        _audit("delete", ruleset, actor=actor, audit_detail=audit_detail)
        ruleset.delete()
        _policy_changed(state, scopes=[ruleset.scope])


def _touch_ruleset(ruleset: Ruleset, now) -> None:
    Ruleset.objects.filter(id=ruleset.id).update(version=ruleset.version + 1, updated_at=now)


def rule_add(*, actor: Actor, ruleset_id: str, data: Mapping[str, Any]) -> Rule:
    spec = single_rule_input(data, direction=_get(Ruleset, ruleset_id, "ruleset").direction)
    with transaction.atomic():
        state = policy_lock()
        ruleset = Ruleset.objects.select_for_update().get(id=ruleset_id)
        findings = Findings()
        count = ruleset.rules.count()
        if count >= MAX_RULES_PER_RULESET:
            findings.add("", "too-many", f"A ruleset may have at most {MAX_RULES_PER_RULESET} rules.")
        sources, services = _resolve_rule(spec, findings)
        findings.raise_if_any()
        now = clock.now()
        last = ruleset.rules.order_by("-position").values_list("position", flat=True).first()
        rule = Rule.objects.create(
            ruleset=ruleset,
            number=_take_rule_number(state),
            position=0 if last is None else last + 1,
            description=spec.description,
            action=spec.action,
            created_at=now,
            updated_at=now,
        )
        _write_rule(rule, sources, services)
        _touch_ruleset(ruleset, now)
        _audit("create", rule, actor=actor, detail={"ruleset_id": str(ruleset.id)})
        _policy_changed(state, scopes=[ruleset.scope])
    return rule


def _rule_of(ruleset_id: str, rule_id: str) -> Rule:
    _get(Ruleset, ruleset_id, "ruleset")
    return get_or_not_found(
        Rule.objects.filter(ruleset_id=ruleset_id),
        rule_id,
        what="rule",
        detail=f"No rule {rule_id} in ruleset {ruleset_id}.",
    )


def rule_replace(
    *, actor: Actor, ruleset_id: str, rule_id: str, expected_version: str, data: Mapping[str, Any]
) -> Rule:
    spec = single_rule_input(data, direction=_rule_of(ruleset_id, rule_id).ruleset.direction)
    with transaction.atomic():
        state = policy_lock()
        rule = locked_for_write(
            Rule.objects.filter(ruleset_id=ruleset_id),
            pk=rule_id,
            expected_version=expected_version,
            what="rule",
        )
        findings = Findings()
        sources, services = _resolve_rule(spec, findings)
        findings.raise_if_any()
        now = clock.now()
        rule.description, rule.action = spec.description, spec.action
        _audit("replace", rule, actor=actor, detail={"ruleset_id": str(ruleset_id)})
        rule.version += 1
        rule.updated_at = now
        rule.save()
        _write_rule(rule, sources, services)
        ruleset = Ruleset.objects.select_for_update().get(id=ruleset_id)
        _touch_ruleset(ruleset, now)
        _policy_changed(state, scopes=[ruleset.scope])
    return rule


def rule_delete(*, actor: Actor, ruleset_id: str, rule_id: str, expected_version: str) -> None:
    _rule_of(ruleset_id, rule_id)
    with transaction.atomic():
        state = policy_lock()
        rule = locked_for_write(
            Rule.objects.filter(ruleset_id=ruleset_id),
            pk=rule_id,
            expected_version=expected_version,
            what="rule",
        )
        _audit("delete", rule, actor=actor, detail={"ruleset_id": str(ruleset_id)})
        rule.delete()
        ruleset = Ruleset.objects.select_for_update().get(id=ruleset_id)
        _touch_ruleset(ruleset, clock.now())
        _policy_changed(state, scopes=[ruleset.scope])
