"""The audit trail: every operator write records who, what, which object and the version before and
after, in the same transaction as the write (so a refused or rolled-back write records nothing).

Read with `GET /audit-events` and `manage.py audit`; no endpoint or command changes or deletes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.db import transaction

from controlplane import clock
from controlplane.auth.actor import Actor
from controlplane.models import AuditEvent
from controlplane.pagination import OrderKey, Page, list_fingerprint, paginate
from controlplane.problems import Finding, ValidationFailed
from controlplane.validation import parse_instant

AUDIT_ORDER = (OrderKey("at", descending=True), OrderKey("id", descending=True))
OBJECT_TYPES = (
    "ruleset",
    "rule",
    "service",
    "address_group",
    "workload",
    "mode_change",
    "operator_token",
    "provisioning_token",
    "operator",
    "webhook",
)


def audit_record(
    *,
    actor: Actor,
    action: str,
    object_type: str,
    object_id: Any,
    object_name: str = "",
    version_before: Any = "",
    version_after: Any = "",
    detail: Mapping[str, Any] | None = None,
) -> AuditEvent:
    """Record one write; call it inside the write's transaction."""
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("audit_record must run inside the transaction of the write it records")
    return AuditEvent.objects.create(
        at=clock.now(),
        actor_kind=actor.kind,
        actor=actor.label[:300],
        actor_token_id=actor.token_id,
        action=action,
        object_type=object_type,
        object_id=str(object_id),
        object_name=str(object_name)[:300],
        version_before="" if version_before is None else str(version_before),
        version_after="" if version_after is None else str(version_after),
        detail=dict(detail or {}),
    )


def _instant(raw: str | None, name: str, findings: list[Finding]) -> datetime | None:
    if raw in (None, ""):
        return None
    parsed = parse_instant(raw)
    if parsed is None:
        findings.append(Finding(f"?{name}", "instant", f"{name} is not an RFC 3339 instant with an offset."))
    return parsed


def audit_events_list(
    *,
    object_type: str | None = None,
    object_id: str | None = None,
    since: str | None = None,
    until: str | None = None,
    cursor: str | None,
    limit: int,
) -> Page:
    """Newest first. `since` is inclusive, `until` exclusive; both RFC 3339 instants."""
    findings: list[Finding] = []
    if object_type not in (None, "") and object_type not in OBJECT_TYPES:
        findings.append(
            Finding("?object_type", "object-type", f"object_type is one of {', '.join(OBJECT_TYPES)}.")
        )
    if object_id is not None and len(object_id) > 64:
        findings.append(Finding("?object_id", "too-long", "object_id is at most 64 characters."))
    start, end = _instant(since, "since", findings), _instant(until, "until", findings)
    if findings:
        raise ValidationFailed(findings)
    events = AuditEvent.objects.all()
    if object_type:
        events = events.filter(object_type=object_type)
    if object_id:
        events = events.filter(object_id=object_id)
    if start is not None:
        events = events.filter(at__gte=start)
    if end is not None:
        events = events.filter(at__lt=end)
    filters = {
        "object_type": object_type or "",
        "object_id": object_id or "",
        "since": since or "",
        "until": until or "",
    }
    return paginate(
        events,
        order=AUDIT_ORDER,
        cursor=cursor,
        limit=limit,
        fingerprint=list_fingerprint("audit-events", filters),
    )


def audit_event_data(event: AuditEvent) -> dict[str, Any]:
    return {
        "id": str(event.id),
        "at": clock.rfc3339(event.at),
        "actor": {
            "kind": event.actor_kind,
            "label": event.actor,
            "token_id": str(event.actor_token_id) if event.actor_token_id else None,
        },
        "action": event.action,
        "object": {"type": event.object_type, "id": event.object_id, "name": event.object_name},
        "version_before": event.version_before or None,
        "version_after": event.version_after or None,
        "detail": event.detail,
    }
