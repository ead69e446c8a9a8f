"""Writes of operator authentication: the password, sessions, operator tokens and the login throttle."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from django.conf import settings
from django.db import connection, transaction

from controlplane import clock
from controlplane.audit import audit_record
from controlplane.auth.actor import Actor
from controlplane.auth.models import LoginThrottle, Operator, OperatorSession, OperatorToken
from controlplane.auth.secrets import (
    OPERATOR_TOKEN_PREFIX,
    SESSION_PREFIX,
    digest,
    display_prefix,
    new_secret,
)
from controlplane.lookups import get_or_not_found
from controlplane.problems import Finding, Problem, ValidationFailed
from controlplane.validation import Findings, reject_unknown, require_object, take_instant, take_string

PASSWORD_MIN_LENGTH = 12
PASSWORD_MAX_LENGTH = 1024
_hasher = PasswordHasher()
# Verifying against this when no operator exists keeps a wrong password as slow as a right one.
_DUMMY_HASH = _hasher.hash("palisade-no-operator-yet")


def operator_set_password(*, actor: Actor, password: str) -> None:
    """Set or reset the one operator's password; every open session ends (tokens stay valid)."""
    if len(password) < PASSWORD_MIN_LENGTH:
        raise ValidationFailed(
            [
                Finding(
                    "/password", "too-short", f"The password needs at least {PASSWORD_MIN_LENGTH} characters."
                )
            ]
        )
    if len(password) > PASSWORD_MAX_LENGTH:
        raise ValidationFailed(
            [
                Finding(
                    "/password",
                    "too-long",
                    f"The password may have at most {PASSWORD_MAX_LENGTH} characters.",
                )
            ]
        )
    hashed = _hasher.hash(password)
    with transaction.atomic():
        Operator.objects.update_or_create(
            id=1, defaults={"password_hash": hashed, "password_changed_at": clock.now()}
        )
        OperatorSession.objects.all().delete()
        audit_record(
            actor=actor,
            action="operator.set_password",
            object_type="operator",
            object_id=1,
            detail={"sessions_ended": True},
        )


@dataclass(frozen=True)
class OpenedSession:
    secret: str
    expires_at: datetime


def _throttle_wait(client: str, now: datetime) -> int:
    row = LoginThrottle.objects.filter(client=client).first()
    if row is None or row.locked_until is None or row.locked_until <= now:
        return 0
    return max(1, math.ceil((row.locked_until - now).total_seconds()))


def _record_failure(client: str, now: datetime) -> None:
    with transaction.atomic():
        row, _ = LoginThrottle.objects.select_for_update().get_or_create(
            client=client, defaults={"failures": 0, "last_failure_at": now}
        )
        row.failures += 1
        row.last_failure_at = now
        beyond = row.failures - settings.PALISADE_LOGIN_FREE_FAILURES
        if beyond >= 0:
            # Each failure past the free ones doubles the wait, up to fifteen minutes.
            seconds = min(settings.PALISADE_LOGIN_LOCKOUT_SECONDS * (2 ** min(beyond, 10)), 900)
            row.locked_until = now + timedelta(seconds=seconds)
        row.save()
        LoginThrottle.objects.filter(last_failure_at__lt=now - timedelta(days=1)).delete()


def session_input(data: Any) -> str:
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, {"password"}, findings)
    password = take_string(data, "password", findings, min_length=1, max_length=PASSWORD_MAX_LENGTH)
    findings.raise_if_any()
    return password


def session_open(*, password: str, client: str) -> OpenedSession:
    """Log in. Repeated failures from one client address must wait, whatever password they send."""
    now = clock.now()
    wait = _throttle_wait(client, now)
    if wait:
        raise Problem(
            "rate-limited",
            f"Too many failed logins from {client}; retry in {wait} s.",
            headers={"Retry-After": str(wait)},
            retry_after=wait,
        )
    operator = Operator.objects.filter(id=1).first()
    try:
        _hasher.verify(operator.password_hash if operator else _DUMMY_HASH, password)
        verified = operator is not None
    except (VerificationError, InvalidHashError):
        verified = False
    if not verified:
        _record_failure(client, now)
        detail = (
            "Wrong password."
            if operator
            else "No operator password is set; set it on the host with `manage.py operator-password`."
        )
        raise Problem("unauthenticated", detail)
    secret = new_secret(SESSION_PREFIX)
    expires_at = now + timedelta(seconds=settings.PALISADE_SESSION_LIFETIME_SECONDS)
    with transaction.atomic():
        LoginThrottle.objects.filter(client=client).delete()
        OperatorSession.objects.create(
            key_digest=digest(secret), created_at=now, expires_at=expires_at, client=client
        )
        OperatorSession.objects.filter(expires_at__lte=now).delete()
    return OpenedSession(secret=secret, expires_at=expires_at)


