"""Reads of webhooks and their delivery attempts, and their JSON shapes (the API's and the CLI's)."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, Min

from controlplane import clock
from controlplane.lookups import get_or_not_found
from controlplane.pagination import OrderKey, Page, list_fingerprint, paginate
from controlplane.webhooks.models import Webhook, WebhookAttempt, WebhookDelivery

WEBHOOK_ORDER = (OrderKey("created_at"), OrderKey("id", read=lambda w: str(w.id)))
ATTEMPT_ORDER = (OrderKey("at", descending=True), OrderKey("id", descending=True))


def webhook_list(*, cursor: str | None, limit: int) -> Page:
    return paginate(
        Webhook.objects.all(),
        order=WEBHOOK_ORDER,
        cursor=cursor,
        limit=limit,
        fingerprint=list_fingerprint("webhooks", {}),
    )


def webhook_get(*, webhook_id: Any) -> Webhook:
    return get_or_not_found(Webhook, webhook_id, what="webhook")


def webhook_attempts_list(*, webhook_id: Any, cursor: str | None, limit: int) -> Page:
    """Its delivery attempts, newest first."""
    webhook = webhook_get(webhook_id=webhook_id)
    return paginate(
        WebhookAttempt.objects.filter(webhook_id=webhook.id),
        order=ATTEMPT_ORDER,
        cursor=cursor,
        limit=limit,
        fingerprint=list_fingerprint("webhook-deliveries", {"webhook": str(webhook.id)}),
    )


def webhook_backlogs(webhooks: list[Webhook]) -> dict[Any, dict[str, Any]]:
    """Each webhook's pending deliveries and the oldest one's creation, in one grouped read."""
    rows = (
        WebhookDelivery.objects.filter(webhook__in=webhooks, state=WebhookDelivery.PENDING)
        .values("webhook_id")
        .annotate(pending=Count("id"), oldest=Min("created_at"))
    )
    found = {row["webhook_id"]: row for row in rows}
    backlogs = {}
    for webhook in webhooks:
        row = found.get(webhook.id, {"pending": 0, "oldest": None})
        backlogs[webhook.id] = {
            "pending": row["pending"],
            "oldest_pending_since": clock.rfc3339(row["oldest"]),
        }
    return backlogs


def webhook_data(webhook: Webhook, *, backlog: dict[str, Any] | None = None) -> dict[str, Any]:
    """Never the secret: it is shown once, at creation."""
    data: dict[str, Any] = {
        "id": str(webhook.id),
        "url": webhook.url,
        "events": list(webhook.events),
        "description": webhook.description,
        "created_at": clock.rfc3339(webhook.created_at),
    }
    if backlog is not None:
        data["deliveries"] = backlog
    return data


def webhooks_data(webhooks: list[Webhook]) -> list[dict[str, Any]]:
    """A page of webhooks with their backlogs."""
    backlogs = webhook_backlogs(webhooks)
    return [webhook_data(w, backlog=backlogs[w.id]) for w in webhooks]


def webhook_detail_data(webhook: Webhook) -> dict[str, Any]:
    return webhooks_data([webhook])[0]


def attempt_data(attempt: WebhookAttempt) -> dict[str, Any]:
    return {
        "id": str(attempt.id),
        "event": {"id": attempt.event_id, "type": attempt.event_type},
        "attempt": attempt.number,
        "at": clock.rfc3339(attempt.at),
        "duration_ms": attempt.duration_ms,
        "status_code": attempt.status_code,
        "error": attempt.error or None,
        "outcome": attempt.outcome,
        "next_attempt_at": clock.rfc3339(attempt.next_attempt_at),
    }
