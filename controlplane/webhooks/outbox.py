"""The outbox: `webhook_event_record` writes an event, and its delivery to every webhook subscribed to
its type, inside the transaction of the state change that causes it. A rolled-back change leaves no
event; a committed one cannot lose its event to a crash. No signals: each state change calls it.

Event types and the shape of their `data` are documented in docs/webhooks.md (`EVENT_TYPES` is the
vocabulary a webhook may subscribe to)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connection, transaction

from controlplane import clock
from controlplane.webhooks.models import Webhook, WebhookDelivery, WebhookEvent, WebhookWatermark

FLEET_ORDER = "fleet-events"  # the row fleet-wide events' writers lock (made by migration 0002)

EVENT_TYPES = (
    "workload.degraded",
    "workload.enforcement_removed",
    "workload.enforcement_restored",
    "workload.offline",
    "workload.credential_expired",
    "workload.credential_renewal_failed",
    "workload.evidence_gap",
    "workload.clock_skew",
    "mode_change.requested",
    "webhook.created",
    "webhook.deleted",
)


@dataclass(frozen=True)
class Event:
    type: str
    data: Mapping[str, Any]
    # Events of one workload are delivered in order; None: a fleet-wide event (ordered among themselves).
    workload_id: Any = None
    id: str = field(default_factory=lambda: f"evt_{uuid.uuid4().hex}")


def workload_ref(workload: Any) -> dict[str, Any]:
    """How an event names its workload: enough to route an alert without a read back."""
    return {"id": str(workload.id), "hostname": workload.hostname, "labels": dict(workload.labels)}


def workload_event(type: str, workload: Any, **data: Any) -> Event:
    return Event(type=type, data={"workload": workload_ref(workload), **data}, workload_id=workload.id)


def webhook_event_record(type: str, data: Mapping[str, Any], *, workload_id: Any = None) -> None:
    webhook_events_record([Event(type=type, data=data, workload_id=workload_id)])


def fleet_events_turn() -> None:
    """Wait for this transaction's turn among writers of fleet-wide events (mode changes, webhook
    writes), so that an event numbered later cannot commit, and be sent, before one numbered earlier
    (a workload's events are ordered by the workload's row lock, which each of its state changes holds).
    Taken before any webhook row, by every writer, so that the two kinds of locks never cross."""
    WebhookWatermark.objects.select_for_update().filter(name=FLEET_ORDER).first()


def _webhooks_held() -> list[tuple[uuid.UUID, list[str]]]:
    """The webhooks and the types they subscribe to. On PostgreSQL their rows are held FOR KEY SHARE
    to the end of the transaction: a concurrent delete waits for it (or, first, is not seen), so it can
    never leave this state change a delivery to a webhook that is gone (which would fail the change)."""
    if connection.vendor != "postgresql":
        return list(Webhook.objects.values_list("id", "events"))
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT "id", "events" FROM "{Webhook._meta.db_table}" FOR KEY SHARE')  # noqa: S608
        return [(uuid.UUID(str(i)), json.loads(e) if isinstance(e, str) else e) for i, e in cursor.fetchall()]


def webhook_events_record(events: Iterable[Event]) -> int:
    """Write `events` to the outbox with a delivery to each subscribed webhook; call it inside the
    transaction of the state change. An event no webhook subscribes to is not written (nobody could
    receive it: a webhook created later does not get older events). Returns the deliveries written."""
    events = list(events)
    if not events:
        return 0
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("webhook events must be recorded inside the transaction of their state change")
    for event in events:
        if event.type not in EVENT_TYPES:
            raise ValueError(f"unknown webhook event type {event.type!r}")
    if any(event.workload_id is None for event in events):
        fleet_events_turn()
    subscribers: dict[str, list[uuid.UUID]] = {}
    for webhook_id, types in _webhooks_held():
        for type in types:
            subscribers.setdefault(type, []).append(webhook_id)
    wanted = [event for event in events if subscribers.get(event.type)]
    if not wanted:
        return 0
    now = clock.now()
    deliveries = []
    for event in wanted:
        row = WebhookEvent.objects.create(
            id=event.id,
            type=event.type,
            workload_id=event.workload_id,
            occurred_at=now,
            data=dict(event.data),
        )
        order_key = str(event.workload_id) if event.workload_id is not None else ""
        deliveries.extend(
            WebhookDelivery(
                webhook_id=webhook_id,
                event=row,
                event_seq=row.seq,
                order_key=order_key,
                created_at=now,
                next_attempt_at=now,
            )
            for webhook_id in subscribers[event.type]
        )
    WebhookDelivery.objects.bulk_create(deliveries)
    return len(deliveries)
