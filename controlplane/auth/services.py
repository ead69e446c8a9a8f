"""Writes of operator authentication: the password, sessions, operator tokens and the login throttle."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from django.conf import settings
from django.db import connection, transaction
from django.db.models import F

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
log = logging.getLogger("palisade.auth")
_hasher = PasswordHasher()
# Verifying against this when no operator exists keeps a wrong password as slow as a right one.
_DUMMY_HASH = _hasher.hash("palisade-no-operator-yet")


def operator_set_password(*, actor: Actor, password: str) -> None:
    """Set or reset the one operator's password; every open session ends (tokens stay valid) and every
    login wait is lifted."""
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
        # Guesses were against the old password; the host that set the new one is let back in.
        LoginThrottle.objects.all().delete()
        audit_record(
            actor=actor,
            action="operator.set_password",
            object_type="operator",
            object_id=1,
            detail={"sessions_ended": True, "login_throttle_reset": True},
        )


@dataclass(frozen=True)
class OpenedSession:
    secret: str
    expires_at: datetime


# The row of the budget shared by every client address ("*" is no address).
ALL_CLIENTS = "*"


def _throttle_row(client: str) -> LoginThrottle:
    """The client's row, locked until the transaction ends; created first if missing, without a race
    (two first attempts from one address must not both see no row)."""
    LoginThrottle.objects.bulk_create(
        [LoginThrottle(client=client, failures=0, last_failure_at=clock.now())], ignore_conflicts=True
    )
    return LoginThrottle.objects.select_for_update().get(client=client)


def _seconds_until(instant: datetime | None, now: datetime) -> int:
    if instant is None or instant <= now:
        return 0
    return max(1, math.ceil((instant - now).total_seconds()))


def _refused(wait: int, detail: str) -> Problem:
    return Problem("rate-limited", detail, headers={"Retry-After": str(wait)}, retry_after=wait)


def _attempt_take(client: str, now: datetime) -> None:
    """Count a login attempt as a failure before its password is verified, or refuse it.

    Counting first is what bounds the guesses: concurrent attempts from one address are taken one at
    a time under the rows' locks, so exactly the free ones are verified and the rest refused, however
    many arrive together. A successful login hands its attempt back (session_open)."""
    with transaction.atomic():
        # Always the shared row first, then the client's: one lock order, no deadlock.
        shared = _throttle_row(ALL_CLIENTS)
        row = _throttle_row(client)
        wait = _seconds_until(row.locked_until, now)
        if wait:
            raise _refused(wait, f"Too many failed logins from {client}; retry in {wait} s.")
        if shared.locked_until is None or shared.locked_until <= now:
            # A window opens with the first attempt after the last one closed.
            shared.failures = 0
            shared.locked_until = now + timedelta(seconds=settings.PALISADE_LOGIN_GLOBAL_WINDOW_SECONDS)
        if shared.failures >= settings.PALISADE_LOGIN_GLOBAL_FAILURES:
            wait = _seconds_until(shared.locked_until, now)
            raise _refused(
                wait,
                f"Too many failed logins from all addresses together; retry in {wait} s, or lift the wait "
                "on the host with `manage.py operator-login-throttle reset`.",
            )
        shared.failures += 1
        shared.last_failure_at = now
        if shared.failures == settings.PALISADE_LOGIN_GLOBAL_FAILURES:
            log.warning(
                "%d login attempts from all addresses in this window: every login is refused until %s; "
                "`manage.py operator-login-throttle reset` lifts this",
                shared.failures,
                clock.rfc3339(shared.locked_until),
            )
        shared.save()
        row.failures += 1
        row.last_failure_at = now
        beyond = row.failures - settings.PALISADE_LOGIN_FREE_FAILURES
        if beyond >= 0:
            # The last free attempt closes the door behind it; each later one doubles the wait, up to
            # fifteen minutes.
            seconds = min(settings.PALISADE_LOGIN_LOCKOUT_SECONDS * (2 ** min(beyond, 10)), 900)
            row.locked_until = now + timedelta(seconds=seconds)
        row.save()
        LoginThrottle.objects.filter(last_failure_at__lt=now - timedelta(days=1)).exclude(
            client=ALL_CLIENTS
        ).delete()


def _attempt_return(client: str) -> None:
    """A successful login: the client's count starts again, and its attempt leaves the shared budget."""
    LoginThrottle.objects.filter(client=client).delete()
    LoginThrottle.objects.filter(client=ALL_CLIENTS, failures__gt=0).update(failures=F("failures") - 1)


def login_throttle_reset(*, actor: Actor) -> int:
    """Lift every login wait, of each address and of all together: the host's way back in when
    guessing has spent the shared budget. Returns how many addresses were waiting or counted."""
    with transaction.atomic():
        counted = LoginThrottle.objects.exclude(client=ALL_CLIENTS).count()
        LoginThrottle.objects.all().delete()
        audit_record(
            actor=actor,
            action="operator.login_throttle_reset",
            object_type="operator",
            object_id=1,
            detail={"addresses": counted},
        )
    return counted


def session_input(data: Any) -> str:
    data = require_object(data)
    findings = Findings()
    reject_unknown(data, {"password"}, findings)
    password = take_string(data, "password", findings, min_length=1, max_length=PASSWORD_MAX_LENGTH)
    findings.raise_if_any()
    return password


def session_open(*, password: str, client: str) -> OpenedSession:
    """Log in. Each attempt is counted before its password is verified: one client address gets
    PALISADE_LOGIN_FREE_FAILURES, all addresses together PALISADE_LOGIN_GLOBAL_FAILURES per window;
    beyond them every attempt waits, whatever password it sends."""
    now = clock.now()
    _attempt_take(client, now)
    operator = Operator.objects.filter(id=1).first()
    try:
        _hasher.verify(operator.password_hash if operator else _DUMMY_HASH, password)
        verified = operator is not None
    except (VerificationError, InvalidHashError):
        verified = False
    if not verified:
        detail = (
            "Wrong password."
            if operator
            else "No operator password is set; set it on the host with `manage.py operator-password`."
        )
        raise Problem("unauthenticated", detail)
    secret = new_secret(SESSION_PREFIX)
    expires_at = now + timedelta(seconds=settings.PALISADE_SESSION_LIFETIME_SECONDS)
    with transaction.atomic():
        _attempt_return(client)
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


def token_revoke(model, *, actor: Actor, token_id: str, what: str, name: Callable[[Any], str]):
    """Revoke a token (an operator token, a provisioning token: a row with `revoked_at` and `prefix`):
    it is refused from now on. Revoking twice is harmless and keeps the first instant; the revoke is
    audited once, as `<type>.revoke`, the token named by `name`."""
    object_type = what.replace(" ", "_")
    with transaction.atomic():
        token = get_or_not_found(model, token_id, what=what, for_update=True)
        if token.revoked_at is None:
            token.revoked_at = clock.now()
            token.save(update_fields=["revoked_at"])
            audit_record(
                actor=actor,
                action=f"{object_type}.revoke",
                object_type=object_type,
                object_id=token.id,
                object_name=name(token),
                detail={"prefix": token.prefix},
            )
    return token


def operator_token_revoke(*, actor: Actor, token_id: str) -> OperatorToken:
    return token_revoke(
        OperatorToken, actor=actor, token_id=token_id, what="operator token", name=lambda token: token.name
    )


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
