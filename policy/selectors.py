"""Reads of authored policy."""

from __future__ import annotations

import uuid

from django.db.models import Prefetch, QuerySet

from controlplane.problems import Problem
from policy.models import AddressGroup, PolicyState, Rule, Ruleset, Service


def policy_version() -> int:
    state = PolicyState.objects.filter(id=1).first()
    return state.version if state else 1


def _rules() -> Prefetch:
    return Prefetch(
        "rules", queryset=Rule.objects.prefetch_related("sources", "services").order_by("position")
    )


def ruleset_queryset() -> QuerySet:
    return Ruleset.objects.prefetch_related(_rules()).order_by("name")


def _one(queryset: QuerySet, object_id: str, what: str):
    try:
        key = uuid.UUID(str(object_id))
    except ValueError:
        key = None
    obj = queryset.filter(id=key).first() if key else None
    if obj is None:
        raise Problem("not-found", f"No {what} {object_id}.")
    return obj


def ruleset_list() -> list[Ruleset]:
    return list(ruleset_queryset())


def ruleset_get(*, ruleset_id: str) -> Ruleset:
    return _one(ruleset_queryset(), ruleset_id, "ruleset")


def rule_get(*, ruleset_id: str, rule_id: str) -> Rule:
    ruleset_get(ruleset_id=ruleset_id)
    return _one(
        Rule.objects.filter(ruleset_id=ruleset_id).prefetch_related("sources", "services"),
        rule_id,
        f"rule in ruleset {ruleset_id}:",
    )


def service_list() -> list[Service]:
    return list(Service.objects.prefetch_related("entries").order_by("name"))


def service_get(*, service_id: str) -> Service:
    return _one(Service.objects.prefetch_related("entries"), service_id, "service")


def address_group_list() -> list[AddressGroup]:
    return list(AddressGroup.objects.order_by("name"))


def address_group_get(*, group_id: str) -> AddressGroup:
    return _one(AddressGroup.objects.all(), group_id, "address group")
