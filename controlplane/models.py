"""What the running service says about itself, for commands run outside `serve` (e.g. minting a
provisioning token needs the gateway address and certificate fingerprint that `serve` uses)."""

from django.db import models


class GatewayIdentity(models.Model):
    """One row, written by `serve` at every start: the gateway agents are given, and the flow retention
    serve prunes by (so that `manage.py flows` states the same coverage as the API)."""

    address = models.CharField(max_length=300)  # the first of `addresses`
    addresses = models.JSONField(default=list)  # every advertised gateway, in order
    fingerprint = models.CharField(max_length=200)
    flow_retention_days = models.PositiveIntegerField(null=True)  # null: recorded before it was
    updated_at = models.DateTimeField()


class AuditEvent(models.Model):
    """One operator write: who, what, which object, and its version before and after. Written in the
    transaction of the write it records (controlplane/audit.py); nothing changes or deletes it."""

    id = models.BigAutoField(primary_key=True)
    at = models.DateTimeField()
    actor_kind = models.CharField(max_length=16)  # session, token, cli, agent (an enrolment) or system
    actor = models.CharField(max_length=300)  # e.g. "token deploy-bot (pal_op_Ab12)", "host: manage.py ..."
    actor_token_id = models.UUIDField(null=True)
    action = models.CharField(max_length=40)  # e.g. "service.replace", "mode_change.create"
    object_type = models.CharField(max_length=40)
    object_id = models.CharField(max_length=64)
    object_name = models.CharField(max_length=300, blank=True)
    version_before = models.CharField(max_length=80, blank=True)
    version_after = models.CharField(max_length=80, blank=True)
    detail = models.JSONField(default=dict)

    class Meta:
        indexes = [
            models.Index(fields=["at", "id"], name="audit_event_order"),
            models.Index(fields=["object_type", "object_id", "at"], name="audit_event_object"),
        ]
