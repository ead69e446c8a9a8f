"""The one operator, its sessions and tokens, and the login throttle. Only digests of secrets are kept."""

import uuid

from django.db import models


class Operator(models.Model):
    """There is exactly one operator (row id 1); it exists once a password has been set on the host."""

    password_hash = models.CharField(max_length=255)
    password_changed_at = models.DateTimeField()


class OperatorSession(models.Model):
    key_digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)
    client = models.CharField(max_length=64, blank=True)


class OperatorToken(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16)
    digest = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField()
    last_used_at = models.DateTimeField(null=True)
    expires_at = models.DateTimeField(null=True)
    revoked_at = models.DateTimeField(null=True)

    class Meta:
        indexes = [models.Index(fields=["created_at", "id"], name="operator_token_order")]


class LoginThrottle(models.Model):
    """Counted login attempts of one client address, and until when it must wait. The row of client
    "*" is the budget of all addresses together: its count in the window that ends at `locked_until`."""

    client = models.CharField(max_length=64, primary_key=True)
    failures = models.PositiveIntegerField(default=0)
    last_failure_at = models.DateTimeField()
    locked_until = models.DateTimeField(null=True)
