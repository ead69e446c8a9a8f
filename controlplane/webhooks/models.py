"""Webhooks, the outbox of events and the deliveries of each event to each webhook.

The outbox row is written in the transaction of the state change that causes it
(controlplane/webhooks/outbox.py), together with one delivery row per subscribed webhook; the sender
(controlplane/webhooks/sender.py) works only from these tables, so nothing lives in a process."""

import uuid

from django.db import models
from django.db.models import Q


class Webhook(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    url = models.CharField(max_length=2000)
    description = models.CharField(max_length=1000, blank=True)
    events = models.JSONField(default=list)  # the event types it subscribes to
    # The Standard Webhooks signing key (`whsec_` + base64). It is a symmetric HMAC key: the sender needs
    # it as it is, so it is stored as it is (docs/webhooks.md says why and what protects it).
    secret = models.CharField(max_length=200)
    created_at = models.DateTimeField()

    class Meta:
        indexes = [models.Index(fields=["created_at", "id"], name="webhook_order")]


class WebhookEvent(models.Model):
    """One event of the outbox. `seq` orders events as their transactions wrote them (per workload, a
    later state change of the same workload commits after an earlier one: its row is locked)."""

    seq = models.BigAutoField(primary_key=True)
    id = models.CharField(max_length=40, unique=True)  # evt_..., the webhook-id receivers dedupe on
    type = models.CharField(max_length=64)
    workload_id = models.UUIDField(null=True)
    occurred_at = models.DateTimeField()
    data = models.JSONField(default=dict)

    class Meta:
        indexes = [models.Index(fields=["occurred_at"], name="webhook_event_occurred")]


class WebhookDelivery(models.Model):
    """An event to one webhook: pending until delivered or given up, or superseded by a later event of
    the same workload and type that carries its count (controlplane/webhooks/outbox.py)."""

    PENDING, DELIVERED, GAVE_UP, SUPERSEDED = "pending", "delivered", "gave_up", "superseded"
    STATES = [(PENDING, PENDING), (DELIVERED, DELIVERED), (GAVE_UP, GAVE_UP), (SUPERSEDED, SUPERSEDED)]

    id = models.BigAutoField(primary_key=True)
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="+")
    event = models.ForeignKey(WebhookEvent, on_delete=models.CASCADE, related_name="+")
    # Copies of the event's seq and ordering key (the workload, "" for fleet-wide events), so that
    # "is an earlier delivery of this key still pending" is one index probe.
    event_seq = models.BigIntegerField()
    order_key = models.CharField(max_length=36, blank=True)
    state = models.CharField(max_length=16, choices=STATES, default=PENDING)
    attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField()
    next_attempt_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True)
    # How many events this delivery stands for (itself and those it superseded), and when the first
    # of them happened (null: it stands for itself alone).
    coalesced_count = models.PositiveIntegerField(default=1)
    coalesced_since = models.DateTimeField(null=True)

    class Meta:
        indexes = [
            models.Index(
                fields=["webhook", "order_key", "event_seq"],
                name="webhook_delivery_pending",
                condition=Q(state="pending"),
            ),
            models.Index(
                fields=["next_attempt_at"], name="webhook_delivery_due", condition=Q(state="pending")
            ),
            models.Index(fields=["finished_at"], name="webhook_delivery_finished"),
        ]


class WebhookAttempt(models.Model):
    """One HTTP attempt of a delivery: what `GET /webhooks/{id}/deliveries` lists."""

    DELIVERED, RETRYING, GAVE_UP = "delivered", "retrying", "gave_up"

    id = models.BigAutoField(primary_key=True)
    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="+")
    # Not a foreign key: a sender recording an attempt must not need the webhook row's lock, which a
    # delete holds while it waits for that sender's deliveries (services.webhook_delete).
    webhook_id = models.UUIDField()
    event_id = models.CharField(max_length=40)
    event_type = models.CharField(max_length=64)
    number = models.PositiveIntegerField()  # 1 for the first attempt of the delivery
    at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField()
    status_code = models.PositiveSmallIntegerField(null=True)  # null: no HTTP answer
    error = models.CharField(max_length=500, blank=True)
    outcome = models.CharField(max_length=16)
    next_attempt_at = models.DateTimeField(null=True)

    class Meta:
        indexes = [models.Index(fields=["webhook_id", "at", "id"], name="webhook_attempt_order")]


class WebhookWatermark(models.Model):
    """How far a periodic noticing step has looked (credential expiries): one row per step, locked
    while it runs, so that several serve processes notice each expiry once."""

    name = models.CharField(max_length=40, primary_key=True)
    at = models.DateTimeField()
