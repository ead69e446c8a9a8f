"""Webhook writes (create, delete) for the API and `manage.py webhook`, and the pruning of finished
deliveries. Each write is audited and is itself an event (`webhook.created`, `webhook.deleted`), so
nobody can silence alerts unseen."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from django.db import transaction

from controlplane import clock
from controlplane.audit import audit_record
from controlplane.auth.actor import Actor
from controlplane.lookups import get_or_not_found
from controlplane.validation import Findings, quoted, reject_unknown, require_object, take_string
from controlplane.webhooks.destinations import Refused, url_check
from controlplane.webhooks.models import (
    Webhook,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEvent,
)
from controlplane.webhooks.outbox import (
    EVENT_TYPES,
    Event,
    fleet_events_turn,
    webhook_events_record,
)

MAX_WEBHOOKS = 50
MAX_URL = 2000
URL_LOOKUP_SECONDS = 5  # a URL's host name lookup when a webhook is created
SECRET_PREFIX = "whsec_"  # noqa: S105 - the Standard Webhooks prefix, not a secret


@dataclass(frozen=True)
class WebhookInput:
    url: str
    events: list[str]
    description: str


def _url_input(data: Mapping[str, Any], findings: Findings) -> str:
    """The URL, checked where the sender may go (controlplane/webhooks/destinations.py): its host
    resolved and every address checked, as each delivery checks them again."""
    url = take_string(data, "url", findings, min_length=1, max_length=MAX_URL)
    if not url or findings:
        return url
    try:
        url_check(url, lookup_seconds=URL_LOOKUP_SECONDS)
    except Refused as refused:
        findings.add("/url", refused.rule, refused.reason)
    return url


def _events_input(data: Mapping[str, Any], findings: Findings) -> list[str]:
    if "events" not in data or data["events"] is None:
        findings.add("/events", "required", "events is required: the event types this webhook receives.")
        return []
    raw = data["events"]
    if not isinstance(raw, list):
        findings.add("/events", "type", "events must be a list of event types.")
        return []
    if not raw:
        findings.add("/events", "empty", "events must name at least one event type.")
    chosen: list[str] = []
    for index, value in enumerate(raw):
        if not isinstance(value, str):
            findings.add(f"/events/{index}", "type", "An event type is a string.")
        elif value not in EVENT_TYPES:
            findings.add(
                f"/events/{index}",
                "event-type",
                f"{quoted(value)} is not an event type; they are {', '.join(EVENT_TYPES)}.",
            )
        elif value in chosen:
            findings.add(f"/events/{index}", "duplicate-event-type", f"{value} is listed twice.")
        else:
            chosen.append(value)
    return chosen


def webhook_input(data: Any) -> WebhookInput:
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, {"url", "events", "description", "id", "created_at"}, findings)
    url = _url_input(data, findings)
    events = _events_input(data, findings)
    description = take_string(data, "description", findings, required=False, max_length=1000)
    findings.raise_if_any()
    return WebhookInput(url=url, events=events, description=description.strip())


def new_signing_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


@dataclass(frozen=True)
class CreatedWebhook:
    webhook: Webhook
    secret: str


def webhook_ref(webhook: Webhook) -> dict[str, Any]:
    """How events name a webhook: the URL's origin only, since many receivers carry their own secret
    in the path (e.g. chat services' incoming-webhook URLs) and events go to other receivers."""
    parts = urlsplit(webhook.url)
    return {
        "id": str(webhook.id),
        "origin": f"{parts.scheme}://{parts.netloc}",
        "events": list(webhook.events),
        "description": webhook.description,
    }


def webhook_create(*, actor: Actor, data: Any) -> CreatedWebhook:
    spec = webhook_input(data)
    secret = new_signing_secret()
    with transaction.atomic():
        fleet_events_turn()  # webhook writes take turns (and count the webhooks in their turn)
        if Webhook.objects.count() >= MAX_WEBHOOKS:
            findings = Findings()
            findings.add("", "too-many", f"At most {MAX_WEBHOOKS} webhooks; delete one first.")
            findings.raise_if_any()
        webhook = Webhook.objects.create(
            url=spec.url,
            events=spec.events,
            description=spec.description,
            secret=secret,
            created_at=clock.now(),
        )
        audit_record(
            actor=actor,
            action="webhook.create",
            object_type="webhook",
            object_id=webhook.id,
            object_name=webhook.url,
            detail={"events": spec.events, "description": spec.description},
        )
        # Delivered to the new webhook too when it subscribes: a first event to check the receiver.
        webhook_events_record(
            [Event(type="webhook.created", data={"webhook": webhook_ref(webhook), "actor": actor.label})]
        )
    return CreatedWebhook(webhook=webhook, secret=secret)


def webhook_delete(*, actor: Actor, webhook_id: str) -> Webhook:
    """Delete the webhook with its pending deliveries and their history; the other webhooks subscribed
    to `webhook.deleted` are told."""
    with transaction.atomic():
        fleet_events_turn()  # before any webhook row: two deletes cannot wait for each other's rows
        # The webhook's row first: new deliveries to it wait (the outbox reads webhooks FOR KEY SHARE).
        # Then its deliveries: a sender holding some finishes its attempts first, and sends no more.
        webhook = get_or_not_found(Webhook, webhook_id, what="webhook", for_update=True)
        list(WebhookDelivery.objects.select_for_update().filter(webhook=webhook).values_list("id", flat=True))
        ref, webhook_pk = webhook_ref(webhook), webhook.id
        WebhookAttempt.objects.filter(webhook_id=webhook_pk).delete()
        WebhookDelivery.objects.filter(webhook=webhook).delete()
        webhook.delete()
        webhook.id = webhook_pk
        audit_record(
            actor=actor,
            action="webhook.delete",
            object_type="webhook",
            object_id=webhook_pk,
            object_name=webhook.url,
            detail={"events": ref["events"], "description": ref["description"]},
        )
        webhook_events_record([Event(type="webhook.deleted", data={"webhook": ref, "actor": actor.label})])
    return webhook


@dataclass(frozen=True)
class Pruned:
    deliveries: int
    events: int


def webhook_deliveries_prune(*, older_than: timedelta) -> Pruned:
    """Finished deliveries (with their attempts) older than `older_than`, and events none waits for."""
    cutoff = clock.now() - older_than
    with transaction.atomic():
        WebhookAttempt.objects.filter(at__lt=cutoff, delivery__finished_at__lt=cutoff).delete()
        deliveries, _ = (
            WebhookDelivery.objects.filter(finished_at__lt=cutoff)
            .exclude(state=WebhookDelivery.PENDING)
            .delete()
        )
        # Cascades remove the deliveries of a deleted webhook; an event without any delivery left
        # (all finished and pruned, or its webhooks deleted) has nothing more to do.
        events, _ = (
            WebhookEvent.objects.filter(occurred_at__lt=cutoff)
            .exclude(seq__in=WebhookDelivery.objects.values("event_seq"))
            .delete()
        )
    return Pruned(deliveries=deliveries, events=events)
