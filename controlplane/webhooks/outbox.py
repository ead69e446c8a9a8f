"""The outbox: `webhook_event_record` writes an event, and its delivery to every webhook subscribed to
its type, inside the transaction of the state change that causes it. A rolled-back change leaves no
event; a committed one cannot lose its event to a crash. No signals: each state change calls it.

Event types and the shape of their `data` are documented in docs/webhooks.md (`EVENT_TYPES` is the
vocabulary a webhook may subscribe to)."""

from __future__ import annotations

import json
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connection, transaction
from django.db.models import Min

from controlplane import clock
from controlplane.webhooks.models import Webhook, WebhookDelivery, WebhookEvent, WebhookWatermark

FLEET_ORDER = "fleet-events"  # the row fleet-wide events' writers lock (made by migration 0002)

EVENT_TYPES = (
    "workload.degraded",
    "workload.enforcement_removed",
    "workload.enforcement_restored",
    "workload.table_modified",
    "workload.offline",
    "workload.credential_expired",
    "workload.credential_renewal_failed",
    "workload.evidence_gap",
    "workload.clock_skew",
    "mode_change.requested",
    "mode_change.reverted",
    "webhook.created",
    "webhook.deleted",
)

# Events an agent can cause over and over at will (a flow report carries up to 500 gaps; a stream can
# be dropped and reopened, a table removed and restored, a renewal failed, again and again): per
# webhook, a pending delivery of one of these is superseded by the next event of the same workload and
# type, which carries how many events it stands for. Operators' events (mode changes, webhook writes)
# and a credential's expiry (once per credential) are each delivered.
COALESCED_TYPES = frozenset(
    {
        "workload.degraded",
        "workload.enforcement_removed",
        "workload.enforcement_restored",
        "workload.table_modified",
        "workload.offline",
        "workload.credential_renewal_failed",
        "workload.evidence_gap",
        "workload.clock_skew",
    }
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
    Taken before any webhook row, by every writer, so that the two kinds of locks never cross. The row
    is made again if it is missing (a flushed database), since locking no row would order nothing."""
    WebhookWatermark.objects.select_for_update().get_or_create(name=FLEET_ORDER, defaults={"at": clock.now()})


def _webhooks_held() -> list[tuple[uuid.UUID, list[str]]]:
    """The webhooks and the types they subscribe to. On PostgreSQL their rows are held FOR KEY SHARE
    to the end of the transaction: a concurrent delete waits for it (or, first, is not seen), so it can
    never leave this state change a delivery to a webhook that is gone (which would fail the change)."""
    if connection.vendor != "postgresql":
        return list(Webhook.objects.values_list("id", "events"))
    with connection.cursor() as cursor:
        cursor.execute(f'SELECT "id", "events" FROM "{Webhook._meta.db_table}" FOR KEY SHARE')  # noqa: S608
        return [(uuid.UUID(str(i)), json.loads(e) if isinstance(e, str) else e) for i, e in cursor.fetchall()]


def coalescable(event: Event) -> bool:
    return event.type in COALESCED_TYPES and event.workload_id is not None


def _coalesced_in_batch(events: list[Event]) -> list[tuple[Event, int]]:
    """The batch with each coalescable (workload, type) kept once, at its last event's place, with the
    number of events it stands for; other events as they are."""
    totals = Counter((event.workload_id, event.type) for event in events if coalescable(event))
    seen: Counter = Counter()
    kept = []
    for event in events:
        if not coalescable(event):
            kept.append((event, 1))
            continue
        key = (event.workload_id, event.type)
        seen[key] += 1
        if seen[key] == totals[key]:
            kept.append((event, totals[key]))
    return kept


def _supersede(events: list[Event], now: Any) -> dict[tuple[Any, str, str], tuple[int, Any]]:
    """Close as superseded, for the workloads and types of the batch's coalescable events, the pending
    deliveries no sender can be holding: those that are not the first pending one of their webhook
    and workload (a sender only ever takes that one). On PostgreSQL they are locked SKIP LOCKED, so a
    delivery a sender has just taken (it became the first meanwhile) is left to it, and nobody waits.
    Returns, per (webhook, workload, type), how many events they stood for and since when."""
    keys = {str(event.workload_id) for event in events if coalescable(event)}
    types = {event.type for event in events if coalescable(event)}
    if not keys:
        return {}
    candidates = WebhookDelivery.objects.filter(
        state=WebhookDelivery.PENDING, order_key__in=keys, event__type__in=types
    )
    if connection.features.has_select_for_update_skip_locked:
        candidates = candidates.select_for_update(skip_locked=True, of=("self",))
    rows = list(
        candidates.values_list(
            "id", "webhook_id", "order_key", "event_seq", "event__type", "coalesced_count", "coalesced_since",
            "created_at",
        )
    )  # fmt: skip
    if not rows:
        return {}
    firsts = dict(
        ((webhook_id, order_key), seq)
        for webhook_id, order_key, seq in WebhookDelivery.objects.filter(
            state=WebhookDelivery.PENDING, order_key__in=keys
        )
        .values("webhook_id", "order_key")
        .annotate(first=Min("event_seq"))
        .values_list("webhook_id", "order_key", "first")
    )
    superseded: dict[tuple[Any, str, str], tuple[int, Any]] = {}
    ids = []
    for id, webhook_id, order_key, seq, type, count, since, created_at in rows:
        if firsts.get((webhook_id, order_key)) == seq:
            continue
        ids.append(id)
        key = (webhook_id, order_key, type)
        before_count, before_since = superseded.get(key, (0, since or created_at))
        superseded[key] = (before_count + count, min(before_since, since or created_at))
    WebhookDelivery.objects.filter(id__in=ids).update(state=WebhookDelivery.SUPERSEDED, finished_at=now)
    return superseded


def webhook_events_record(events: Iterable[Event]) -> int:
    """Write `events` to the outbox with a delivery to each subscribed webhook; call it inside the
    transaction of the state change. An event no webhook subscribes to is not written (nobody could
    receive it: a webhook created later does not get older events). Events agents can cause in floods
    (`COALESCED_TYPES`) are coalesced per workload and type: within the batch, and with the pending
    deliveries no sender holds yet, into one delivery carrying the count (docs/webhooks.md). Returns
    the deliveries written."""
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
    wanted = [(event, count) for event, count in _coalesced_in_batch(events) if subscribers.get(event.type)]
    if not wanted:
        return 0
    now = clock.now()
    superseded = _supersede([event for event, _ in wanted], now)
    deliveries = []
    for event, batch_count in wanted:
        row = WebhookEvent.objects.create(
            id=event.id,
            type=event.type,
            workload_id=event.workload_id,
            occurred_at=now,
            data=dict(event.data),
        )
        order_key = str(event.workload_id) if event.workload_id is not None else ""
        for webhook_id in subscribers[event.type]:
            earlier_count, since = superseded.get((webhook_id, order_key, event.type), (0, now))
            count = batch_count + earlier_count
            deliveries.append(
                WebhookDelivery(
                    webhook_id=webhook_id,
                    event=row,
                    event_seq=row.seq,
                    order_key=order_key,
                    created_at=now,
                    next_attempt_at=now,
                    coalesced_count=count,
                    coalesced_since=min(since, now) if count > 1 else None,
                )
            )
    WebhookDelivery.objects.bulk_create(deliveries)
    return len(deliveries)