def session_close(*, actor: Actor) -> None:
    if actor.session_id is None:
        raise ValidationFailed(
            [Finding("", "not-a-session", "This request was not made with a session cookie.")]
        )
    OperatorSession.objects.filter(id=actor.session_id).delete()


def session_authenticate(*, secret: str) -> Actor | None:
    if not secret.startswith(SESSION_PREFIX):
        return None
    session = OperatorSession.objects.filter(key_digest=digest(secret)).first()
    if session is None or session.expires_at <= clock.now():
        return None
    return Actor(kind="session", label="operator (console session)", session_id=session.id)


@dataclass(frozen=True)
class MintedToken:
    secret: str
    token: OperatorToken


@dataclass(frozen=True)
class OperatorTokenInput:
    name: str
    expires_at: datetime | None


def operator_token_input(data: Any) -> OperatorTokenInput:
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, {"name", "expires_at"}, findings)
    name = take_string(data, "name", findings, min_length=1, max_length=100)
    expires_at = take_instant(data, "expires_at", findings)
    if expires_at is not None and expires_at <= clock.now():
        findings.add("/expires_at", "in-the-past", "expires_at must be in the future.")
    findings.raise_if_any()
    return OperatorTokenInput(name=name.strip(), expires_at=expires_at)


def operator_token_mint(*, actor: Actor, data: Mapping[str, Any]) -> MintedToken:
    spec = operator_token_input(data)
    secret = new_secret(OPERATOR_TOKEN_PREFIX)
    with transaction.atomic():
        token = OperatorToken.objects.create(
            name=spec.name,
            prefix=display_prefix(secret),
            digest=digest(secret),
            created_at=clock.now(),
            expires_at=spec.expires_at,
        )
        audit_record(
            actor=actor,
            action="operator_token.create",
            object_type="operator_token",
            object_id=token.id,
            object_name=token.name,
            detail={"prefix": token.prefix, "expires_at": clock.rfc3339(token.expires_at)},
        )
    return MintedToken(secret=secret, token=token)


def operator_token_revoke(*, actor: Actor, token_id: str) -> OperatorToken:
    with transaction.atomic():
        token = get_or_not_found(OperatorToken, token_id, what="operator token", for_update=True)
        if token.revoked_at is None:
            token.revoked_at = clock.now()
            token.save(update_fields=["revoked_at"])
            audit_record(
                actor=actor,
                action="operator_token.revoke",
                object_type="operator_token",
                object_id=token.id,
                object_name=token.name,
                detail={"prefix": token.prefix},
            )
    return token


@dataclass(frozen=True)
class _TokenRow:
    id: str
    name: str
    prefix: str
    revoked_at: datetime | None
    expires_at: datetime | None
    last_used_at: datetime | None


def _token_by_digest(token_digest: str) -> _TokenRow | None:
    # Every API request authenticates: a plain cursor skips the ORM's query compilation and model
    # building, which measured as about a fifth of serve's CPU per authenticated GET /me.
    table = OperatorToken._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT id, name, prefix, revoked_at, expires_at, last_used_at FROM {table} WHERE digest = %s",  # noqa: S608
            [token_digest],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    token_id, name, prefix, *instants = row
    # SQLite hands back naive UTC datetimes and UUIDs as 32 hex digits; PostgreSQL aware ones and UUIDs.
    revoked_at, expires_at, last_used_at = (
        value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value
        for value in instants
    )
    return _TokenRow(str(uuid.UUID(str(token_id))), name, prefix, revoked_at, expires_at, last_used_at)


def operator_token_authenticate(*, secret: str) -> Actor | None:
    if not secret.startswith(OPERATOR_TOKEN_PREFIX):
        return None
    token = _token_by_digest(digest(secret))
    now = clock.now()
    if token is None or token.revoked_at is not None or (token.expires_at and token.expires_at <= now):
        return None
    resolution = timedelta(seconds=settings.PALISADE_TOKEN_LAST_USED_RESOLUTION_SECONDS)
    if token.last_used_at is None or now - token.last_used_at >= resolution:
        # Coarse on purpose: a write per request would cost more than the request.
        OperatorToken.objects.filter(id=token.id).update(last_used_at=now)
    return Actor(kind="token", label=f"token {token.name} ({token.prefix})", token_id=str(token.id))
